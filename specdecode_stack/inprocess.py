"""The engine with an in-process proposer and scorer (no services): for programs that embed
specdecode, and for tests and benchmarks. It composes the three packages through their
public constructors, which is why it lives above them."""

from __future__ import annotations

import torch

from orchestrator.engine import SpecDecodeEngine
from proposer_svc.draft import DraftModelProposer
from proposer_svc.ngram import NgramProposer
from scorer_svc.methods import SCORING_METHODS
from specdecode.model_runner import ModelRunner
from specdecode.worker import ModelWorker


def build_inprocess_engine(target, draft, scoring: str = "batch-expansion", k: int = 4,
                           device: torch.device = torch.device("cpu"),
                           ngram_min: int = 2) -> SpecDecodeEngine:
    """target: a loaded causal LM; draft: another (sharing its vocabulary), or "ngram"."""
    max_len = target.config.max_position_embeddings
    proposer = (NgramProposer(max_len, n_min=ngram_min) if draft == "ngram"
                else DraftModelProposer(ModelWorker(ModelRunner(draft, device), "draft")))
    scorer = SCORING_METHODS[scoring](ModelWorker(ModelRunner(target, device), "target"))
    return SpecDecodeEngine(proposer, scorer, vocab_size=target.config.vocab_size,
                            max_model_len=max_len, num_speculative_tokens=k)
