"""Losslessness on a device: greedy spec-decode output equals the target's own greedy
decoding (full recomputation) on the given device, for both proposers and both scorers,
through the compiled forwards and the eager ones. Exits 1 on any mismatch.

    python bench/device_check.py --device cuda                      # float32
    python bench/device_check.py --device cuda --dtype bfloat16
    python bench/device_check.py --device cpu --buckets 4 --configs draft:multi-query:4  # CI

Each configuration runs twice: with compiled decode and verify forwards
(specdecode/executor/compiled_forward.py, at the batch buckets `--buckets`) and with --enforce-eager;
both must equal the reference, computed in the same dtype by the model's own forward with
full recomputation. The table says which path each run took and how many forwards went
through a compiled graph.
"""

from __future__ import annotations

import sys

import click
import torch
from rich.console import Console
from rich.table import Table

from orchestrator.engine.request import Request
from scorer_svc.methods import SCORING_METHODS
from specdecode.executor.device import resolve_device, resolve_dtype
from specdecode.sequence import SamplingParams
from specdecode_stack.inprocess import build_inprocess_engine
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model

PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42], [7, 8, 9, 7, 8, 9, 7, 8]]


@torch.inference_mode()
def reference(model, prompt, n, device):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(model(torch.tensor([tokens], device=device)).logits[0, -1].argmax()))
    return tokens[len(prompt):]


@click.command()
@click.option("--device", default="auto", show_default=True)
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@click.option("--buckets", default="1,2,4,8,16,32", show_default=True,
              help="Batch sizes the compiled forwards are compiled for.")
@click.option("--configs", default=None,
              help="proposer:scoring:k,... (proposer none|draft|self|ngram); default: all.")
def main(device: str, max_tokens: int, dtype: str, buckets: str, configs: str | None) -> None:
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    target = build_tiny_model(TinyModelSpec(seed=1)).to(dev, dt)
    draft = build_tiny_model(TinyModelSpec(seed=2, num_layers=1)).to(dev, dt)
    want = [reference(target, p, max_tokens, dev) for p in PROMPTS]
    table = Table(title=f"greedy equality on {dev}, {dtype}")
    for col in ("proposer", "scorer", "k", "mode", "compiled forwards", "equal", "acceptance"):
        table.add_column(col)
    failures = 0
    proposers = {"none": "ngram", "draft": draft, "self": target, "ngram": "ngram"}
    runs = [("none", "multi-query", 0)] + [(name, scoring, k) for name in ("draft", "self", "ngram")
                                           for scoring in SCORING_METHODS for k in (1, 4)]
    if configs:
        runs = [(c.split(":")[0], c.split(":")[1], int(c.split(":")[2]))
                for c in configs.split(",")]
    sizes = tuple(int(b) for b in buckets.split(","))
    for name, scoring, k in runs:
        for eager in (False, True):
            engine = build_inprocess_engine(target, proposers[name], scoring, k, dev,
                                            enforce_eager=eager, compile_batch_sizes=sizes)
            compiled = engine.scorer.worker.runner.compiled
            done = engine.generate([Request(str(i), p, SamplingParams(max_tokens=max_tokens))
                                    for i, p in enumerate(PROMPTS)])
            equal = all(done[str(i)].output_token_ids == w for i, w in enumerate(want))
            failures += not equal
            stats = [s.stats for s in done.values()]
            draft_n = sum(s.draft_tokens for s in stats)
            acc = sum(s.accepted_tokens for s in stats) / draft_n if draft_n else float("nan")
            mode = "compiled" if compiled else "eager"
            table.add_row(name, scoring, str(k), mode, str(compiled.stats.runs if compiled else 0),
                          "yes" if equal else "NO", f"{acc:.2f}")
    Console(width=120).print(table)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
