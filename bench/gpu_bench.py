"""The executor on an accelerator, in one run: bandwidth limit, target-only tokens/s by batch,
speculation (draft = target, and a smaller draft; both scorers), HF `generate` eager and with
a static cache, verify-vs-decode cost, and efficiency against Leviathan et al.'s S*.

    python bench/gpu_bench.py --device cuda                 # Qwen2-1.5B / 0.5B-shaped, bf16
    python bench/gpu_bench.py --device cuda --enforce-eager # the same, eager forwards
    python bench/gpu_bench.py --small --device cpu          # CPU, small shapes (a dry run)

Forwards are compiled (specdecode/executor/compiled_forward.py: torch.compile, CUDA graphs through
mode="reduce-overhead", flex attention over the KV pool) unless --enforce-eager; CI runs the
same code on CPU (`tests/integration/test_compiled_forward.py`, and this script with
--small under -m slow). No package beyond torch is needed on the device for the fast path.

Carry to a lent device (the repository travels as the working tree): a folder of wheels for
the device's Python, `pip download -d .whl --only-binary=:all: --python-version 3.11
transformers tokenizers safetensors huggingface-hub accelerate click rich grpcio
grpcio-health-checking grpcio-reflection protobuf opentelemetry-api opentelemetry-sdk
prometheus-client psutil pyyaml regex tqdm` (the pure-Python ones, plus the few small binary
wheels the imports need; torch and triton are the device image's), installed there with
`pip install --no-index --find-links .whl ...` before the run.

Models are random (no download): a Qwen2-1.5B-shaped target (hidden 1536, 28 layers, 12 heads
/ 2 KV heads, vocab 151936) and a Qwen2-0.5B-shaped draft (hidden 896, 24 layers, 14 / 2);
`--small` shrinks both. With draft = target every proposal is accepted (the ceiling); a random
0.5B draft is accepted about never, so its row measures pure overhead. S* = (1 - a^(k+1)) /
((1 - a)(k c + 1)) with a the run's acceptance and c the draft/target cost ratio of one decode
step at B=1 (a = 1: S* = (k + 1) / (k c + 1)); efficiency = measured speed-up / S*.
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
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from orchestrator.engine.request import Request  # noqa: E402
from specdecode.executor.device import resolve_device, resolve_dtype  # noqa: E402
from specdecode.executor.model_runner import ModelRunner, RunnerRow  # noqa: E402
from specdecode.sequence import SamplingParams  # noqa: E402
from specdecode_stack.inprocess import build_inprocess_engine  # noqa: E402

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "target": (1536, 28, 12, 2, 8960, 151936),
    "draft": (896, 24, 14, 2, 4864, 151936),
    "target-small": (256, 4, 4, 2, 512, 4096),
    "draft-small": (128, 2, 4, 2, 256, 4096),
}


def random_qwen2(name: str, device, dtype, seed: int):
    hidden, layers, heads, kv, inter, vocab = SHAPES[name]
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=4096, tie_word_embeddings=name.startswith("draft"))
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    return model.eval()


def sync(device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def copy_bandwidth(device) -> float:
    """Bytes moved per second (read + write) by a large device copy."""
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start, n = time.perf_counter(), 10
    for _ in range(n):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * n / (time.perf_counter() - start)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def engine_tps(target, draft, scoring, k, prompts, max_tokens, device, enforce_eager,
               buckets) -> dict:
    eng = build_inprocess_engine(target, draft, scoring, k, device, enforce_eager=enforce_eager,
                                 compile_batch_sizes=buckets)
    requests = lambda tag: [Request(f"{tag}{i}", p, SamplingParams(max_tokens=max_tokens))  # noqa: E731
                            for i, p in enumerate(prompts)]
    eng.generate(requests("warm")[:1])  # warm-up (allocator, caches)
    sync(device)
    start = time.perf_counter()
    done = eng.generate(requests("r"))
    sync(device)
    seconds = time.perf_counter() - start
    stats = [s.stats for s in done.values()]
    draft_n = sum(s.draft_tokens for s in stats)
    return {"tokens_per_s": sum(len(s.output_token_ids) for s in done.values()) / seconds,
            "acceptance": sum(s.accepted_tokens for s in stats) / draft_n if draft_n else None}


@torch.inference_mode()
def hf_tps(model, prompts, max_tokens, device, static: bool) -> float:
    ids = torch.tensor(prompts, device=device)
    kw = {"cache_implementation": "static"} if static else {}
    gen = lambda: model.generate(input_ids=ids, max_new_tokens=max_tokens,  # noqa: E731
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **kw)
    gen()  # warm-up (and compilation, for the static cache on CUDA)
    sync(device)
    start = time.perf_counter()
    out = gen()
    sync(device)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - start)


@torch.inference_mode()
def call_ms(runner: ModelRunner, prompt: list[int], queries: int, device, repeats=5) -> float:
    """One forward of `queries` new tokens on a warm cache (B=1), median ms."""
    times = []
    for r in range(repeats + 1):
        runner.forward([RunnerRow(0, prompt, 1)])  # cache holds the prompt
        tokens = prompt + [(7 * r + j) % 100 for j in range(queries)]
        sync(device)
        start = time.perf_counter()
        runner.forward([RunnerRow(0, tokens, queries)])
        sync(device)
        if r:
            times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def s_star(alpha: float, k: int, c: float) -> float:
    if alpha >= 1:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


@click.command()
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--small", is_flag=True, help="Small shapes (a dry run on CPU).")
@click.option("--prompt-len", default=128, show_default=True)
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--batches", default="1,8,32", show_default=True)
@click.option("--k", default=4, show_default=True)
@click.option("--enforce-eager", is_flag=True)
@click.option("--buckets", default=None, help="Batch sizes to compile (default: the runner's).")
@click.option("--out", default="bench/results/gpu_bench.json", show_default=True)
def main(device, dtype, small, prompt_len, max_tokens, batches, k, enforce_eager, buckets,
         out) -> None:
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    suffix = "-small" if small else ""
    target = random_qwen2("target" + suffix, dev, dt, seed=1)
    draft = random_qwen2("draft" + suffix, dev, dt, seed=2)
    vocab = target.config.vocab_size
    buckets = tuple(int(b) for b in buckets.split(",")) if buckets else None
    gen = torch.Generator().manual_seed(0)
    batch_sizes = [int(b) for b in batches.split(",")]
    prompts = torch.randint(0, vocab, (max(batch_sizes), prompt_len), generator=gen).tolist()
    res: dict = {"device": str(dev), "dtype": dtype, "small": small, "k": k,
                 "enforce_eager": enforce_eager, "prompt_len": prompt_len,
                 "max_tokens": max_tokens}
    bw = copy_bandwidth(dev)
    res["copy_bandwidth_GBps"] = bw / 1e9
    res["bandwidth_limit_tokens_per_s_B1"] = bw / 2 / weight_bytes(target)  # weights read once
    rows = []
    target_only = {}
    for B in batch_sizes:
        r = engine_tps(target, target, "multi-query", 0, prompts[:B], max_tokens, dev,
                       enforce_eager, buckets)
        target_only[B] = r["tokens_per_s"]
        rows.append({"what": "target-only", "B": B, **r})
    for B in [b for b in batch_sizes if b <= 8]:
        for name, d in (("draft = target", target), ("0.5B-shaped draft", draft)):
            for scoring in ("multi-query", "batch-expansion"):
                r = engine_tps(target, d, scoring, k, prompts[:B], max_tokens, dev,
                               enforce_eager, buckets)
                rows.append({"what": f"{name}, {scoring}, k={k}", "B": B, **r,
                             "vs_target_only": r["tokens_per_s"] / target_only[B]})
    for static in (False, True):
        try:
            tps = hf_tps(target, prompts[:1], max_tokens, dev, static)
        except Exception as exc:  # noqa: BLE001 (a library path that may not run on a device)
            tps, res[f"hf_{'static' if static else 'eager'}_error"] = float("nan"), repr(exc)
        rows.append({"what": f"HF generate, {'static cache' if static else 'eager'}", "B": 1,
                     "tokens_per_s": tps, "vs_target_only": tps / target_only[batch_sizes[0]]})
    t_runner = ModelRunner(target, dev, enforce_eager=enforce_eager, compile_batch_sizes=buckets)
    d_runner = ModelRunner(draft, dev, enforce_eager=enforce_eager, compile_batch_sizes=buckets)
    decode_ms, verify_ms = call_ms(t_runner, prompts[0], 1, dev), call_ms(t_runner, prompts[0],
                                                                          k + 1, dev)
    c = call_ms(d_runner, prompts[0], 1, dev) / decode_ms
    res.update(decode_ms_B1=decode_ms, verify_ms_B1=verify_ms, verify_over_decode=verify_ms /
               decode_ms, draft_target_cost_ratio=c,
               target_only_B1_fraction_of_limit=target_only[batch_sizes[0]] /
               res["bandwidth_limit_tokens_per_s_B1"])
    if len(batch_sizes) > 1:
        res["B_max_over_B1"] = target_only[batch_sizes[-1]] / target_only[batch_sizes[0]]
    for row in rows:
        alpha = row.get("acceptance")
        if alpha is not None and "vs_target_only" in row:
            cc = 1.0 if row["what"].startswith("draft = target") else c
            row["s_star"] = s_star(alpha, k, cc)
            row["efficiency_vs_s_star"] = row["vs_target_only"] / row["s_star"]
    res["rows"] = rows
    table = Table(title=f"gpu_bench on {dev} ({dtype}{', small shapes' if small else ''}"
                        f"{', eager' if enforce_eager else ''}): {prompt_len}-token prompts, "
                        f"{max_tokens} new tokens")
    for col in ("what", "B", "tokens/s", "vs target-only", "acceptance", "S*", "eff. vs S*"):
        table.add_column(col)
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for row in rows:
        table.add_row(row["what"], str(row["B"]), f"{row['tokens_per_s']:.1f}",
                      fmt(row.get("vs_target_only"), ".2f"), fmt(row.get("acceptance"), ".2f"),
                      fmt(row.get("s_star"), ".2f"), fmt(row.get("efficiency_vs_s_star"), ".2f"))
    console = Console(width=150)
    console.print(table)
    console.print({k_: v for k_, v in res.items() if k_ != "rows"})
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
