"""In-process engine benchmark: target-only vs speculative tokens/s, and the cost of one
scoring call, batch expansion vs multi-query.

    python bench/engine_bench.py [--models tiny,smollm2] [--repeats 3] [--out bench/results/engine.json]
    python bench/engine_bench.py --models random-1b --device cuda --dtype bfloat16   # on a GPU

Models: tiny (random, draft = a 1-layer random model: ~0% acceptance, overhead bound),
smollm2 (SmolLM2-135M-Instruct, n-gram proposer, code prompts), random-1b (a random
Llama of ~1B parameters; the draft is the same model, so every proposal is accepted: the
upper bound of what speculation can buy on that device).

Every configuration runs `repeats` times in this one process, interleaved, and the table
reports medians: the machine is shared and noisy, so compare ratios within one run.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from orchestrator.engine.request import Request
from orchestrator.engine.core import SpecDecodeEngine
from scorer_svc.methods import SCORING_METHODS, scorer_class
from specdecode.executor.device import resolve_device, resolve_dtype
from specdecode.interfaces import SpeculativeProposals
from specdecode.executor.model_runner import ModelRunner
from specdecode.models.checkpoints import load_model, load_tokenizer
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,
                                 SequenceGroupMetadata)
from specdecode.executor.worker import ModelWorker
from specdecode_stack.inprocess import build_inprocess_engine
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model

DEVICE = torch.device("cpu")
CODE_PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\nclass Size:\n",
    "<|im_start|>user\nWrite a Python function that reverses a list.<|im_end|>\n<|im_start|>assistant\n",
]


def models(name: str, dtype: torch.dtype):
    """(target, draft or "ngram", prompts as token ids)."""
    if name == "random-1b":
        target = build_tiny_model(TinyModelSpec(
            seed=1, vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=16,
            max_position_embeddings=2048, initializer_range=0.02)).to(DEVICE, dtype)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 32000, (n,), generator=gen).tolist() for n in (64, 128, 256, 512)]
        return target, target, prompts
    if name == "tiny":
        target = build_tiny_model(TinyModelSpec(seed=1, hidden_size=256, num_layers=4)).to(DEVICE, dtype)
        draft = build_tiny_model(TinyModelSpec(seed=2, hidden_size=64, num_layers=1)).to(DEVICE, dtype)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (8, 16, 24, 32)]
        return target, draft, prompts
    target = load_model(None, DEVICE, dtype)
    tok = load_tokenizer(None)
    return target, "ngram", [tok(p).input_ids for p in CODE_PROMPTS]


def engine(target, draft, scoring: str, k: int) -> SpecDecodeEngine:
    return build_inprocess_engine(target, draft, scoring, k, DEVICE)


def tokens_per_second(target, draft, scoring, k, prompts, batch, max_tokens) -> dict:
    """One batch to completion: tokens/s, acceptance, steps, acceptance by draft position and
    the mean step time split (from the engine's step stats)."""
    eng = engine(target, draft, scoring, k)
    for i in range(batch):
        eng.add_request(Request(f"r{i}", prompts[i % len(prompts)],
                                SamplingParams(max_tokens=max_tokens)))
    tokens, steps = 0, []
    start = time.perf_counter()
    while eng.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in eng.step())
        steps.append(eng.last_step)
    seconds = time.perf_counter() - start
    draft_tokens = sum(s.draft_tokens for s in steps)
    by_position = [sum(s.accepted_by_position[j] for s in steps if j < s.k) for j in range(k)]
    split = {"propose": sum(s.propose_s for s in steps), "score": sum(s.score_s for s in steps),
             "verify": sum(s.verify_s for s in steps)}
    split["overhead"] = sum(s.total_s for s in steps) - sum(split.values())
    return {"tokens_per_s": tokens / seconds,
            "acceptance": sum(s.accepted_tokens for s in steps) / draft_tokens
            if draft_tokens else None,
            "steps": len(steps), "accepted_by_position": by_position,
            "spec_sequences": sum(s.spec_sequences for s in steps),
            "step_ms": {p: 1000 * v / len(steps) for p, v in split.items()}}


def scoring_call_ms(target, scoring: str, B: int, k: int, context: int) -> float:
    """One ScoreProposals on a warm cache: B sequences of `context` tokens, k proposals each."""
    scorer = scorer_class(scoring)(ModelWorker(ModelRunner(target, DEVICE), "target"))
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(B * 100 + k)
    groups = [SequenceGroupMetadata(str(i), False, {i: SequenceData(
        torch.randint(0, vocab, (context,), generator=gen).tolist(), [1])}, SamplingParams())
        for i in range(B)]
    req = ExecuteModelRequest(groups, num_lookahead_slots=k)
    props = SpeculativeProposals(torch.randint(0, vocab, (B, k), generator=gen), None,
                                 torch.full((B,), k))
    scorer.score_proposals(req, props)  # fills the KV cache with the context
    sync()
    start = time.perf_counter()
    scorer.score_proposals(req, props)
    sync()
    return (time.perf_counter() - start) * 1000


