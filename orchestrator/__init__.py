"""The orchestrator: scheduler, rejection sampler, metrics, public API servicer, clients of
the two services, client of the public API, and its entry point (serve)."""
