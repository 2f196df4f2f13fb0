"""The wire between orchestrator, proposer and scorer: what it carries, what the hop costs
against the in-process engine, what overlap buys, unary calls against a stream, and the
scorer's checks of what it receives.

    python bench/wire_bench.py bytes [--repeats 3]
    python bench/wire_bench.py hop [--pair qwen|smollm2|random-qwen|random-qwen-small]
                                   [--device cpu|cuda] [--batch 1] [--modes before,deltas,defaults]
    python bench/wire_bench.py overlap [--k 1]
    python bench/wire_bench.py streams [--calls 2000] [--sizes 200,10000,100000]
    python bench/wire_bench.py peer-checks [--shapes 1x8,8x8] [--vocab 49152]

Each subcommand prints one table and writes JSON under bench/results/. Run the stacks alone on
a shared machine (`../shared/bin/measure`): numbers are medians over --repeats, ratios compare
runs made side by side in one process. `bytes`, `hop --pair random-qwen-small`, `streams` and
`peer-checks` at small sizes run in seconds to a minute.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the root: bench.harness
from bench.harness import (CODE_PROMPTS, RESULTS, median_s, qwen_dirs, random_qwen2,  # noqa: E402
                           run_engine, save, save_models, scrape, show, total)
from specdecode.wire import codec  # noqa: E402
from specdecode.api.client import SpecDecodeClient  # noqa: E402
from specdecode.interfaces import SpeculativeProposals  # noqa: E402
from specdecode.models.checkpoints import load_model, load_tokenizer, resolve_model_dir  # noqa: E402
from specdecode.models.model_loading import resolve_deterministic  # noqa: E402
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,  # noqa: E402
                                 SequenceGroupMetadata)
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model  # noqa: E402
from specdecode.v1 import scorer_service_pb2  # noqa: E402
from specdecode_stack.inprocess import build_inprocess_engine  # noqa: E402
from specdecode_stack.local import LocalStack, StackConfig, free_port  # noqa: E402

SAMPLING = {"greedy": {}, "top-p 0.9": {"temperature": 1.0, "top_p": 0.9, "seed": 3}}
PARTS = ("proposer forwards", "proposer other", "proposer hop", "scorer forwards", "scorer other",
         "scorer hop", "verify and rest of step", "between steps")


@click.group()
def cli() -> None:
    """The wire, one question per subcommand."""


# -- a stack's steps and the in-process engine's ------------------------------------------------


def stack_totals(stack: LocalStack) -> dict[str, float]:
    """The step counters of the three servers' metrics, summed over their other labels."""
    samples = {role: scrape(port) for role, port in stack.metrics_ports.items()}
    orch = samples["orchestrator"]
    return {"steps": total(orch, "specdecode_steps_total"),
            "bytes": total(orch, "specdecode_step_wire_bytes_sum"),  # sent and received
            "step_s": total(orch, "specdecode_step_duration_seconds_sum"),
            **{f"{phase}_s": total(orch, "specdecode_step_phase_seconds_sum", phase=phase)
               for phase in ("propose", "score", "verify", "overhead")},
            **{f"{role}_busy_s": total(orch, "specdecode_step_service_busy_seconds_sum", role=role)
               for role in ("proposer", "scorer")},
            **{f"{role}_forward_s": total(samples[role], "specdecode_model_forward_seconds_sum")
               for role in ("proposer", "scorer")},
            "resends": total(orch, "specdecode_full_resends_total"),
            # steps in which the proposer failed or was slower than its deadline (no drafts)
            "fallback_steps": total(orch, "specdecode_proposer_fallback_steps_total")}