def sync() -> None:
    if DEVICE.type != "cpu":
        getattr(torch, DEVICE.type).synchronize()


@click.command()
@click.option("--models", "model_names", default="tiny,smollm2", show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@click.option("--ks", default="4", show_default=True, help="Draft lengths to decode with.")
@click.option("--batches", default="1,4", show_default=True, help="Batch sizes to decode.")
@click.option("--out", default="bench/results/engine.json", show_default=True)
@click.option("--plots", "plot_dir", default="bench/results", show_default=True,
              help="Directory for the PNG plots (engine_<model>_*.png).")
def main(model_names: str, repeats: int, max_tokens: int, device: str, dtype: str, ks: str,
         batches: str, out: str, plot_dir: str) -> None:
    global DEVICE
    DEVICE = resolve_device(device)
    console = Console(width=160)
    results = {"device": device, "dtype": dtype, "decode": [], "scoring": []}
    for name in model_names.split(","):
        target, draft, prompts = models(name, resolve_dtype(dtype))
        proposer = {"tiny": "1-layer random draft", "smollm2": "n-gram",
                    "random-1b": "draft = target"}[name]
        decode_cfgs = [(scoring, k, batch) for batch in map(int, batches.split(","))
                       for scoring, k in [("target-only", 0)] + [
                           (s, k) for s in SCORING_METHODS for k in map(int, ks.split(","))]]
        samples = {cfg: [] for cfg in decode_cfgs}
        for _ in range(repeats):
            for scoring, k, batch in decode_cfgs:
                samples[(scoring, k, batch)].append(tokens_per_second(
                    target, draft, "multi-query" if k == 0 else scoring, k, prompts, batch,
                    max_tokens))
        table = Table(title=f"{name} ({DEVICE.type}, {dtype}): decode, {max_tokens} tokens/"
                            f"request, proposer {proposer}")
        for col in ("batch", "mode", "k", "tokens/s (median)", "vs target-only", "acceptance", "steps"):
            table.add_column(col)
        for scoring, k, batch in decode_cfgs:
            runs = samples[(scoring, k, batch)]
            tps = statistics.median(r["tokens_per_s"] for r in runs)
            base = statistics.median(r["tokens_per_s"] for r in samples[("target-only", 0, batch)])
            acc = runs[0]["acceptance"]
            row = {"model": name, "batch": batch, "mode": scoring, "k": k, "tokens_per_s": tps,
                   "speedup": tps / base, "acceptance": acc, "steps": runs[0]["steps"],
                   "accepted_by_position": runs[0]["accepted_by_position"],
                   "spec_sequences": runs[0]["spec_sequences"],
                   "step_ms": {p: statistics.median(r["step_ms"][p] for r in runs)
                               for p in runs[0]["step_ms"]}}
            results["decode"].append(row)
            table.add_row(str(batch), scoring, str(k), f"{tps:.1f}", f"{tps / base:.2f}x",
                          "-" if acc is None else f"{acc:.2f}", str(row["steps"]))
        console.print(table)

        scoring_cfgs = [(B, k) for B in (1, 4) for k in (1, 4, 8)]
        times = {(s, B, k): [] for s in SCORING_METHODS for B, k in scoring_cfgs}
        for _ in range(repeats):
            for B, k in scoring_cfgs:
                for s in SCORING_METHODS:
                    times[(s, B, k)].append(scoring_call_ms(target, s, B, k, context=64))
        table = Table(title=f"{name}: one scoring call (warm cache, 64-token context)")
        for col in ("B", "k", "batch expansion ms", "multi-query ms", "BE / MQ"):
            table.add_column(col)
        for B, k in scoring_cfgs:
            be = statistics.median(times[("batch-expansion", B, k)])
            mq = statistics.median(times[("multi-query", B, k)])
            results["scoring"].append({"model": name, "B": B, "k": k, "batch_expansion_ms": be,
                                       "multi_query_ms": mq, "ratio": be / mq})
            table.add_row(str(B), str(k), f"{be:.1f}", f"{mq:.1f}", f"{be / mq:.2f}")
        console.print(table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2))
    console.print(f"wrote {out}")
    import plots  # matplotlib: the bench extra
    for name in model_names.split(","):
        for plot in ("speedup_by_k", "acceptance_by_position", "step_time_split"):
            path = Path(plot_dir) / f"engine_{name}_{plot}.png"
            getattr(plots, plot)(results["decode"], name, path)
            console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
