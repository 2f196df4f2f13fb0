"""What the hop between orchestrator, proposer and scorer costs, in one run:

1. bytes per decode step (once both services hold the sequence) at 256 and 4,096 tokens of
   context (greedy and top-p 0.9), with sequence
   deltas on and off (tiny random models, B=1, draft = target);
2. the gRPC stack against the in-process engine at B=1 (--batch; draft-model speculation, k=4;
   the two run in alternation):
   `--pair qwen` (Qwen2.5-Coder 0.5B -> 1.5B, bf16) or `--pair smollm2` (SmolLM2 drafting
   for itself, float32): the stack as it was (deltas off, OpenMP threads that sleep after
   every operator), with deltas, and with today's defaults (deltas, threads that spin briefly:
   docs/design.md, "Threads on one host");
3. aggregate tokens/s at B=8 with and without overlap, proposer and scorer pinned to
   separate cores (`taskset`, one thread each; SmolLM2 drafting for itself, --overlap-k), and
   whether both runs gave the same tokens.

    python bench/services_bench.py [--pair qwen|smollm2] [--sections bytes,b1,overlap]
                                   [--repeats 3] [--batch 1] [--out bench/results/services.json]

Run it under `flock /work/coord/heavy.lock` on a shared machine. Numbers are medians over
--repeats; ratios compare runs made side by side in this one process.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from engine_bench import CODE_PROMPTS, engine  # noqa: E402
from tiny_models import TinyModelSpec, build_tiny_model  # noqa: E402

from orchestrator.client import SpecDecodeClient  # noqa: E402
from orchestrator.engine import Request  # noqa: E402
from specdecode.model_packages import fetch  # noqa: E402
from specdecode.models import load_model, load_tokenizer, resolve_model_dir  # noqa: E402
from specdecode.sequence import SamplingParams  # noqa: E402
from specdecode_stack.local import LocalStack, StackConfig  # noqa: E402

SAMPLING = {"greedy": {}, "top-p 0.9": {"temperature": 1.0, "top_p": 0.9, "seed": 3}}


def scrape(stack: LocalStack) -> dict[str, float]:
    body = urllib.request.urlopen(
        f"http://127.0.0.1:{stack.metrics_ports['orchestrator']}/metrics").read().decode()
    samples = [(m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")),
                float(m.group(3)))
               for m in re.finditer(r"^(specdecode_\w+)(?:\{(.*)\})? (\S+)$", body, re.M)]

    def value(name: str, **labels: str) -> float:  # summed over other labels (model_name)
        return sum(v for n, l, v in samples if n == name and labels.items() <= l.items())
    return {"steps": value("specdecode_steps_total"),
            "bytes": value("specdecode_step_wire_bytes_sum"),  # sent and received
            **{f"{role}_busy_s": value("specdecode_step_service_busy_seconds_sum", role=role)
               for role in ("proposer", "scorer")},
            "resends": value("specdecode_full_resends_total")}


def measure(stack: LocalStack, prompts: list[list[int]], max_tokens: int,
            **params) -> tuple[dict[str, float], float, list[list[int]]]:
    """All prompts at once, one stream each: (metric deltas, seconds, outputs)."""
    def one(prompt):
        with SpecDecodeClient(stack.address) as client:
            return [t for m in client.stream(prompt, max_tokens=max_tokens, **params)
                    for t in m.token_ids]
    before = scrape(stack)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outputs = list(pool.map(one, prompts))
    seconds = time.perf_counter() - start
    time.sleep(0.2)  # the last step's metrics are recorded after its message
    after = scrape(stack)
    return {key: after[key] - before[key] for key in after}, seconds, outputs


def run_stack(stack: LocalStack, prompts: list[list[int]], max_tokens: int,
              skip_tokens: int = 0, **params) -> dict:
    """Tokens/s, bytes per step, outputs. With skip_tokens, per-step numbers leave out the
    steps of a run of that many tokens (the same steps begin the full run)."""
    d, seconds, outputs = measure(stack, prompts, max_tokens, **params)
    if skip_tokens:
        head, _, head_outputs = measure(stack, prompts, skip_tokens, **params)
        assert all(o[:skip_tokens] == h for o, h in zip(outputs, head_outputs))
        d = {key: d[key] - head[key] for key in d}
    return {"tokens_per_s": sum(map(len, outputs)) / seconds,
            "bytes_per_step": d["bytes"] / d["steps"], "step_ms": 1000 * seconds / d["steps"],
            "proposer_busy": d["proposer_busy_s"] / seconds,
            "scorer_busy": d["scorer_busy_s"] / seconds, "resends": d["resends"],
            "outputs": outputs}


def run_inprocess(target, draft, scoring: str, prompts, max_tokens: int) -> dict:
    """Tokens/s, step time and the share of it spent proposing and scoring (the columns a
    stack's services report as busy), outputs."""
    eng = engine(target, draft, scoring, 4)
    for i, p in enumerate(prompts):
        eng.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens)))
    outputs: list[list[int]] = [[] for _ in prompts]
    propose_s = score_s = 0.0
    steps = 0
    start = time.perf_counter()
    while eng.has_unfinished():
        for out in eng.step():
            outputs[int(out.request_id[1:])] += out.new_token_ids
        propose_s, score_s = propose_s + eng.last_step.propose_s, score_s + eng.last_step.score_s
        steps += 1
    seconds = time.perf_counter() - start
    return {"tokens_per_s": sum(map(len, outputs)) / seconds, "bytes_per_step": 0.0,
            "step_ms": 1000 * seconds / steps, "proposer_busy": propose_s / seconds,
            "scorer_busy": score_s / seconds, "outputs": outputs}