def stream_all(stack: LocalStack, prompts: list[list[int]], max_tokens: int,
               **params) -> tuple[dict[str, float], float, list[list[int]]]:
    """All prompts at once, one stream each, on channels connected before the clock starts:
    (metric deltas, seconds, outputs)."""
    clients = [SpecDecodeClient(stack.address) for _ in prompts]
    try:
        for client in clients:
            grpc.channel_ready_future(client.channel).result(timeout=30)
        one = lambda client, prompt: [t for m in client.stream(prompt, max_tokens=max_tokens,  # noqa: E731
                                                               **params) for t in m.token_ids]
        before, start = stack_totals(stack), time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(one, clients, prompts))
        seconds = time.perf_counter() - start
    finally:
        for client in clients:
            client.close()
    time.sleep(0.2)  # the last step's metrics are recorded after its message
    after = stack_totals(stack)
    return {key: after[key] - before[key] for key in after}, seconds, outputs


def step_split(steps: float, seconds: float, parts: list[float], busy: tuple[float, float],
               **rest) -> dict:
    """Tokens/s aside, what a run's steps cost: ms per step of each of PARTS, busy shares."""
    return {"steps": steps, "step_ms": 1000 * seconds / steps, "proposer_busy": busy[0] / seconds,
            "scorer_busy": busy[1] / seconds, **rest,
            **{f"ms {k}": 1000 * v / steps for k, v in zip(PARTS, parts)}}


def run_stack(stack: LocalStack, prompts, max_tokens: int, skip_tokens: int = 0, **params) -> dict:
    """Tokens/s, bytes per step, where a step's time went, outputs. With skip_tokens,
    per-step numbers leave out the steps of a run of that many tokens (the same steps begin
    the full run)."""
    d, seconds, outputs = stream_all(stack, prompts, max_tokens, **params)
    tokens_per_s = sum(map(len, outputs)) / seconds
    if skip_tokens:
        head, head_seconds, head_outputs = stream_all(stack, prompts, skip_tokens, **params)
        assert all(o[:skip_tokens] == h for o, h in zip(outputs, head_outputs))
        d = {key: d[key] - head[key] for key in d}
        seconds -= head_seconds
    return {"tokens_per_s": tokens_per_s, "outputs": outputs, **step_split(
        d["steps"], seconds, [d["proposer_forward_s"], d["proposer_busy_s"] - d["proposer_forward_s"],
                              d["propose_s"] - d["proposer_busy_s"], d["scorer_forward_s"],
                              d["scorer_busy_s"] - d["scorer_forward_s"], d["score_s"] - d["scorer_busy_s"],
                              d["verify_s"] + d["overhead_s"], seconds - d["step_s"]],
        (d["proposer_busy_s"], d["scorer_busy_s"]), bytes_per_step=d["bytes"] / d["steps"],
        resends=d["resends"], fallback_steps=d["fallback_steps"])}


def run_inprocess(target, draft, scoring: str, prompts, max_tokens: int, device: str,
                  k: int = 4, deterministic: bool = False) -> dict:
    """The same as run_stack's, in-process: proposing and scoring are its busy time."""
    eng = build_inprocess_engine(target, draft, scoring, k, torch.device(device),
                                 deterministic=deterministic)
    runners = {"proposer": eng.proposer.worker.runner, "scorer": eng.scorer.worker.runner}
    before = {role: r.stats.forward_seconds for role, r in runners.items()}
    r = run_engine(eng, prompts, max_tokens, torch.device(device))
    seconds = sum(map(len, r["outputs"])) / r["tokens_per_s"]
    fwd = {role: runner.stats.forward_seconds - before[role] for role, runner in runners.items()}
    propose, score = (sum(getattr(s, f) for s in r["step_stats"]) for f in ("propose_s", "score_s"))
    step = sum(s.total_s for s in r["step_stats"])
    return {"tokens_per_s": r["tokens_per_s"], "outputs": r["outputs"], **step_split(
        r["steps"], seconds, [fwd["proposer"], propose - fwd["proposer"], 0.0, fwd["scorer"],
                              score - fwd["scorer"], 0.0, step - propose - score, seconds - step],
        (propose, score), bytes_per_step=0.0)}


