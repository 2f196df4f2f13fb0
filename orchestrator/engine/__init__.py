"""The engine: every running sequence's step (plan, propose, score, verify, postprocess) on
its own thread, the speculation policy and the rejection sampler. Knows nothing of gRPC."""
