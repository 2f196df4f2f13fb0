"""The engine with an in-process proposer and scorer (no services): for programs that embed
specdecode, and for tests and benchmarks. It composes the three packages through their
public constructors, which is why it lives above them."""

from __future__ import annotations

import torch

from orchestrator.engine.build import build_engine
from orchestrator.engine.core import SpecDecodeEngine
from proposer_svc.draft import DraftModelProposer
from proposer_svc.ngram import NgramProposer
from proposer_svc.pruned_head import prune_lm_head
from scorer_svc.methods import make_scorer
from specdecode.executor.calibration import calibrate, calibration_widths
from specdecode.grammar.compiler import GrammarCompiler
from specdecode.grammar.matcher import Grammars
from specdecode.model_info import NGRAM
from specdecode.executor.model_runner import ModelRunner
from specdecode.executor.worker import ModelWorker


def build_inprocess_engine(target, draft, scoring: str = "batch-expansion", k: int = 4,
                           device: torch.device = torch.device("cpu"),
                           ngram_min: int = 2,
                           adaptive: bool = False, draft_vocab_size: int = 0, draft_dir=None,
                           enforce_eager: bool | None = None,
                           compile_batch_sizes: tuple[int, ...] | None = None,
                           draft_confidence: float = 0.0, tokenizer=None,
                           deterministic: bool = False,
                           async_drafting: str = "off") -> SpecDecodeEngine:
    """target: a loaded causal LM; draft: another (sharing its vocabulary), or "ngram".
    scoring: batch-expansion | multi-query | auto; adaptive: k per sequence and step from
    measured costs (else every sequence speculates k); draft_vocab_size: prune the draft's
    LM head to that many most frequent ids (its tokenizer.json in draft_dir ranks them;
    this modifies `draft` in place); draft_confidence: the draft stops after a token it
    was less sure of (proposer_svc.draft); tokenizer: the models' (transformers), for
    structured output (the draft and the target each keep their grammar states);
    deterministic: row-invariant numerics in both models (specdecode.executor.invariant_ops);
    async_drafting: draft ahead (auto never does here: the proposer and scorer share this
    process's cores);
    enforce_eager, compile_batch_sizes: both runners' (specdecode.executor.model_runner)."""
    compiler = None if tokenizer is None else GrammarCompiler(tokenizer,
                                                              target.config.vocab_size)
    grammars = (lambda: None) if compiler is None else (lambda: Grammars(compiler))
    target_runner = ModelRunner(target, device, enforce_eager=enforce_eager,
                                deterministic=deterministic,
                                compile_batch_sizes=compile_batch_sizes)
    max_len = target_runner.max_model_len
    target_costs = (calibrate(target_runner, tokens=calibration_widths(k + 1))
                    if adaptive or scoring == "auto" else None)
    draft_costs = None
    if draft == NGRAM:
        proposer = NgramProposer(max_len, n_min=ngram_min)
    else:
        prune_lm_head(draft, draft_dir, draft_vocab_size)
        draft_runner = ModelRunner(draft, device, enforce_eager=enforce_eager,
                                   deterministic=deterministic,
                                   compile_batch_sizes=compile_batch_sizes)
        max_len = min(max_len, draft_runner.max_model_len)
        draft_costs = (calibrate(draft_runner, tokens=calibration_widths(k + 1, catch_up=True))
                       if adaptive else None)
        proposer = DraftModelProposer(ModelWorker(draft_runner, "draft", grammars()),
                                      draft_confidence)
    scorer = make_scorer(scoring, ModelWorker(target_runner, "target", grammars()), target_costs)
    return build_engine(proposer, scorer, k=k, adaptive=adaptive, scoring=scoring,
                        draft_model=draft != NGRAM, scorer_costs=target_costs,
                        draft_costs=draft_costs, max_model_len=max_len, grammars=grammars(),
                        async_drafting=async_drafting)