def median(runs: list[dict]) -> dict:
    return {**{k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "outputs"},
            "outputs": runs[-1]["outputs"]}


def section_bytes(tmp: Path, repeats: int) -> list[dict]:
    spec = TinyModelSpec(seed=1, max_position_embeddings=4096 + 64)
    build_tiny_model(spec).save_pretrained(tmp / "tiny")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for deltas in (True, False):
        config = StackConfig(target_model=str(tmp / "tiny"), draft_model=str(tmp / "tiny"),
                             tokenizer="none", device="cpu", num_speculative_tokens=4, port=0,
                             speculation="fixed",
                             extra_env={"SPECDECODE_SEQUENCE_DELTAS": str(deltas).lower()})
        with LocalStack(config) as stack:
            for context in (256, 4096):
                prompt = torch.randint(0, spec.vocab_size, (context,), generator=gen).tolist()
                for name, params in SAMPLING.items():
                    # Steady decode steps: left out are the prompt's steps and the first
                    # decode step, which brings the proposer the prompt (the prompt's step
                    # asks no proposals); draft = target accepts all k, so that is k + 2
                    # tokens.
                    r = median([run_stack(stack, [prompt], 48, skip_tokens=6, **params)
                                for _ in range(repeats)])
                    rows.append({"section": "bytes", "deltas": deltas, "context": context,
                                 "sampling": name, **r})
    return rows


