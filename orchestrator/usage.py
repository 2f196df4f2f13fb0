"""Token and speculation counts of a request, as both public APIs and the clients report them."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Usage:
    """Counts of one sample of a request (or a sum over samples)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0  # tokens generated and returned
    draft_tokens: int = 0  # draft tokens proposed
    accepted_tokens: int = 0  # draft tokens the target accepted
    emitted_tokens: int = 0  # tokens emitted by speculative steps (accepted + one per step)
    steps: int = 0  # decoding steps taken part in

    @property
    def acceptance_rate(self) -> float:
        """accepted / draft tokens; NaN when nothing was drafted."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else math.nan

    def as_json(self) -> dict:
        """The counts and the acceptance rate (None for NaN), for JSON."""
        rate = self.acceptance_rate
        return {**vars(self), "acceptance_rate": None if math.isnan(rate) else rate}