def median(runs: list[dict]) -> dict:
    return {**{k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "outputs"},
            "outputs": runs[-1]["outputs"]}


# -- bytes -------------------------------------------------------------------------------------


@cli.command("bytes")
@click.option("--repeats", default=3, show_default=True)
@click.option("--out", default=str(RESULTS / "wire_bytes.json"), show_default=True)
def bytes_(repeats: int, out: str) -> None:
    """Bytes per decode step once both services hold the sequence, at 256 and 4,096 tokens of
    context, greedy and top-p 0.9, with sequence deltas on and off (tiny random models, B=1,
    draft = target, k=4)."""
    spec = TinyModelSpec(seed=1, max_position_embeddings=4096 + 64)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = save_models(tmp, tiny=build_tiny_model(spec))["tiny"]
        for deltas in (True, False):
            config = StackConfig(target_model=tiny, draft_model=tiny, tokenizer="none", device="cpu",
                                 num_speculative_tokens=4, port=0, speculation="fixed",
                                 extra_env={"SPECDECODE_SEQUENCE_DELTAS": str(deltas).lower()})
            with LocalStack(config) as stack:
                for context in (256, 4096):
                    prompt = torch.randint(0, spec.vocab_size, (context,), generator=gen).tolist()
                    for name, params in SAMPLING.items():
                        # Steady decode steps: left out are the prompt's steps and the first
                        # decode step, which brings the proposer the prompt (the prompt's step
                        # asks no proposals); draft = target accepts all k: k + 2 tokens.
                        r = median([run_stack(stack, [prompt], 48, skip_tokens=6, **params)
                                    for _ in range(repeats)])
                        rows.append({"deltas": deltas, "context": context, "sampling": name,
                                     **{k: v for k, v in r.items() if k != "outputs"}})
    at = {(r["deltas"], r["sampling"], r["context"]): r["bytes_per_step"] for r in rows}
    show("bytes per decode step once both services hold the sequence, B=1, k=4 (tiny random "
         "models, draft = target, tokens 7-48)",
         ("deltas", "sampling", "context 256", "context 4096", "4096 / 256"),
         [("on" if d else "off", s, f"{at[(d, s, 256)]:.0f}", f"{at[(d, s, 4096)]:.0f}",
           f"{at[(d, s, 4096)] / at[(d, s, 256)]:.3f}") for d in (True, False) for s in SAMPLING])
    save(out, rows=rows)


# -- hop ---------------------------------------------------------------------------------------

RANDOM_PAIRS = {"random-qwen": "target", "random-qwen-small": "target-small"}
SLEEP = {"OMP_WAIT_POLICY": "PASSIVE"}  # the stack's OpenMP setting before the brief spin
MODES = {  # --modes name -> (row label, the stack's extra environment)
    "before": ("stack, deltas off, threads sleep", {"SPECDECODE_SEQUENCE_DELTAS": "false", **SLEEP}),
    "deltas": ("stack, deltas on, threads sleep", SLEEP),
    "defaults": ("stack, defaults (deltas, brief spin)", {}),
}


def load_pair(pair: str, tmp: Path):
    """(target dir, draft dir, dtype, scoring, prompts). The random pairs are issue 12's GPU
    setting: a random Qwen2-1.5B-shaped model drafting for itself (every proposal accepted),
    bf16, 128-token prompts of random ids (no tokenizer); `-small` shrinks it for a CPU dry
    run. They are saved to tmp, where the stack's services load them."""
    if pair in RANDOM_PAIRS:
        model = random_qwen2(RANDOM_PAIRS[pair], "cpu", torch.bfloat16, seed=1)
        target = save_models(tmp, **{pair: model})[pair]
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, model.config.vocab_size, (128,), generator=gen).tolist()
                   for _ in range(8)]
        return target, target, "bfloat16", "multi-query", prompts
    if pair == "qwen":
        target, draft = map(str, qwen_dirs())
        dtype, scoring = "bfloat16", "multi-query"
    else:
        target = draft = str(resolve_model_dir(None))
        dtype, scoring = "float32", "batch-expansion"
    tok = load_tokenizer(target)
    return target, draft, dtype, scoring, [tok(p).input_ids for p in CODE_PROMPTS]


