"""Scorer service: batch-expansion and multi-query scorers and their gRPC servicer."""
