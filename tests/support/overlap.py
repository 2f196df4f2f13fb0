"""Requests and engines the overlap tests share: greedy and seeded top-p rows with
per-request k, an engine with overlap on or off."""

from __future__ import annotations

from orchestrator.engine.core import SpecDecodeEngine
from orchestrator.engine.request import Request
from specdecode.sequence import SamplingParams
from tests.support.models import make_engine

PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42], [7, 8, 9, 7, 8, 9, 7, 8],
           [200, 100, 50], [9] * 20, [3, 1, 4, 1, 5, 9, 2, 6], [11, 22, 33, 44, 55]]


def params(i: int, max_tokens: int = 20) -> SamplingParams:
    """Even rows greedy, odd rows seeded top-p sampling."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=max_tokens)
    return SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=max_tokens)


def engines(target, draft, overlap: bool) -> SpecDecodeEngine:
    base = make_engine(target, draft, "batch-expansion", 3)
    return SpecDecodeEngine(base.proposer, base.scorer, max_model_len=base.max_model_len,
                            num_speculative_tokens=3,
                            overlap=overlap)


def requests() -> list[Request]:
    # Per-request k differs (None = the engine's 3): groups must not change any sequence's k.
    return [Request(f"r{i}", p, params(i), num_speculative_tokens=[None, 1, 2][i % 3])
            for i, p in enumerate(PROMPTS)]
