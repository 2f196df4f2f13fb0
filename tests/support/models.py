"""The tiny random Llama pair the tests use (one vocabulary), and engines over them."""

from __future__ import annotations

import torch

from orchestrator.engine.core import SpecDecodeEngine
from orchestrator.engine.request import Request
from specdecode.executor.model_runner import ModelRunner
from specdecode.sequence import SamplingParams
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model
from specdecode.executor.worker import ModelWorker
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


def self_drafting_pair(num_layers: int, hidden_size: int):
    """A tiny target without attention whose layers after the first add nothing (their MLP
    outputs zeroed) and its first layer alone as the draft: the draft computes the target's
    own function at a fraction of its cost, so every proposal is accepted and speculating
    pays. (target, draft)"""
    spec = dict(seed=1, attention=False, hidden_size=hidden_size)
    target = build_tiny_model(TinyModelSpec(**spec, num_layers=num_layers))
    draft = build_tiny_model(TinyModelSpec(**spec, num_layers=1))
    with torch.no_grad():
        for layer in target.model.layers[1:]:
            layer.mlp.down_proj.weight.zero_()
    draft.load_state_dict(target.state_dict(), strict=False)  # layer 0, norms, embeddings, head
    return target, draft


def save_self_drafting_pair(root, num_layers: int, hidden_size: int) -> tuple[str, str]:
    """self_drafting_pair saved under `root`: (target, draft) directories."""
    target, draft = self_drafting_pair(num_layers, hidden_size)
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return str(root / "target"), str(root / "draft")