def rounds(up: dict, inprocess, prompts, max_tokens: int, repeats: int) -> dict[str, list]:
    """Each round runs every mode's stack beside its own in-process run (in-process first in
    even rounds, the stack first in odd ones): drift hits both sides of a ratio alike."""
    runs = {mode: [] for mode in up}
    for i in range(repeats):
        for mode, stack in up.items():
            if i % 2:
                r, inproc = run_stack(stack, prompts, max_tokens), inprocess(max_tokens)
            else:
                inproc, r = inprocess(max_tokens), run_stack(stack, prompts, max_tokens)
            runs[mode].append((inproc, r))
            print(f"round {i + 1} {mode}: stack {r['tokens_per_s']:.2f} / in-process "
                  f"{inproc['tokens_per_s']:.2f} tokens/s = {r['tokens_per_s'] / inproc['tokens_per_s']:.3f}x, "
                  f"steps {r['steps']:.0f} / {inproc['steps']}", flush=True)
    return runs


def hop_rows(pair: str, batch: int, runs: dict[str, list]) -> list[dict]:
    """Per mode: its stack's medians, the median of its rounds' ratios (and their range) and
    its in-process medians."""
    rows = []
    for mode, rs in runs.items():
        ratios = [s["tokens_per_s"] / i["tokens_per_s"] for i, s in rs]
        strip = lambda run: {k: v for k, v in run.items() if k != "outputs"}  # noqa: E731
        rows.append({"pair": pair, "batch": batch, "setting": mode, "mode": MODES[mode][0],
                     **strip(median([s for _, s in rs])), "vs_inprocess": statistics.median(ratios),
                     "round_ratios": ratios, "inprocess": strip(median([i for i, _ in rs])),
                     "rounds": [{"inprocess": strip(i), "stack": strip(s)} for i, s in rs],
                     "same_tokens": all(s["outputs"] == i["outputs"] for i, s in rs)})
    return rows


@cli.command()
@click.option("--pair", default="qwen", type=click.Choice(["qwen", "smollm2", *RANDOM_PAIRS]),
              show_default=True, help="qwen: Qwen2.5-Coder 0.5B -> 1.5B, bf16; smollm2: SmolLM2 "
              "drafting for itself, fp32; random-qwen: issue 12's GPU setting, a random "
              "Qwen2-1.5B-shaped model drafting for itself (-small: a CPU dry run).")
@click.option("--device", default="cpu", show_default=True,
              help="Where the in-process engine and the services run (cuda: both on the one GPU).")
@click.option("--repeats", default=3, show_default=True)
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--batch", default=1, show_default=True, help="Concurrent streams (B).")
@click.option("--k", default=4, show_default=True,
              help="Fixed k of both (0: plain decoding, where the orchestrator and the scorer's "
                   "service are all the stack adds).")
@click.option("--modes", default=",".join(MODES), show_default=True,
              help="Stack settings compared with the in-process engine: before (deltas off, "
                   "sleeping OpenMP threads: the stack before issue 12), deltas (deltas on, "
                   "sleeping threads), defaults.")
