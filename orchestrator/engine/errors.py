"""What the engine raises when its services fail: the frontend maps these to statuses
without knowing how the services are reached (orchestrator.cluster raises them)."""

from __future__ import annotations


class ServiceUnavailableError(RuntimeError):
    """No replica of a service could serve a step within its retry budget."""
