"""The orchestrator: scheduler, rejection sampler, metrics, public API servicer, service clients, CLI."""