@click.option("--out", default=str(RESULTS / "wire_hop.json"), show_default=True)
def hop(pair, device, repeats, max_tokens, batch, k, modes, out) -> None:
    """The gRPC stack against the in-process engine (draft-model speculation at a fixed --k,
    the numerics the services choose for the dtype: --deterministic auto), in alternation, for each stack setting in --modes, all the modes' stacks up at once: the
    median of the rounds' ratios and their range, and where a step's time went (forward
    passes, the services' other busy time, the hop to each service, the orchestrator's part)
    from the stack's own per-step metrics (hop: the wait for a service beyond its own busy
    time)."""
    if set(modes.split(",")) - set(MODES):
        raise click.BadParameter(f"unknown mode(s) {sorted(set(modes.split(',')) - set(MODES))}",
                                 param_hint="--modes")
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir, dtype, scoring, prompts = load_pair(pair, Path(tmp))
        prompts = [prompts[i % len(prompts)] for i in range(batch)]
        target, draft = (load_model(d, torch.device(device), getattr(torch, dtype))
                         for d in (target_dir, draft_dir))
        deterministic = resolve_deterministic("auto", dtype)
        inprocess = lambda n: run_inprocess(target, draft, scoring, prompts, n, device, k,  # noqa: E731
                                            deterministic)
        with contextlib.ExitStack() as stacks:
            up = {mode: stacks.enter_context(LocalStack(StackConfig(
                target_model=target_dir, draft_model=draft_dir, device=device, dtype=dtype,
                tokenizer="none" if pair in RANDOM_PAIRS else None, scoring=scoring,
                num_speculative_tokens=k, port=0, speculation="fixed", extra_env=MODES[mode][1])))
                for mode in modes.split(",")}
            inprocess(4)  # warm-up: first forwards are slow
            for stack in up.values():
                run_stack(stack, prompts, 4)
            rows = hop_rows(pair, batch, rounds(up, inprocess, prompts, max_tokens, repeats))
    show(f"B={batch}, {pair}, k={k}: the stack (--modes: {'; '.join(f'{k}: {v[0]}' for k, v in MODES.items())}) "
         "against the in-process engine beside it, in alternation; busy: the share of the wall "
         "time the proposer / scorer worked (in-process: proposing / scoring); then ms per step "
         "by part (medians over the rounds; hop: the wait for a service beyond its busy time)",
         ("run", "tokens/s", "vs in-process", "round range", "steps", "step ms", "busy p / s",
          "bytes/step", "fallbacks", "same tokens", "fwd p", "other p", "hop p", "fwd s", "other s",
          "hop s", "verify, rest", "between"),
         [line for r in rows for line in hop_lines(r)], width=200)
    save(out, rows=rows)


def hop_lines(r: dict) -> list[tuple]:
    """A mode's line, then the line of the in-process runs beside it."""
    i = r["inprocess"]
    return [(f"stack, {r['setting']}", f"{r['tokens_per_s']:.2f}", f"{r['vs_inprocess']:.3f}x",
             f"{min(r['round_ratios']):.3f}-{max(r['round_ratios']):.3f}x", f"{r['steps']:.0f}",
             f"{r['step_ms']:.0f}", f"{r['proposer_busy']:.0%} / {r['scorer_busy']:.0%}",
             f"{r['bytes_per_step']:.0f}", sum(x["stack"]["fallback_steps"] for x in r["rounds"]),
             r["same_tokens"], *(f"{r['ms ' + p]:.1f}" for p in PARTS)),
            ("  in-process", f"{i['tokens_per_s']:.2f}", "", "", f"{i['steps']:.0f}", f"{i['step_ms']:.0f}",
             f"{i['proposer_busy']:.0%} / {i['scorer_busy']:.0%}", "", "", "",
             *(f"{i['ms ' + p]:.1f}" for p in PARTS))]


# -- overlap -----------------------------------------------------------------------------------


@cli.command()
@click.option("--repeats", default=3, show_default=True)
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--k", default=1, show_default=True,
              help="Speculative tokens per step (1: proposer and scorer do one forward pass "
                   "each per group; docs/benchmarks.md has k=2 too).")
