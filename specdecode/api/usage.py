"""Token and speculation counts of a request, as both public APIs and the clients report them;
the one place that builds, sums and converts them (wire, JSON, OpenAI's usage)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdecode.v1 import spec_decode_service_pb2 as pb


@dataclass
class Usage:
    """Counts of one sample of a request (or a sum over samples); the engine keeps one per
    sequence as it runs."""

    prompt_tokens: int = 0
    completion_tokens: int = 0  # tokens generated and returned
    draft_tokens: int = 0  # draft tokens proposed
    accepted_tokens: int = 0  # draft tokens the target accepted
    emitted_tokens: int = 0  # tokens emitted by speculative steps (accepted + one per step)
    steps: int = 0  # decoding steps taken part in

    def observe_step(self, proposed: int, emitted: int) -> None:
        """One decoding step: `proposed` draft tokens (0: it did not speculate), `emitted`
        tokens (a speculative step's accepted prefix + 1)."""
        self.steps += 1
        if proposed:
            self.draft_tokens += proposed
            self.accepted_tokens += emitted - 1
            self.emitted_tokens += emitted

    @property
    def acceptance_rate(self) -> float:
        """accepted / draft tokens; NaN when nothing was drafted."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else math.nan

    def as_json(self) -> dict:
        """The counts and the acceptance rate (None for NaN), for JSON."""
        rate = self.acceptance_rate
        return {**vars(self), "acceptance_rate": None if math.isnan(rate) else rate}


def add_usage(total: Usage, sample: Usage) -> Usage:
    """Sum samples' usage, counting their shared prompt once."""
    return Usage(max(total.prompt_tokens, sample.prompt_tokens),
                 total.completion_tokens + sample.completion_tokens,
                 total.draft_tokens + sample.draft_tokens,
                 total.accepted_tokens + sample.accepted_tokens,
                 total.emitted_tokens + sample.emitted_tokens, total.steps + sample.steps)


def usage_to_proto(u: Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                    draft_tokens=u.draft_tokens, accepted_tokens=u.accepted_tokens,
                    emitted_tokens=u.emitted_tokens, acceptance_rate=u.acceptance_rate,
                    steps=u.steps)


def usage_from_proto(u: pb.Usage) -> Usage:
    """The counts of a Usage message (its acceptance_rate is derived from them again)."""
    return Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                 draft_tokens=u.draft_tokens, accepted_tokens=u.accepted_tokens,
                 emitted_tokens=u.emitted_tokens, steps=u.steps)


def openai_usage(u: Usage) -> dict:
    """OpenAI's usage, with our speculative counters as the extension `speculative`."""
    counts = u.as_json()
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "speculative": {k: counts[k] for k in ("draft_tokens", "accepted_tokens",
                                                   "emitted_tokens", "acceptance_rate",
                                                   "steps")}}
