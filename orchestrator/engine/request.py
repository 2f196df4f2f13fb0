"""What the engine takes and gives: a request, its running sequence, one step's output.

The frontend validates a request once (orchestrator.frontend.request) before it reaches the
engine; the engine trusts its fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from orchestrator.engine.detokenizer import Detokenizer
from orchestrator.engine.outbox import Outbox
from specdecode.api.usage import Usage
from specdecode.sequence import SamplingParams


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    num_speculative_tokens: int | None = None  # None = the engine's k; 0 = no speculation
    # The OpenTelemetry context of the request's span, carried explicitly to the engine
    # thread (contextvars do not cross threads); None when the request is not traced.
    trace_context: Any = field(default=None, repr=False, compare=False)
    # The client's deadline (time.monotonic()), or None: internal calls never outlive it.
    deadline: float | None = None
    # Text of the output and its stop strings (None: token ids only, no stop strings).
    detokenizer: Detokenizer | None = field(default=None, repr=False, compare=False)
    # Its client's outputs not yet taken (back-pressure), or None: never paused.
    outbox: Outbox | None = field(default=None, repr=False, compare=False)


@dataclass
class Sequence:
    seq_id: int
    request: Request
    output_token_ids: list[int] = field(default_factory=list)
    # Its usage so far; accepted_tokens counts the draft tokens it received (each speculative
    # step's accepted prefix), so accepted_tokens <= emitted_tokens - speculative steps (the
    # step metrics also count, as vLLM 0.4.2 does, draft tokens that passed the accept test
    # after an earlier rejection: StepStats.accepted_tokens).
    stats: Usage = field(default_factory=Usage)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    # Prompt tokens the services already hold from earlier chunks (chunked prefill).
    prefilled: int = 0
    # Tokens whose KV state a draft model holds, as far as the proposer calls tell: what
    # it was sent, plus its own proposals that were accepted (the policy's catch-up).
    drafted: int = 0

    @property
    def token_ids(self) -> list[int]:
        return [*self.request.prompt_token_ids, *self.output_token_ids]

    @property
    def paused(self) -> bool:
        """Whether its client's outputs are full: it is not scheduled (its KV state stays)."""
        outbox = self.request.outbox
        return outbox is not None and outbox.full

    @property
    def decoding(self) -> bool:
        """Whether its prompt is computed (it has output tokens)."""
        return bool(self.output_token_ids)


@dataclass
class TokenLogprobs:
    """The target model's log-probabilities at one emitted position (before any sampling
    control: the model's own distribution)."""

    token_id: int
    logprob: float  # of token_id
    top: list[tuple[int, float]]  # the n most likely (token id, logprob), most likely first


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    stats: Usage  # the sequence's usage, as of this output
    # One per new token when the request asked for logprobs, else None.
    logprobs: list[TokenLogprobs] | None = None
    text: str = ""  # the new text (with a detokenizer): stop strings and stop ids left out


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], n: int) -> list[TokenLogprobs]:
    """logprobs [k+1, V] of one sequence's step, token_ids[j] emitted at position j ->
    each token's log-probability and the n most likely at its position."""
    rows = logprobs[:len(token_ids)].float()  # [T, V]
    top = rows.topk(n, dim=-1) if n else None
    out = []
    for j, t in enumerate(token_ids):
        best = [] if top is None else list(zip(top.indices[j].tolist(), top.values[j].tolist()))
        out.append(TokenLogprobs(t, float(rows[j, t]), best))
    return out