@click.option("--out", default=str(RESULTS / "wire_overlap.json"), show_default=True)
def overlap(repeats, max_tokens, k, out) -> None:
    """Aggregate tokens/s at B=8 with and without overlap (SPECDECODE_OVERLAP), proposer and
    scorer pinned to separate cores (`taskset`, one thread each; SmolLM2 drafting for
    itself), and whether both runs gave the same tokens."""
    target_dir, _, _, _, prompts = load_pair("smollm2", Path())
    prompts = [prompts[i % len(prompts)] for i in range(8)]
    rows = []
    for on in (False, True):
        config = StackConfig(target_model=target_dir, draft_model=target_dir, device="cpu",
                             num_speculative_tokens=k, port=0, pin={"proposer": "0", "scorer": "1"},
                             speculation="fixed", extra_env={"SPECDECODE_OVERLAP": str(on).lower()})
        with LocalStack(config) as stack:
            rows.append({"overlap": on, "k": k, **median([run_stack(stack, prompts, max_tokens)
                                                          for _ in range(repeats)])})
    off = rows[0]
    show(f"B=8, SmolLM2 drafting for itself, k={k}, proposer on core 0, scorer on core 1 (one "
         "thread each)", ("overlap", "tokens/s", "vs without", "proposer busy", "scorer busy",
                          "same tokens"),
         [("on" if r["overlap"] else "off", f"{r['tokens_per_s']:.2f}",
           f"{r['tokens_per_s'] / off['tokens_per_s']:.3f}x", f"{r['proposer_busy']:.0%}",
           f"{r['scorer_busy']:.0%}", r["outputs"] == off["outputs"]) for r in rows])
    save(out, rows=rows)


# -- streams -----------------------------------------------------------------------------------

METHOD_UNARY, METHOD_STREAM = "/bench.Echo/Unary", "/bench.Echo/Stream"


