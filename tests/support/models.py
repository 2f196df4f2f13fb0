"""The tiny random Llama pair the tests use (one vocabulary), and engines over them."""

from __future__ import annotations

import torch

from orchestrator.engine.core import SpecDecodeEngine
from orchestrator.engine.request import Request
from specdecode.model_runner import ModelRunner
from specdecode.sequence import SamplingParams
from specdecode.tiny_models import TinyModelSpec
from specdecode.worker import ModelWorker
from specdecode_stack.inprocess import build_inprocess_engine

CPU = torch.device("cpu")
TARGET = TinyModelSpec(seed=1)
DRAFT = TinyModelSpec(seed=2, num_layers=1)


def worker(model, purpose: str) -> ModelWorker:
    return ModelWorker(ModelRunner(model, CPU), purpose)


def make_engine(target, draft, scoring: str, k: int) -> SpecDecodeEngine:
    """draft: a model, or "ngram"."""
    # n_min=1: on random models longer n-grams rarely recur, and proposals are what we test.
    return build_inprocess_engine(target, draft, scoring, k, CPU, ngram_min=1)


def greedy_request(rid: str, prompt: list[int], max_tokens: int, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), **kw)
