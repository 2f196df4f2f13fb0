"""What the hop between orchestrator, proposer and scorer costs, in one run:

1. bytes per decode step (once both services hold the sequence) at 256 and 4,096 tokens of
   context (greedy and top-p 0.9), with sequence
   deltas on and off (tiny random models, B=1, draft = target);
2. the gRPC stack against the in-process engine at B=1 (--batch; draft-model speculation, k=4;
   the two run in alternation):
   `--pair qwen` (Qwen2.5-Coder 0.5B -> 1.5B, bf16) or `--pair smollm2` (SmolLM2 drafting
   for itself, float32) or `--pair random-qwen --device cuda` (issue 12's GPU setting: a
   random Qwen2-1.5B-shaped model drafting for itself, bf16, 128-token prompts; both services
   on the one GPU), for the stack settings in --modes: the stack as it was ("before":
   deltas off, OpenMP threads that sleep after every operator), with deltas ("deltas"), and
   with today's defaults ("defaults": deltas, threads that spin briefly: docs/design.md,
   "Threads on one host"); the median of the rounds' ratios and their range, and where a
   step's time went (forward passes, the services' other busy time, the hop to each service,
   the orchestrator's part), from the stack's own per-step metrics;
3. aggregate tokens/s at B=8 with and without overlap, proposer and scorer pinned to
   separate cores (`taskset`, one thread each; SmolLM2 drafting for itself, --overlap-k), and
   whether both runs gave the same tokens.

    python bench/services_bench.py [--pair qwen|smollm2|random-qwen|random-qwen-small]
                                   [--device cpu|cuda] [--sections bytes,b1,overlap]
                                   [--repeats 3] [--batch 1] [--modes before,deltas,defaults]
                                   [--out bench/results/services.json]

Run it alone on a shared machine (nothing else busy on its cores). Numbers are medians over
--repeats; ratios compare runs made side by side in this one process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import click
import grpc
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from engine_bench import CODE_PROMPTS  # noqa: E402

from specdecode.api.client import SpecDecodeClient  # noqa: E402
from orchestrator.engine.request import Request  # noqa: E402
from specdecode.models.model_packages import fetch  # noqa: E402
from specdecode.models.checkpoints import load_model, load_tokenizer, resolve_model_dir  # noqa: E402
from specdecode.sequence import SamplingParams  # noqa: E402
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model  # noqa: E402
from specdecode_stack.inprocess import build_inprocess_engine  # noqa: E402
from specdecode_stack.local import LocalStack, StackConfig  # noqa: E402

SAMPLING = {"greedy": {}, "top-p 0.9": {"temperature": 1.0, "top_p": 0.9, "seed": 3}}


def _samples(port: int) -> list[tuple[str, dict[str, str], float]]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return [(m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")),
             float(m.group(3)))
            for m in re.finditer(r"^(specdecode_\w+)(?:\{(.*)\})? (\S+)$", body, re.M)]


def scrape(stack: LocalStack) -> dict[str, float]:
    samples = {role: _samples(port) for role, port in stack.metrics_ports.items()}

    def value(server: str, name: str, **labels: str) -> float:  # summed over other labels
        return sum(v for n, l, v in samples[server]
                   if n == name and labels.items() <= l.items())
    orch = "orchestrator"
    return {"steps": value(orch, "specdecode_steps_total"),
            "bytes": value(orch, "specdecode_step_wire_bytes_sum"),  # sent and received
            "step_s": value(orch, "specdecode_step_duration_seconds_sum"),
            **{f"{phase}_s": value(orch, "specdecode_step_phase_seconds_sum", phase=phase)
               for phase in ("propose", "score", "verify", "overhead")},
            **{f"{role}_busy_s": value(orch, "specdecode_step_service_busy_seconds_sum",
                                       role=role) for role in ("proposer", "scorer")},
            **{f"{role}_forward_s": value(role, "specdecode_model_forward_seconds_sum")
               for role in ("proposer", "scorer")},
            "resends": value(orch, "specdecode_full_resends_total"),
            # steps in which the proposer failed or was slower than its deadline (no drafts)
            "fallback_steps": value(orch, "specdecode_proposer_fallback_steps_total")}


def measure(stack: LocalStack, prompts: list[list[int]], max_tokens: int,
            **params) -> tuple[dict[str, float], float, list[list[int]]]:
    """All prompts at once, one stream each, on channels connected before the clock starts:
    (metric deltas, seconds, outputs)."""
    clients = [SpecDecodeClient(stack.address) for _ in prompts]
    try:
        for client in clients:
            grpc.channel_ready_future(client.channel).result(timeout=30)

        def one(client, prompt):
            return [t for m in client.stream(prompt, max_tokens=max_tokens, **params)
                    for t in m.token_ids]
        before = scrape(stack)
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(one, clients, prompts))
        seconds = time.perf_counter() - start
    finally:
        for client in clients:
            client.close()
    time.sleep(0.2)  # the last step's metrics are recorded after its message
    after = scrape(stack)
    return {key: after[key] - before[key] for key in after}, seconds, outputs


def run_stack(stack: LocalStack, prompts: list[list[int]], max_tokens: int,
              skip_tokens: int = 0, **params) -> dict:
    """Tokens/s, bytes per step, where a step's time went (ms per step), outputs. With
    skip_tokens, per-step numbers leave out the steps of a run of that many tokens (the same
    steps begin the full run)."""
    d, seconds, outputs = measure(stack, prompts, max_tokens, **params)
    tokens_per_s = sum(map(len, outputs)) / seconds
    if skip_tokens:
        head, head_seconds, head_outputs = measure(stack, prompts, skip_tokens, **params)
        assert all(o[:skip_tokens] == h for o, h in zip(outputs, head_outputs))
        d = {key: d[key] - head[key] for key in d}
        seconds -= head_seconds
    steps = d["steps"]
    per_step = {  # ms per step; "hop": the phase's time outside the service's own
        "proposer forwards": d["proposer_forward_s"],
        "proposer other": d["proposer_busy_s"] - d["proposer_forward_s"],
        "proposer hop": d["propose_s"] - d["proposer_busy_s"],
        "scorer forwards": d["scorer_forward_s"],
        "scorer other": d["scorer_busy_s"] - d["scorer_forward_s"],
        "scorer hop": d["score_s"] - d["scorer_busy_s"],
        "verify and rest of step": d["verify_s"] + d["overhead_s"],
        "between steps": seconds - d["step_s"]}
    return {"tokens_per_s": tokens_per_s, "steps": steps,
            "bytes_per_step": d["bytes"] / steps, "step_ms": 1000 * seconds / steps,
            "proposer_busy": d["proposer_busy_s"] / seconds,
            "scorer_busy": d["scorer_busy_s"] / seconds, "resends": d["resends"],
            "fallback_steps": d["fallback_steps"],
            **{f"ms {k}": 1000 * v / steps for k, v in per_step.items()},
            "outputs": outputs}


def run_inprocess(target, draft, scoring: str, prompts, max_tokens: int,
                  device: str = "cpu") -> dict:
    """Tokens/s, step time and the share of it spent proposing and scoring (the columns a
    stack's services report as busy), where a step's time went (ms per step), outputs."""
    eng = build_inprocess_engine(target, draft, scoring, 4, torch.device(device))
    runners = {"proposer": eng.proposer.worker.runner, "scorer": eng.scorer.worker.runner}
    forward_s = {role: r.stats.forward_seconds for role, r in runners.items()}
    for i, p in enumerate(prompts):
        eng.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens)))
    outputs: list[list[int]] = [[] for _ in prompts]
    phase = dict.fromkeys(("propose", "score", "rest", "step"), 0.0)
    steps = 0
    start = time.perf_counter()
    while eng.has_unfinished():
        for out in eng.step():
            outputs[int(out.request_id[1:])] += out.new_token_ids
        s = eng.last_step
        for key, v in (("propose", s.propose_s), ("score", s.score_s),
                       ("rest", s.total_s - s.propose_s - s.score_s), ("step", s.total_s)):
            phase[key] += v
        steps += 1
    seconds = time.perf_counter() - start
    forward_s = {role: r.stats.forward_seconds - forward_s[role] for role, r in runners.items()}
    per_step = {
        "proposer forwards": forward_s["proposer"],
        "proposer other": phase["propose"] - forward_s["proposer"],
        "proposer hop": 0.0,
        "scorer forwards": forward_s["scorer"],
        "scorer other": phase["score"] - forward_s["scorer"],
        "scorer hop": 0.0,
        "verify and rest of step": phase["rest"],
        "between steps": seconds - phase["step"]}
    return {"tokens_per_s": sum(map(len, outputs)) / seconds, "steps": steps,
            "bytes_per_step": 0.0, "step_ms": 1000 * seconds / steps,
            "proposer_busy": phase["propose"] / seconds, "scorer_busy": phase["score"] / seconds,
            **{f"ms {k}": 1000 * v / steps for k, v in per_step.items()},
            "outputs": outputs}


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


RANDOM_PAIRS = {"random-qwen": "target", "random-qwen-small": "target-small"}  # gpu_bench shapes


def load_pair(pair: str, tmp: Path):
    """(target dir, draft dir, dtype, scoring, prompts). The random pairs are issue 12's GPU
    setting: a random Qwen2-1.5B-shaped model drafting for itself (every proposal accepted),
    bf16, 128-token prompts of random ids (no tokenizer); `-small` shrinks it for a CPU dry
    run. They are saved to tmp, where the stack's services load them."""
    if pair in RANDOM_PAIRS:
        from gpu_bench import random_qwen2
        target = tmp / pair
        random_qwen2(RANDOM_PAIRS[pair], "cpu", torch.bfloat16, seed=1).save_pretrained(target)
        vocab = 4096 if pair.endswith("small") else 151936
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (128,), generator=gen).tolist() for _ in range(8)]
        return str(target), str(target), "bfloat16", "multi-query", prompts
    if pair == "qwen":
        target, draft = (str(resolve_model_dir(fetch(n)))
                         for n in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"))
        dtype, scoring = "bfloat16", "multi-query"
    else:
        target = draft = str(resolve_model_dir(None))
        dtype, scoring = "float32", "batch-expansion"
    tok = load_tokenizer(target)
    return target, draft, dtype, scoring, [tok(p).input_ids for p in CODE_PROMPTS]


SLEEP = {"OMP_WAIT_POLICY": "PASSIVE"}  # the stack's OpenMP setting before the brief spin
B1_MODES = {  # --modes name -> (row label, the stack's extra environment)
    "before": ("stack, deltas off, threads sleep",
               {"SPECDECODE_SEQUENCE_DELTAS": "false", **SLEEP}),
    "deltas": ("stack, deltas on, threads sleep", SLEEP),
    "defaults": ("stack, defaults (deltas, brief spin)", {}),
}


def section_b1(pair: str, repeats: int, max_tokens: int, batch: int, modes: list[str],
               device: str, tmp: Path) -> list[dict]:
    """Each stack setting against the in-process engine. All the modes' stacks are up at once;
    each round runs every mode beside its own in-process run (in-process then stack in even
    rounds, stack then in-process in odd ones), so drift on a shared machine hits both sides
    of a ratio alike and every mode alike; a mode's ratio is the median of its rounds' ratios,
    reported with their range."""
    target_dir, draft_dir, dtype, scoring, prompts = load_pair(pair, tmp)
    prompts = [prompts[i % len(prompts)] for i in range(batch)]
    target = load_model(target_dir, torch.device(device), getattr(torch, dtype))
    draft = load_model(draft_dir, torch.device(device), getattr(torch, dtype))
    tokenizer = "none" if pair in RANDOM_PAIRS else None
    runs: dict[str, list[tuple[dict, dict]]] = {mode: [] for mode in modes}
    with contextlib.ExitStack() as stacks:
        up = {mode: stacks.enter_context(LocalStack(StackConfig(
            target_model=target_dir, draft_model=draft_dir, device=device, dtype=dtype,
            tokenizer=tokenizer, scoring=scoring, num_speculative_tokens=4, port=0,
            speculation="fixed",
            extra_env=B1_MODES[mode][1]))) for mode in modes}
        run_inprocess(target, draft, scoring, prompts, 4, device)  # warm-up: first forwards are slow
        for stack in up.values():
            run_stack(stack, prompts, 4)
        for i in range(repeats):
            for mode, stack in up.items():
                if i % 2:
                    r = run_stack(stack, prompts, max_tokens)
                    inproc = run_inprocess(target, draft, scoring, prompts, max_tokens, device)
                else:
                    inproc = run_inprocess(target, draft, scoring, prompts, max_tokens, device)
                    r = run_stack(stack, prompts, max_tokens)
                runs[mode].append((inproc, r))
                print(f"round {i + 1} {mode}: stack {r['tokens_per_s']:.2f} / in-process "
                      f"{inproc['tokens_per_s']:.2f} tokens/s = "
                      f"{r['tokens_per_s'] / inproc['tokens_per_s']:.3f}x, steps "
                      f"{r['steps']:.0f} / {inproc['steps']}", flush=True)
    rows = []
    for mode, rounds in runs.items():
        inproc, r = median([i for i, _ in rounds]), median([s for _, s in rounds])
        ratios = [s["tokens_per_s"] / i["tokens_per_s"] for i, s in rounds]
        rows.append({"section": "b1", "pair": pair, "batch": batch, "mode": B1_MODES[mode][0],
                     **r, "vs_inprocess": statistics.median(ratios), "round_ratios": ratios,
                     "rounds": [{side: {k: v for k, v in run.items() if k != "outputs"}
                                 for side, run in (("inprocess", i), ("stack", s))}
                                for i, s in rounds],
                     "inprocess": {k: v for k, v in inproc.items() if k != "outputs"},
                     "same_tokens": all(s["outputs"] == i["outputs"] for i, s in rounds)})
        print("row", {k: v for k, v in rows[-1].items() if k not in ("outputs", "rounds")},
              flush=True)
    return rows


def section_overlap(repeats: int, max_tokens: int, k: int) -> list[dict]:
    target_dir, _, _, _, prompts = load_pair("smollm2", Path())
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
        for col in ("mode", "tokens/s", "vs in-process", "round range", "steps", "step ms",
                    "proposer busy", "scorer busy", "bytes/step", "proposer fallbacks",
                    "same tokens"):
            t.add_column(col)
        for r in b1:
            i = r["inprocess"]
            t.add_row(r["mode"], f"{r['tokens_per_s']:.2f} / {i['tokens_per_s']:.2f}",
                      f"{r['vs_inprocess']:.3f}x",
                      f"{min(r['round_ratios']):.3f}-{max(r['round_ratios']):.3f}x",
                      f"{r['steps']:.0f} / {i['steps']:.0f}",
                      f"{r['step_ms']:.0f} / {i['step_ms']:.0f}",
                      f"{r['proposer_busy']:.0%} / {i['proposer_busy']:.0%}",
                      f"{r['scorer_busy']:.0%} / {i['scorer_busy']:.0%}",
                      f"{r['bytes_per_step']:.0f}",
                      str(sum(x["stack"]["fallback_steps"] for x in r["rounds"])),
                      str(r["same_tokens"]))
        console.print(t)
        t = Table(title="where a step's time went, ms per step (medians over the rounds; hop: "
                        "the orchestrator's wait for a service beyond the service's own busy "
                        "time; other: the service's busy time outside forward passes)")
        t.add_column("part")
        for r in b1:
            t.add_column(r["mode"])
        t.add_column("in-process")
        for part in [k for k in b1[0] if k.startswith("ms ")] + ["step_ms"]:
            t.add_row(part.removeprefix("ms ").replace("step_ms", "step (wall)"),
                      *[f"{r[part]:.1f}" for r in b1], f"{b1[0]['inprocess'][part]:.1f}")
        console.print(t)
    ov = [r for r in rows if r["section"] == "overlap"]
    if ov:
        off = next(r for r in ov if not r["overlap"])
        t = Table(title=f"B=8, SmolLM2 drafting for itself, k={off['k']}, proposer on core 0, "
                        "scorer on core 1 (one thread each)")
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
@click.option("--pair", default="qwen",
              type=click.Choice(["qwen", "smollm2", *RANDOM_PAIRS]), show_default=True,
              help="Draft/target pair for the B=1 comparison (random-qwen: issue 12's GPU "
                   "setting, a random Qwen2-1.5B-shaped model drafting for itself).")
@click.option("--device", default="cpu", show_default=True,
              help="Where the B=1 section's in-process engine and services run (cuda: both "
                   "services on the one GPU).")
@click.option("--sections", default="bytes,b1,overlap", show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--batch", default=1, show_default=True,
              help="Concurrent streams in the stack vs in-process section (its B).")
@click.option("--modes", default=",".join(B1_MODES), show_default=True,
              help="Stack settings the B=1 section compares with the in-process engine: before "
                   "(deltas off, sleeping OpenMP threads: the stack before issue 12), deltas "
                   "(deltas on, sleeping threads), defaults.")
@click.option("--overlap-k", default=1, show_default=True,
              help="Speculative tokens per step in the overlap section (1: proposer and scorer "
                   "do one forward pass each per group; docs/benchmarks.md has k=2 too).")
@click.option("--out", default="bench/results/services.json", show_default=True)
def main(pair: str, device: str, sections: str, repeats: int, max_tokens: int, batch: int,
         modes: str, overlap_k: int, out: str) -> None:
    unknown = set(modes.split(",")) - set(B1_MODES)
    if unknown:
        raise click.BadParameter(f"unknown mode(s) {sorted(unknown)}", param_hint="--modes")
    console = Console(width=160)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for section in sections.split(","):
            if section == "bytes":
                new = section_bytes(Path(tmp), repeats)
            elif section == "b1":
                new = section_b1(pair, repeats, max_tokens, batch, modes.split(","), device,
                                 Path(tmp))
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