async def echo_server(port: int) -> None:
    """The echo server (run in its own process: `streams --serve PORT`)."""
    async def unary(request: bytes, context) -> bytes:
        return request

    async def stream(requests, context):
        async for request in requests:
            yield request
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream)})])
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def round_trips(address: str, size: int, calls: int) -> dict[str, float]:
    """Median ms of a unary call and of a message on one bidirectional stream (the first
    10% dropped)."""
    payload = b"x" * size
    with grpc.insecure_channel(address) as channel:
        unary = channel.unary_unary(METHOD_UNARY)
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            unary(payload)
            times.append(time.perf_counter() - t)
        unary_ms = 1000 * statistics.median(times[calls // 10:])
        requests: queue.Queue = queue.Queue()
        responses = channel.stream_stream(METHOD_STREAM)(iter(requests.get, None))
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            requests.put(payload)
            next(responses)
            times.append(time.perf_counter() - t)
        requests.put(None)
    return {"size": size, "unary_ms": unary_ms, "stream_ms": 1000 * statistics.median(times[calls // 10:])}


@cli.command()
@click.option("--calls", default=2000, show_default=True)
@click.option("--sizes", default="200,10000,100000", show_default=True)
@click.option("--out", default=str(RESULTS / "step_stream.json"), show_default=True)
@click.option("--serve", "serve_port", default=0, hidden=True)
def streams(calls: int, sizes: str, out: str, serve_port: int) -> None:
    """A unary call per step against one long-lived bidirectional stream: the round trip of a
    step's request and response on loopback, grpcio's sync client (the orchestrator's) against
    a grpc.aio server (the services') in another process. Sizes are request bytes (the
    response as large): ~200 B a greedy delta step at B=1, ~10 KB a sampled step's sparse
    probabilities, ~100 KB a large batch."""
    if serve_port:
        asyncio.run(echo_server(serve_port))
        return
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "streams", "--serve", str(port)])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
        rows = [round_trips(f"127.0.0.1:{port}", int(s), calls) for s in sizes.split(",")]
    finally:
        server.kill()
        server.wait()
    show(f"step round trip on loopback, server in another process, median of {calls} (first 10% "
         "dropped)", ("bytes each way", "unary ms", "stream ms", "saved ms"),
         [(r["size"], f"{r['unary_ms']:.3f}", f"{r['stream_ms']:.3f}",
           f"{r['unary_ms'] - r['stream_ms']:.3f}") for r in rows], width=120)
    save(out, rows=rows)


# -- peer-checks -------------------------------------------------------------------------------


def message(B: int, k: int, V: int, context: int, probs: str) -> scorer_service_pb2.ScoreProposalsRequest:
    """A step of B sequences of `context` tokens with k proposals each; probs: none, sparse
    (top-50 rows, as a draft model sends them) or dense."""
    g = torch.Generator().manual_seed(0)
    params = SamplingParams() if probs == "none" else SamplingParams(temperature=0.8, top_k=50)
    req = ExecuteModelRequest([SequenceGroupMetadata(
        f"r{i}", False, {i: SequenceData(torch.randint(0, V, (context,), generator=g).tolist(),
                                         [1])}, params) for i in range(B)], k)
    p = None
    if probs != "none":
        p = torch.softmax(torch.randn(B, k, V, generator=g), -1)
        if probs == "sparse":
            kept = p.topk(50, -1)
            p = torch.zeros_like(p).scatter(-1, kept.indices, kept.values)
            p /= p.sum(-1, keepdim=True)
    proposals = SpeculativeProposals(torch.randint(0, V, (B, k), generator=g), p, torch.full((B,), k))
    return scorer_service_pb2.ScoreProposalsRequest(
        request=codec.request_to_proto(req), proposals=codec.proposals_to_proto(proposals))


def decode_and_check(B: int, k: int, V: int, context: int, probs: str, repeats: int) -> dict:
    m = message(B, k, V, context, probs)

    def decode():
        return codec.request_from_proto(m.request), codec.proposals_from_proto(
            m.proposals, batch_size=B, vocab_size=V)
    req, proposals = decode()

    def checks():
        req.validate(V, context + k + 2)
        proposals.validate(req, V, context + k + 2)
    return {"B": B, "k": k, "V": V, "context": context, "probs": probs, "bytes": m.ByteSize(),
            "decode_ms": 1000 * median_s(decode, repeats), "checks_ms": 1000 * median_s(checks, repeats)}


@cli.command("peer-checks")
@click.option("--shapes", default="1x8,8x8", show_default=True, help="BxK,...")
@click.option("--vocab", default=49152, show_default=True)
@click.option("--context", default=512, show_default=True, help="tokens per sequence")
@click.option("--repeats", default=30, show_default=True)
@click.option("--out", default=str(RESULTS / "peer_checks.json"), show_default=True)
def peer_checks(shapes: str, vocab: int, context: int, repeats: int, out: str) -> None:
    """What the scorer's peer checks cost per step (docs/design.md, "Services check their
    peers"): decoding a ScoreProposals request off the wire against the checks that follow it
    (ExecuteModelRequest.validate, SpeculativeProposals.validate), per shape BxK greedy (no
    draft probabilities) and sampled (probabilities [B, k, V], sparse and dense)."""
    rows = [decode_and_check(*map(int, s.split("x")), vocab, context, probs, repeats)
            for s in shapes.split(",") for probs in ("none", "sparse", "dense")]
    show(f"scorer: decoding a step vs checking it, V={vocab}, {context}-token sequences, median "
         f"of {repeats}", ("B x k", "draft probs", "request bytes", "decode ms", "checks ms",
                           "checks/decode"),
         [(f"{r['B']} x {r['k']}", r["probs"], r["bytes"], f"{r['decode_ms']:.3f}",
           f"{r['checks_ms']:.3f}", f"{r['checks_ms'] / r['decode_ms']:.2f}") for r in rows], width=120)
    save(out, rows=rows)


if __name__ == "__main__":
    cli()
