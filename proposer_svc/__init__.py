"""Proposer service: draft-model and n-gram proposers, their gRPC servicer and the entry point
(serve)."""
