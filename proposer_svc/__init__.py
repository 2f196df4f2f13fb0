"""Proposer service: draft-model and n-gram proposers and their gRPC servicer."""
