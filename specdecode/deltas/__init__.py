"""Sequence deltas on the wire, both halves: the encoder (the orchestrator sends what a
service lacks) and the store (a service rebuilds full sequences from what it holds)."""
