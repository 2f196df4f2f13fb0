"""Losslessness on an accelerator: greedy spec-decode output equals the target's own greedy
decoding (float32, full recomputation) on the given device, for both proposers and both
scorers. Exits 1 on any mismatch. Run it where a GPU or NPU is present:

    python bench/device_check.py --device cuda                      # float32: eager (SDPA)
    python bench/device_check.py --device cuda --dtype bfloat16     # + captured CUDA graphs

Each configuration runs twice: with captured graphs (where the runner captures them: CUDA,
flash-attn, half precision) and with --enforce-eager; both must equal the reference, computed
in the same dtype by the model's own forward with full recomputation.
"""

from __future__ import annotations

import sys

import click
import torch
from rich.console import Console
from rich.table import Table

from orchestrator.engine.request import Request
from scorer_svc.methods import SCORING_METHODS
from specdecode.device import resolve_device, resolve_dtype
from specdecode.sequence import SamplingParams
from specdecode_stack.inprocess import build_inprocess_engine
from specdecode.tiny_models import TinyModelSpec, build_tiny_model

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
def main(device: str, max_tokens: int, dtype: str) -> None:
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    target = build_tiny_model(TinyModelSpec(seed=1)).to(dev, dt)
    draft = build_tiny_model(TinyModelSpec(seed=2, num_layers=1)).to(dev, dt)
    want = [reference(target, p, max_tokens, dev) for p in PROMPTS]
    table = Table(title=f"greedy equality on {dev}, {dtype}")
    for col in ("proposer", "scorer", "k", "mode", "equal", "acceptance"):
        table.add_column(col)
    failures = 0
    configs = [("none", "ngram", "multi-query", 0)] + [
        (name, proposer, scoring, k)
        for name, proposer in [("draft", draft), ("self", target), ("ngram", "ngram")]
        for scoring in SCORING_METHODS for k in (1, 4)]
    for name, proposer, scoring, k in configs:
        for eager in (False, True):
            engine = build_inprocess_engine(target, proposer, scoring, k, dev,
                                            enforce_eager=eager)
            graphs = engine.scorer.worker.runner.graphs is not None
            done = engine.generate([Request(str(i), p, SamplingParams(max_tokens=max_tokens))
                                    for i, p in enumerate(PROMPTS)])
            equal = all(done[str(i)].output_token_ids == w for i, w in enumerate(want))
            failures += not equal
            stats = [s.stats for s in done.values()]
            draft_n = sum(s.draft_tokens for s in stats)
            acc = sum(s.accepted_tokens for s in stats) / draft_n if draft_n else float("nan")
            mode = "graphs" if graphs else "eager"
            table.add_row(name, scoring, str(k), mode, "yes" if equal else "NO", f"{acc:.2f}")
    Console(width=120).print(table)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
