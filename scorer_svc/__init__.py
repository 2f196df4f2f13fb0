"""Scorer service: batch-expansion and multi-query scorers, their gRPC servicer and the entry
point (serve)."""
