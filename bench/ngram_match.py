"""N-gram proposer: which match of the longest suffix n-gram to propose from, the earliest
(vLLM 0.4.2 and v1) or the latest. Same greedy output either way (lossless); what differs is
how many draft tokens are accepted and how many steps a generation takes.

    python bench/ngram_match.py [--max-tokens 64] [--k 4] [--out bench/results/ngram_match.json]

SmolLM2-135M-Instruct (the default model), greedy, in-process engine, one request at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from orchestrator.engine import Request
from specdecode.models import load_model, load_tokenizer
from specdecode.sequence import SamplingParams
from specdecode_stack.inprocess import build_inprocess_engine

from engine_bench import CODE_PROMPTS

TEXT_PROMPTS = [
    "<|im_start|>user\nList the days of the week, one per line, each followed by its number "
    "of letters.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a Python class Stack with push, pop, peek and is_empty, with a "
    "docstring for each method.<|im_end|>\n<|im_start|>assistant\n",
]


@click.command()
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--k", default=4, show_default=True)
@click.option("--out", default="bench/results/ngram_match.json", show_default=True)
def main(max_tokens: int, k: int, out: str) -> None:
    torch.manual_seed(0)
    target = load_model(None, torch.device("cpu"), torch.float32)
    tok = load_tokenizer(None)
    prompts = [tok(p).input_ids for p in CODE_PROMPTS + TEXT_PROMPTS]
    rows, outputs = [], {}
    for match in ("earliest", "latest"):
        totals = {"draft": 0, "accepted": 0, "steps": 0, "tokens": 0}
        outputs[match] = []
        for i, prompt in enumerate(prompts):
            engine = build_inprocess_engine(target, "ngram", k=k, ngram_match=match)
            done = engine.generate([Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens))])
            seq = done[f"r{i}"]
            outputs[match].append(seq.output_token_ids)
            totals["draft"] += seq.stats.draft_tokens
            totals["accepted"] += seq.stats.accepted_tokens
            totals["steps"] += seq.stats.steps
            totals["tokens"] += len(seq.output_token_ids)
        rows.append({"match": match, **totals,
                     "acceptance": totals["accepted"] / max(totals["draft"], 1),
                     "tokens_per_step": totals["tokens"] / totals["steps"]})
    assert outputs["earliest"] == outputs["latest"], "the proposer changed the output"
    table = Table(title=f"n-gram match, SmolLM2 greedy, k={k}, {len(prompts)} prompts x "
                        f"{max_tokens} tokens")
    for col in ("match", "draft", "accepted", "acceptance", "steps", "tokens/step"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["match"], str(r["draft"]), str(r["accepted"]), f"{r['acceptance']:.1%}",
                      str(r["steps"]), f"{r['tokens_per_step']:.2f}")
    Console().print(table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"k": k, "max_tokens": max_tokens, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
