"""The gRPC stack vs the in-process engine vs target-only, for 1 and 8 concurrent streams,
with wire bytes and time per step.

    python bench/services_bench.py [--models tiny,smollm2] [--repeats 3] [--out bench/results/services.json]

"gRPC cost per step" is the stack's median step time minus the in-process engine's for the
same workload: serialisation, loopback transfer and the hops between processes and threads.
Target-only runs go through the same stack with num_speculative_tokens = 0.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from orchestrator.client import SpecDecodeClient
from orchestrator.engine import Request
from specdecode.models import load_model, load_tokenizer
from specdecode.sequence import SamplingParams
from specdecode_stack.local import LocalStack, StackConfig

from tiny_models import TinyModelSpec, build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from engine_bench import CODE_PROMPTS, engine  # noqa: E402

K = 4


def setup(name: str, tmp: Path):
    """(stack config, in-process target, in-process draft or "ngram", prompts)."""
    if name == "tiny":
        spec_t = TinyModelSpec(seed=1, hidden_size=256, num_layers=4)
        target, draft = build_tiny_model(spec_t), build_tiny_model(spec_t)  # draft = target
        target.save_pretrained(tmp / "target")
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (8, 16, 24, 32)]
        config = StackConfig(target_model=str(tmp / "target"), draft_model=str(tmp / "target"),
                             tokenizer="none", device="cpu", num_speculative_tokens=K, port=0)
        return config, target, draft, prompts
    target, tok = load_model(None, torch.device("cpu"), torch.float32), load_tokenizer(None)
    config = StackConfig(device="cpu", num_speculative_tokens=K, port=0)
    return config, target, "ngram", [tok(p).input_ids for p in CODE_PROMPTS]


def scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    wanted = {"steps": r"specdecode_steps_total", "bytes_sent":
              r'specdecode_step_wire_bytes_sum\{direction="sent"\}',
              "bytes_received": r'specdecode_step_wire_bytes_sum\{direction="received"\}',
              "step_s": None}
    out = {}
    for key, pattern in wanted.items():
        if pattern:
            m = re.search(rf"^{pattern} (\S+)$", body, re.M)
            out[key] = float(m.group(1)) if m else 0.0
    out["step_s"] = sum(float(v) for v in re.findall(
        r'^specdecode_step_phase_seconds_sum\{phase="[a-z]+"\} (\S+)$', body, re.M))
    return out


def run_stack(stack: LocalStack, prompts, streams: int, max_tokens: int, k: int | None) -> dict:
    def one(i):
        with SpecDecodeClient(stack.address) as client:
            return client.generate(prompts[i % len(prompts)], max_tokens=max_tokens,
                                   num_speculative_tokens=k)
    before = scrape(stack.metrics_ports["orchestrator"])
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(one, range(streams)))
    seconds = time.perf_counter() - start
    after = scrape(stack.metrics_ports["orchestrator"])
    steps = after["steps"] - before["steps"]
    return {"tokens_per_s": sum(len(r.token_ids) for r in results) / seconds,
            "step_ms": 1000 * (after["step_s"] - before["step_s"]) / steps,
            "bytes_per_step": (after["bytes_sent"] - before["bytes_sent"]
                               + after["bytes_received"] - before["bytes_received"]) / steps}


def run_inprocess(target, draft, prompts, streams: int, max_tokens: int, k: int) -> dict:
    eng = engine(target, draft, "batch-expansion", k)
    for i in range(streams):
        eng.add_request(Request(f"r{i}", prompts[i % len(prompts)],
                                SamplingParams(max_tokens=max_tokens)))
    tokens, steps, step_s = 0, 0, 0.0
    start = time.perf_counter()
    while eng.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in eng.step())
        steps, step_s = steps + 1, step_s + eng.last_step.total_s
    return {"tokens_per_s": tokens / (time.perf_counter() - start),
            "step_ms": 1000 * step_s / steps, "bytes_per_step": 0.0}


@click.command()
@click.option("--models", "model_names", default="tiny,smollm2", show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--out", default="bench/results/services.json", show_default=True)
def main(model_names: str, repeats: int, max_tokens: int, out: str) -> None:
    console = Console(width=160)
    rows = []
    for name in model_names.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            config, target, draft, prompts = setup(name, Path(tmp))
            with LocalStack(config) as stack:
                modes = {
                    "gRPC stack, speculative": lambda s: run_stack(stack, prompts, s, max_tokens, None),
                    "gRPC stack, target-only": lambda s: run_stack(stack, prompts, s, max_tokens, 0),
                    "in-process, speculative": lambda s: run_inprocess(target, draft, prompts, s, max_tokens, K),
                    "in-process, target-only": lambda s: run_inprocess(target, draft, prompts, s, max_tokens, 0),
                }
                for streams in (1, 8):
                    samples = {m: [] for m in modes}
                    for _ in range(repeats):
                        for mode, fn in modes.items():
                            samples[mode].append(fn(streams))
                    for mode, runs in samples.items():
                        rows.append({"model": name, "streams": streams, "mode": mode, **{
                            key: statistics.median(r[key] for r in runs) for key in runs[0]}})
        table = Table(title=f"{name}: {max_tokens} tokens/stream, k={K}, "
                            f"proposer {'draft = target' if name == 'tiny' else 'n-gram'}")
        for col in ("streams", "mode", "tokens/s", "vs in-process target-only", "step ms",
                    "wire bytes/step", "gRPC cost/step ms"):
            table.add_column(col)
        for r in (r for r in rows if r["model"] == name):
            base = next(x for x in rows if x["model"] == name and x["streams"] == r["streams"]
                        and x["mode"] == "in-process, target-only")
            twin = next(x for x in rows if x["model"] == name and x["streams"] == r["streams"]
                        and x["mode"] == r["mode"].replace("gRPC stack", "in-process"))
            r["grpc_cost_ms"] = r["step_ms"] - twin["step_ms"] if "gRPC" in r["mode"] else 0.0
            table.add_row(str(r["streams"]), r["mode"], f"{r['tokens_per_s']:.1f}",
                          f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x", f"{r['step_ms']:.1f}",
                          f"{r['bytes_per_step']:.0f}",
                          f"{r['grpc_cost_ms']:.1f}" if "gRPC" in r["mode"] else "-")
        console.print(table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