def load_pair(pair: str):
    """(target dir, draft dir, dtype, scoring, prompts)."""
    if pair == "qwen":
        target, draft = (str(resolve_model_dir(fetch(n)))
                         for n in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"))
        dtype, scoring = "bfloat16", "multi-query"
    else:
        target = draft = str(resolve_model_dir(None))
        dtype, scoring = "float32", "batch-expansion"
    tok = load_tokenizer(target)
    return target, draft, dtype, scoring, [tok(p).input_ids for p in CODE_PROMPTS]


def section_b1(pair: str, repeats: int, max_tokens: int, batch: int) -> list[dict]:
    """Each stack setting against the in-process engine, run in alternation (in-process,
    stack, in-process, stack, ...) so that drift on a shared machine hits both sides; the
    ratio is the median of each round's ratio."""
    target_dir, draft_dir, dtype, scoring, prompts = load_pair(pair)
    prompts = [prompts[i % len(prompts)] for i in range(batch)]
    rows = []
    target = load_model(target_dir, torch.device("cpu"), getattr(torch, dtype))
    draft = load_model(draft_dir, torch.device("cpu"), getattr(torch, dtype))
    sleep = {"OMP_WAIT_POLICY": "PASSIVE"}  # the stack's OpenMP setting before the brief spin
    for mode, env in (("stack, deltas off, threads sleep", {"SPECDECODE_SEQUENCE_DELTAS": "false",
                                                            **sleep}),
                      ("stack, deltas on, threads sleep", sleep),
                      ("stack, defaults (deltas, brief spin)", {})):
        config = StackConfig(target_model=target_dir, draft_model=draft_dir, device="cpu",
                             dtype=dtype, scoring=scoring, num_speculative_tokens=4, port=0,
                             speculation="fixed", extra_env=env)
        with LocalStack(config) as stack:
            run_inprocess(target, draft, scoring, prompts, 4)  # warm-up: first forwards are slow
            run_stack(stack, prompts, 4)
            rounds = [(run_inprocess(target, draft, scoring, prompts, max_tokens),
                       run_stack(stack, prompts, max_tokens)) for _ in range(repeats)]
        inproc, r = median([i for i, _ in rounds]), median([s for _, s in rounds])
        rows.append({"section": "b1", "pair": pair, "batch": batch, "mode": mode, **r,
                     "vs_inprocess": statistics.median(s["tokens_per_s"] / i["tokens_per_s"]
                                                       for i, s in rounds),
                     "inprocess": {k: v for k, v in inproc.items() if k != "outputs"},
                     "same_tokens": r["outputs"] == inproc["outputs"]})
        print("row", {k: v for k, v in rows[-1].items() if k != "outputs"}, flush=True)
    return rows


def section_overlap(repeats: int, max_tokens: int, k: int) -> list[dict]:
    target_dir, _, _, _, prompts = load_pair("smollm2")
    prompts = [prompts[i % len(prompts)] for i in range(8)]
    rows = []
    for overlap in (False, True):
        config = StackConfig(target_model=target_dir, draft_model=target_dir, device="cpu",
                             num_speculative_tokens=k, port=0,
                             pin={"proposer": "0", "scorer": "1"},
                             speculation="fixed",
                             extra_env={"SPECDECODE_OVERLAP": str(overlap).lower()})
        with LocalStack(config) as stack:
            r = median([run_stack(stack, prompts, max_tokens) for _ in range(repeats)])
        rows.append({"section": "overlap", "overlap": overlap, "k": k, **r})
    return rows


def print_tables(console: Console, rows: list[dict]) -> None:
    b = [r for r in rows if r["section"] == "bytes"]
    if b:
        t = Table(title="bytes per decode step once both services hold the sequence, B=1, k=4 "
                        "(tiny random models, draft = target, tokens 7-48)")
        for col in ("deltas", "sampling", "context 256", "context 4096", "4096 / 256"):
            t.add_column(col)
        for deltas in (True, False):
            for name in SAMPLING:
                small, large = (next(r["bytes_per_step"] for r in b if r["deltas"] == deltas
                                     and r["sampling"] == name and r["context"] == c)
                                for c in (256, 4096))
                t.add_row("on" if deltas else "off", name, f"{small:.0f}", f"{large:.0f}",
                          f"{large / small:.3f}")
        console.print(t)
    b1 = [r for r in rows if r["section"] == "b1"]
    if b1:
        t = Table(title=f"B={b1[0]['batch']}, {b1[0]['pair']}, k=4: stack vs in-process engine, "
                        "run in alternation (stack / in-process; busy: share of the wall time "
                        "the proposer / scorer worked, in-process: proposing / scoring)")
        for col in ("mode", "tokens/s", "vs in-process", "step ms", "proposer busy",
                    "scorer busy", "bytes/step", "same tokens"):
            t.add_column(col)
        for r in b1:
            i = r["inprocess"]
            t.add_row(r["mode"], f"{r['tokens_per_s']:.2f} / {i['tokens_per_s']:.2f}",
                      f"{r['vs_inprocess']:.3f}x", f"{r['step_ms']:.0f} / {i['step_ms']:.0f}",
                      f"{r['proposer_busy']:.0%} / {i['proposer_busy']:.0%}",
                      f"{r['scorer_busy']:.0%} / {i['scorer_busy']:.0%}",
                      f"{r['bytes_per_step']:.0f}", str(r["same_tokens"]))
        console.print(t)
    ov = [r for r in rows if r["section"] == "overlap"]
    if ov:
        off = next(r for r in ov if not r["overlap"])
        t = Table(title=f"B=8, SmolLM2 drafting for itself, k={off['k']}, proposer on core 0, scorer on "
                        "core 1 (one thread each)")
        for col in ("overlap", "tokens/s", "vs without", "proposer busy", "scorer busy",
                    "same tokens"):
            t.add_column(col)
        for r in ov:
            t.add_row("on" if r["overlap"] else "off", f"{r['tokens_per_s']:.2f}",
                      f"{r['tokens_per_s'] / off['tokens_per_s']:.3f}x",
                      f"{r['proposer_busy']:.0%}", f"{r['scorer_busy']:.0%}",
                      str(r["outputs"] == off["outputs"]))
        console.print(t)


@click.command()
@click.option("--pair", default="qwen", type=click.Choice(["qwen", "smollm2"]),
              show_default=True, help="Draft/target pair for the B=1 comparison.")
@click.option("--sections", default="bytes,b1,overlap", show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--batch", default=1, show_default=True,
              help="Concurrent streams in the stack vs in-process section (its B).")
@click.option("--overlap-k", default=1, show_default=True,
              help="Speculative tokens per step in the overlap section (1: proposer and scorer "
                   "do one forward pass each per group; docs/benchmarks.md has k=2 too).")
@click.option("--out", default="bench/results/services.json", show_default=True)
def main(pair: str, sections: str, repeats: int, max_tokens: int, batch: int, overlap_k: int,
         out: str) -> None:
    console = Console(width=160)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for section in sections.split(","):
            if section == "bytes":
                new = section_bytes(Path(tmp), repeats)
            elif section == "b1":
                new = section_b1(pair, repeats, max_tokens, batch)
            elif section == "overlap":
                new = section_overlap(repeats, max_tokens, overlap_k)
            else:
                raise click.BadParameter(f"unknown section {section!r}", param_hint="--sections")
            print_tables(console, new)
            rows += new
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
