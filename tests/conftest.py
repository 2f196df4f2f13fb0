"""Shared fixtures: tiny random-initialised Llama models that share one vocabulary."""

from __future__ import annotations

import re
import urllib.request

import pytest
import torch
from scipy import stats

from bench.tiny_models import TinyModelSpec, build_tiny_model
from orchestrator.engine.request import Request
from orchestrator.engine.core import SpecDecodeEngine
from specdecode.model_runner import ModelRunner
from specdecode.sampling import truncated_probs
from specdecode.sequence import SamplingParams
from specdecode.worker import ModelWorker
from specdecode_stack.inprocess import build_inprocess_engine

CPU = torch.device("cpu")
TARGET = TinyModelSpec(seed=1)
DRAFT = TinyModelSpec(seed=2, num_layers=1)


@pytest.fixture(scope="session")
def target_model():
    return build_tiny_model(TARGET)


@pytest.fixture(scope="session")
def draft_model():
    return build_tiny_model(DRAFT)


def worker(model, purpose: str) -> ModelWorker:
    return ModelWorker(ModelRunner(model, CPU), purpose)


def make_engine(target, draft, scoring: str, k: int) -> SpecDecodeEngine:
    """draft: a model, or "ngram"."""
    # n_min=1: on random models longer n-grams rarely recur, and proposals are what we test.
    return build_inprocess_engine(target, draft, scoring, k, CPU, ngram_min=1)


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Target-only greedy decoding with full recomputation (no cache, no batching)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def greedy_request(rid: str, prompt: list[int], max_tokens: int, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), **kw)


@torch.inference_mode()
def target_pair_probs(model, prompt: list[int], params: SamplingParams) -> dict[tuple, float]:
    """The target's exact joint p(t1) p(t2 | t1) of a request's first two tokens, under the
    request's truncation (full recomputation: no cache, no batching)."""
    def dist(tokens):
        return truncated_probs(model(torch.tensor([tokens])).logits[0, -1:], params)[0]
    p1, joint = dist(prompt), {}
    for t1 in p1.nonzero().flatten().tolist():
        p2 = dist(prompt + [t1])
        for t2 in p2.nonzero().flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


def chi_square_pvalue(draws: list[tuple], expected: dict[tuple, float]) -> float:
    """Chi-square of the draws against `expected` (probabilities): cells expecting >= 5
    draws (the test's validity condition), the rest pooled into one cell. Callers assert
    p > 1e-3 with fixed seeds: a correct sampler fails 1 seed set in 1000; one that drops
    truncation or mixes in the draft's q fails outright."""
    n = len(draws)
    big = [c for c, p in expected.items() if p * n >= 5]
    observed = [sum(d == c for d in draws) for c in big]
    exp = [expected[c] * n for c in big]
    observed.append(n - sum(observed))
    exp.append(n - sum(exp))
    if exp[-1] < 1e-9:  # nothing pooled
        observed, exp = observed[:-1], exp[:-1]
    # float32 probabilities sum to 1 within ~1e-6, and SciPy wants the totals equal to
    # ~1e-8: rescale what float rounding left over (a real shortfall fails here instead).
    total = sum(exp)
    assert abs(total - n) < 1e-4 * n, f"expected counts sum to {total}, not {n}"
    return stats.chisquare(observed, [e * n / total for e in exp]).pvalue


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, target_model, draft_model):
    """The tiny target and draft saved as safetensors directories, for service processes,
    plus a draft whose vocabulary does not match (for the compatibility check)."""
    root = tmp_path_factory.mktemp("models")
    dirs = {"target": root / "target", "draft": root / "draft", "bad_draft": root / "bad"}
    target_model.save_pretrained(dirs["target"])
    draft_model.save_pretrained(dirs["draft"])
    build_tiny_model(TinyModelSpec(seed=3, vocab_size=300, num_layers=1)).save_pretrained(
        dirs["bad_draft"])
    return {k: str(v) for k, v in dirs.items()}


MODEL_NAME_LABEL = re.compile(r'model_name="[^"]*"')


def scrape_metrics(port: int) -> dict[str, float]:
    """`name{labels}` -> value of the specdecode_* samples at a /metrics endpoint. Every
    sample must carry a model_name label; the keys leave it out."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for m in re.finditer(r"^(specdecode_\S+) (\S+)$", body, re.M):
        assert 'model_name="' in m.group(1), m.group(1)
        key = MODEL_NAME_LABEL.sub("", m.group(1))
        key = key.replace("{,", "{").replace(",}", "}").replace(",,", ",").replace("{}", "")
        out[key] = float(m.group(2))
    return out
