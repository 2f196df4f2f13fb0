"""The executor: what a forward costs and how it runs, in this process.

    python bench/executor_bench.py decode [--models tiny,smollm2] [--ks 4] [--batches 1,4]
    python bench/executor_bench.py decode --models qwen --dtype bfloat16 --batches 1 --hf
    python bench/executor_bench.py scoring [--models tiny,smollm2]
    python bench/executor_bench.py compiled --models smollm2:float32,qwen1.5b:bfloat16
    python bench/executor_bench.py attention [--small]
    python bench/executor_bench.py parts --model qwen --batches 1,4 [--deterministic off]

Each subcommand prints one table and writes JSON under bench/results/ (its --help says what it
measures); `tiny` models or `--small` run each in seconds to a minute.
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import click
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the root: bench.harness
from bench.harness import (CODE_PROMPTS, CPU, PROMPTS, RESULTS, cpu_model, fmt,  # noqa: E402
                           forward_ms, hf_generate_batch, load_named, median_s, qwen_dirs, ratio,
                           run_engine, save, show, sync)
from scorer_svc.methods import SCORING_METHODS, scorer_class  # noqa: E402
from specdecode.executor.attention import AttnBatch, SdpaBackend  # noqa: E402
from specdecode.executor.device import resolve_device, resolve_dtype  # noqa: E402
from specdecode.executor.invariant_ops import (ROW_TILE, SMALL_TILES, RowTiledLinear,  # noqa: E402
                                               packable)
from specdecode.interfaces import SpeculativeProposals  # noqa: E402
from specdecode.executor.model_runner import ModelRunner, RunnerRow  # noqa: E402
from specdecode.models.checkpoints import load_model, load_tokenizer  # noqa: E402
from specdecode.models.model_loading import resolve_deterministic  # noqa: E402
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,  # noqa: E402
                                 SequenceGroupMetadata)
from specdecode.executor.static_attention import (FlexBackend, PaddedSdpaBackend, StaticRows,  # noqa: E402
                                                  causal_new_mask)
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model  # noqa: E402
from specdecode.executor.worker import ModelWorker  # noqa: E402
from specdecode_stack.inprocess import build_inprocess_engine  # noqa: E402

PROPOSER = {"tiny": "1-layer random draft", "smollm2": "n-gram", "random-1b": "draft = target",
            "qwen": "Qwen2.5-Coder 0.5B"}
MODELS = click.option("--models", "model_names", default="tiny,smollm2", show_default=True,
                      help="tiny (random, a 1-layer random draft: overhead bound), smollm2 "
                           "(SmolLM2-135M, n-gram proposer), random-1b (a random ~1B Llama "
                           "drafting for itself: every proposal accepted), qwen (Qwen2.5-Coder "
                           "0.5B drafting for 1.5B, three code prompts).")


@click.group()
def cli() -> None:
    """The executor, one question per subcommand."""


def models(name: str, dtype: torch.dtype, device):
    """(target, draft or "ngram", prompts as token ids)."""
    gen = torch.Generator().manual_seed(0)
    if name == "random-1b":
        target = build_tiny_model(TinyModelSpec(
            seed=1, vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=16,
            max_position_embeddings=2048, initializer_range=0.02)).to(device, dtype)
        return target, target, [torch.randint(0, 32000, (n,), generator=gen).tolist()
                                for n in (64, 128, 256, 512)]
    if name == "tiny":
        target = build_tiny_model(TinyModelSpec(seed=1, hidden_size=256, num_layers=4))
        draft = build_tiny_model(TinyModelSpec(seed=2, hidden_size=64, num_layers=1))
        return target.to(device, dtype), draft.to(device, dtype), [
            torch.randint(0, 256, (n,), generator=gen).tolist() for n in (8, 16, 24, 32)]
    if name == "qwen":
        target_dir, draft_dir = qwen_dirs()
        tok = load_tokenizer(target_dir)
        texts = [PROMPTS["code"][0], PROMPTS["class"][0], "import json\n\ndef load_config(path):"
                 "\n    \"\"\"Read a JSON config file and return a dict.\"\"\"\n"]
        return (load_model(target_dir, device, dtype), load_model(draft_dir, device, dtype),
                [tok(t).input_ids for t in texts])
    tok = load_tokenizer(None)
    return load_model(None, device, dtype), "ngram", [tok(p).input_ids for p in CODE_PROMPTS]


# -- decode ------------------------------------------------------------------------------------


def decode_run(target, draft, mode: str, k: int, prompts, max_tokens: int, device) -> dict:
    """One batch to completion, in-process: the engine at (scoring, k), or HF `generate`."""
    if mode == "HF generate":
        outputs, seconds = hf_generate_batch(target, prompts, max_tokens)
        return {"tokens_per_s": sum(map(len, outputs)) / seconds, "acceptance": None,
                "steps": max_tokens, "outputs": outputs}
    engine = build_inprocess_engine(target, draft, "multi-query" if k == 0 else mode, k, device)
    r = run_engine(engine, prompts, max_tokens, device)
    steps = r.pop("step_stats")
    split = {"propose": sum(s.propose_s for s in steps), "score": sum(s.score_s for s in steps),
             "verify": sum(s.verify_s for s in steps)}
    split["overhead"] = sum(s.total_s for s in steps) - sum(split.values())
    return {**r, "accepted_by_position": [sum(s.accepted_by_position[j] for s in steps if j < s.k)
                                          for j in range(k)],
            "spec_sequences": sum(s.spec_sequences for s in steps),
            "step_ms": {p: 1000 * v / len(steps) for p, v in split.items()}}


def decode_row(name, batch, mode, k, runs, base_runs) -> dict:
    """Medians over the repeats; ratios to target-only in the same repeat; tokens equal to
    target-only's (first repeat)."""
    tps = statistics.median(r["tokens_per_s"] for r in runs)
    ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, base_runs)]
    ref = base_runs[0]["outputs"]
    return {"model": name, "batch": batch, "mode": mode, "k": k, "tokens_per_s": tps,
            "speedup": tps / statistics.median(b["tokens_per_s"] for b in base_runs),
            "speedup_runs": ratios, "acceptance": runs[0]["acceptance"], "steps": runs[0]["steps"],
            "equal_tokens": sum(a == b for o, r in zip(runs[0]["outputs"], ref) for a, b in zip(o, r)),
            "total_tokens": sum(map(len, ref)),
            **{key: runs[0][key] for key in ("accepted_by_position", "spec_sequences") if key in runs[0]},
            **({"step_ms": {p: statistics.median(r["step_ms"][p] for r in runs)
                            for p in runs[0]["step_ms"]}} if "step_ms" in runs[0] else {})}


@cli.command()
@MODELS
@click.option("--repeats", default=3, show_default=True)
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@click.option("--ks", default="4", show_default=True, help="Draft lengths to decode with.")
@click.option("--batches", default="1,4", show_default=True, help="Batch sizes to decode.")
@click.option("--hf", is_flag=True, help="Also HF `generate` (target only, dynamic cache).")
@click.option("--out", default=str(RESULTS / "decode.json"), show_default=True)
@click.option("--plots", "plot_dir", default="bench/results", show_default=True,
              help="Directory for the PNG plots (decode_<model>_*.png; the bench extra's "
                   "matplotlib); empty: none.")
def decode(model_names, repeats, max_tokens, device, dtype, ks, batches, hf, out, plot_dir) -> None:
    """Target-only against speculative decoding (both scorers, each k), in-process, batches
    of the model's prompts: tokens/s (median of --repeats, the configurations interleaved in
    each), the ratio to target-only (and its range over the repeats), acceptance, steps, and
    the tokens equal to target-only's output."""
    dev, rows = resolve_device(device), []
    for name in model_names.split(","):
        target, draft, prompts = models(name, resolve_dtype(dtype), dev)
        configs = [(b, mode, k) for b in map(int, batches.split(","))
                   for mode, k in [("target-only", 0)] + [("HF generate", 0)] * hf + [
                       (s, int(k)) for s in SCORING_METHODS for k in ks.split(",")]]
        runs = {c: [] for c in configs}
        for _ in range(repeats):
            for b, mode, k in configs:
                batch = [prompts[i % len(prompts)] for i in range(b)]
                runs[(b, mode, k)].append(decode_run(target, draft, mode, k, batch, max_tokens, dev))
        rows += [decode_row(name, b, mode, k, rs, runs[(b, "target-only", 0)])
                 for (b, mode, k), rs in runs.items()]
    show(f"decode, in-process ({dev.type}, {dtype}), {max_tokens} tokens/request",
         ("model", "proposer", "batch", "mode", "k", "tokens/s (median)", "vs target-only",
          "per repeat", "acceptance", "steps", "equal to target-only"),
         [(r["model"], PROPOSER[r["model"]], r["batch"], r["mode"], r["k"], f"{r['tokens_per_s']:.2f}",
           ratio(r["speedup"]), f"{min(r['speedup_runs']):.2f}-{max(r['speedup_runs']):.2f}x",
           "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}", r["steps"],
           f"{r['equal_tokens']}/{r['total_tokens']}") for r in rows])
    print("wrote", save(out, device=device, dtype=dtype, rows=rows))
    for name in model_names.split(",") if plot_dir else []:
        plots([r for r in rows if r["model"] == name and r["mode"] in (*SCORING_METHODS, "target-only")],
              name, Path(plot_dir))


def plots(rows: list[dict], model: str, directory: Path) -> None:
    """decode_<model>_speedup_by_k.png (speed-up against k, per scoring and batch),
    _acceptance_by_position.png (multi-query, largest batch) and _step_time_split.png."""
    import matplotlib  # noqa: PLC0415 (the bench extra)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    def save_fig(fig, ax, what: str, **labels) -> None:
        ax.set(**labels, title=f"{model}: {what.replace('_', ' ')}")
        ax.legend(fontsize=8)
        directory.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(directory / f"decode_{model}_{what}.png", dpi=100)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, batch in sorted({(r["mode"], r["batch"]) for r in rows if r["k"]}):
        ax.plot(*zip(*sorted((r["k"], r["speedup"]) for r in rows
                             if (r["mode"], r["batch"]) == (mode, batch))), marker="o",
                label=f"{mode}, batch {batch}")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    save_fig(fig, ax, "speedup_by_k", xlabel="k (draft tokens per step)", ylabel="speed-up over target-only")
    mq = [r for r in rows if r["k"] and r["mode"] == "multi-query"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in sorted((r for r in mq if r["batch"] == max(x["batch"] for x in mq)), key=lambda r: r["k"]):
        ax.plot([n / max(r["spec_sequences"], 1) for n in r["accepted_by_position"]], marker="o",
                label=f"k={r['k']}, batch {r['batch']}")
    save_fig(fig, ax, "acceptance_by_position", xlabel="draft position", ylim=(0, 1),
             ylabel="accepted (fraction of sequence-steps)")
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.7), 4))
    bottom = [0.0] * len(rows)
    for phase in ("propose", "score", "verify", "overhead"):
        ms = [r["step_ms"][phase] for r in rows]
        ax.bar(range(len(rows)), ms, bottom=bottom, label=phase)
        bottom = [b + m for b, m in zip(bottom, ms)]
    ax.set_xticks(range(len(rows)), [f"{r['mode']}\nk={r['k']} B={r['batch']}" for r in rows],
                  fontsize=6, rotation=90)
    save_fig(fig, ax, "step_time_split", ylabel="ms per step (mean)")


# -- scoring -----------------------------------------------------------------------------------


def scoring_call_ms(target, scoring: str, B: int, k: int, context: int, device) -> float:
    """One ScoreProposals on a warm cache: B sequences of `context` tokens, k proposals each."""
    scorer = scorer_class(scoring)(ModelWorker(ModelRunner(target, device), "target"))
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(B * 100 + k)
    groups = [SequenceGroupMetadata(str(i), False, {i: SequenceData(
        torch.randint(0, vocab, (context,), generator=gen).tolist(), [1])}, SamplingParams())
        for i in range(B)]
    req = ExecuteModelRequest(groups, num_lookahead_slots=k)
    props = SpeculativeProposals(torch.randint(0, vocab, (B, k), generator=gen), None,
                                 torch.full((B,), k))
    scorer.score_proposals(req, props)  # fills the KV cache with the context
    sync(device)
    start = time.perf_counter()
    scorer.score_proposals(req, props)
    sync(device)
    return (time.perf_counter() - start) * 1000


@cli.command()
@MODELS
@click.option("--repeats", default=3, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@click.option("--context", default=64, show_default=True, help="Cached tokens per sequence.")
@click.option("--out", default=str(RESULTS / "scoring.json"), show_default=True)
def scoring(model_names, repeats, device, dtype, context, out) -> None:
    """One scoring call on a warm cache, batch expansion against multi-query, at B = 1, 4
    and k = 1, 4, 8 (median of --repeats, interleaved)."""
    dev, rows = resolve_device(device), []
    cells = [(B, k) for B in (1, 4) for k in (1, 4, 8)]
    for name in model_names.split(","):
        target = models(name, resolve_dtype(dtype), dev)[0]
        times = {(s, B, k): [] for s in SCORING_METHODS for B, k in cells}
        for _ in range(repeats):
            for (s, B, k), ts in times.items():
                ts.append(scoring_call_ms(target, s, B, k, context, dev))
        for B, k in cells:
            be, mq = (statistics.median(times[(s, B, k)]) for s in ("batch-expansion", "multi-query"))
            rows.append({"model": name, "B": B, "k": k, "batch_expansion_ms": be,
                         "multi_query_ms": mq, "ratio": be / mq})
    show(f"one scoring call ({dev.type}, {dtype}, warm cache, {context}-token context)",
         ("model", "B", "k", "batch expansion ms", "multi-query ms", "BE / MQ"),
         [(r["model"], r["B"], r["k"], f"{r['batch_expansion_ms']:.1f}", f"{r['multi_query_ms']:.1f}",
           f"{r['ratio']:.2f}") for r in rows])
    print("wrote", save(out, device=device, dtype=dtype, rows=rows))


# -- compiled ----------------------------------------------------------------------------------


def greedy(runner: ModelRunner, prompts: list[list[int]], n: int, first_id: int) -> list[list[int]]:
    """n greedy tokens per prompt, the rows decoded together (cache ids first_id...): the
    first call prefills (eager), the others decode (compiled, when the runner compiles)."""
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        rows = [RunnerRow(first_id + i, s, 1) for i, s in enumerate(seqs)]
        for s, logits in zip(seqs, runner.forward(rows)):
            s.append(int(logits[-1].argmax()))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


@torch.inference_mode()
def compiled_vs_eager(name: str, dtype: str, batches: list[int], attention: str, prompt_len: int,
                      max_tokens: int, repeats: int) -> dict:
    model = load_named(name, resolve_dtype(dtype))
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, min(model.config.vocab_size, 30000), (max(batches), prompt_len),
                            generator=gen).tolist()
    eager = ModelRunner(model, CPU, enforce_eager=True, max_num_seqs=2 * max(batches))
    start = time.perf_counter()
    compiled = ModelRunner(model, CPU, enforce_eager=False, max_num_seqs=2 * max(batches),
                           static_attention=attention, compile_batch_sizes=tuple(batches))
    result = {"model": name, "dtype": dtype, "attention": attention, "prompt_len": prompt_len,
              "startup_s": time.perf_counter() - start,
              "compile_s": compiled.compiled.stats.seconds, "rows": []}
    for B in batches:
        equal = greedy(eager, prompts[:B], max_tokens, 100) == greedy(compiled, prompts[:B], max_tokens, 100)
        for q in (1, 5):
            times = alternate(eager, compiled, prompts[:B], q, repeats)
            e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
            result["rows"].append({"B": B, "q": q, "eager_ms": e, "compiled_ms": c,
                                   "speedup": e / c, "greedy_equal": equal,
                                   "greedy_tokens": max_tokens})
    result.update(recompiles=compiled.compiled.stats.recompiles,
                  compiled_runs=compiled.compiled.stats.runs)
    return result


def alternate(eager, compiled, prompts, q: int, repeats: int) -> dict[str, list[float]]:
    """Forward ms of both runners, their calls alternating (drift hits both); the first call
    of each shape warms caches and is left out."""
    times = {"eager": [], "compiled": []}
    for r in range(repeats + 1):
        for path, runner in (("eager", eager), ("compiled", compiled)):
            ms = forward_ms(runner, prompts, q, r, first_id=200)
            if r:
                times[path].append(ms)
    return times


@cli.command()
@click.option("--models", default="smollm2:float32,qwen1.5b:bfloat16", show_default=True,
              help="model:dtype,... (tiny: a random 2-layer Llama; smollm2; qwen1.5b).")
@click.option("--batches", default="1,4", show_default=True)
@click.option("--attention", default="flex", show_default=True,
              help="Compiled attention backend(s), comma-separated: flex, sdpa-padded.")
@click.option("--prompt-len", default=128, show_default=True)
@click.option("--max-tokens", default=16, show_default=True, help="Greedy tokens compared.")
@click.option("--repeats", default=10, show_default=True)
@click.option("--out", default=str(RESULTS / "compiled_forwards.json"), show_default=True)
def compiled(models, batches, attention, prompt_len, max_tokens, repeats, out) -> None:
    """Compiled forwards against eager ones, same model, same run: decode (1 new token per
    row) and 5-token verify times at each batch, greedy tokens of both paths, compile time
    and recompilations. Prompts are --prompt-len seeded random ids. Exits 1 when the greedy
    tokens differ."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    results = [compiled_vs_eager(*m.split(":"), [int(b) for b in batches.split(",")], a,
                                 prompt_len, max_tokens, repeats)
               for m in models.split(",") for a in attention.split(",")]
    show(f"compiled vs eager forwards on CPU ({torch.get_num_threads()} threads, "
         f"{prompt_len}-token rows)",
         ("model", "attention", "B", "q", "eager ms", "compiled ms", "speed-up", "greedy equal",
          "compile s", "recompiles"),
         [(f"{res['model']} {res['dtype']}", res["attention"], row["B"], row["q"],
           f"{row['eager_ms']:.1f}", f"{row['compiled_ms']:.1f}", f"{row['speedup']:.2f}",
           "yes" if row["greedy_equal"] else "NO", f"{res['compile_s']:.0f}", res["recompiles"])
          for res in results for row in res["rows"]], width=150)
    save(out, results=results)
    sys.exit(0 if all(r["greedy_equal"] for res in results for r in res["rows"]) else 1)


# -- attention ---------------------------------------------------------------------------------

SHAPES = {  # name: (heads, kv heads, head dim, dtype)
    "smollm2-fp32": (9, 3, 64, torch.float32),
    "qwen1.5b-bf16": (12, 2, 128, torch.bfloat16),
    "tiny-fp32": (4, 2, 16, torch.float32),
}


def case(shape: str, B: int, q: int, context: int, pool_tokens: int, seed: int = 0):
    """(query [B*q, H, D], pool layer [2, Hkv, T, D], ragged batch, static rows, scale)."""
    H, Hkv, D, dtype = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, Hkv, pool_tokens, D, generator=gen).to(dtype)
    query = torch.randn(B * q, H, D, generator=gen).to(dtype)
    extent = pool_tokens // B // 16 * 16
    starts = [b * extent for b in range(B)]
    lens = [context + q] * B
    slots = torch.tensor([s + L - q + j for s, L in zip(starts, lens) for j in range(q)])
    batch = AttnBatch([b * q for b in range(B + 1)], starts, lens, slots, None)
    rows = StaticRows(torch.tensor(starts), torch.tensor(lens) - q, causal_new_mask(B, q, "cpu"),
                      slots, torch.arange(-(-(context + q) // 16) * 16))
    return query, kv, batch, rows, D ** -0.5


@torch.inference_mode()
def backends(shape: str, B: int, q: int, context: int, pool_tokens: int, repeats: int) -> list[dict]:
    """Every backend's ms (median of `repeats`), compile seconds and largest difference from
    per-row SDPA's output."""
    query, kv, batch, rows, scale = case(shape, B, q, context, pool_tokens)
    per_row = SdpaBackend()
    per_row.prepare(batch, query.shape[1] // kv.shape[1], query.device)
    want = per_row.attend(query, kv, batch, scale).float()
    padded = PaddedSdpaBackend()
    runs = {"per-row SDPA (eager)": (lambda: per_row.attend(query, kv, batch, scale), 0.0),
            "padded SDPA (eager)": (lambda: padded.attend(query, kv, rows, scale), 0.0)}
    for name, backend in (("padded SDPA (compiled)", padded), ("flex (compiled)", FlexBackend())):
        torch._dynamo.reset()
        fn = torch.compile(lambda qq, kk, rr, be=backend: be.attend(qq, kk, rr, scale), fullgraph=True)
        start = time.perf_counter()
        fn(query, kv, rows)
        runs[name] = (lambda fn=fn: fn(query, kv, rows), time.perf_counter() - start)
    out = [{"shape": shape, "B": B, "q": q, "context": context, "backend": name,
            "ms": median_s(fn, repeats) * 1000, "compile_s": compile_s,
            "max_abs_diff": (fn().float() - want).abs().max().item()}
           for name, (fn, compile_s) in runs.items()]
    return [{**row, "vs_per_row": row["ms"] / out[0]["ms"]} for row in out]


@cli.command()
@click.option("--shapes", default="smollm2-fp32,qwen1.5b-bf16", show_default=True)
@click.option("--batches", default="1,4", show_default=True)
@click.option("--queries", default="1,5", show_default=True)
@click.option("--context", default=512, show_default=True, help="Cached keys per row.")
@click.option("--pool-tokens", default=8192, show_default=True)
@click.option("--repeats", default=50, show_default=True)
@click.option("--small", is_flag=True, help="CI size: tiny shapes, one batch, short rows.")
@click.option("--out", default=str(RESULTS / "attention_backends.json"), show_default=True)
def attention(shapes, batches, queries, context, pool_tokens, repeats, small, out) -> None:
    """Attention over the KV pool, backend by backend: per-row SDPA (eager, on pool views),
    padded SDPA (eager and compiled) and FlexAttention (compiled), at decode and 5-token
    verify shapes. Each row has --context cached keys in its own extent of a --pool-tokens
    pool; every output is checked against per-row SDPA's; times are medians of one layer's
    attention (compile time apart)."""
    if small:
        shapes, batches, context, pool_tokens, repeats = "tiny-fp32", "2", 40, 512, 3
    torch.manual_seed(0)
    rows = [r for shape in shapes.split(",") for B in map(int, batches.split(","))
            for q in map(int, queries.split(","))
            for r in backends(shape, B, q, context, pool_tokens, repeats)]
    show(f"one layer's attention over the KV pool ({context} cached keys per row, "
         f"{torch.get_num_threads()} threads)",
         ("shape", "B", "q", "backend", "ms", "vs per-row", "compile s", "max |diff|"),
         [(r["shape"], r["B"], r["q"], r["backend"], f"{r['ms']:.3f}", f"{r['vs_per_row']:.2f}",
           f"{r['compile_s']:.1f}", f"{r['max_abs_diff']:.1e}") for r in rows], width=140)
    save(out, context=context, pool_tokens=pool_tokens, rows=rows)


# -- parts -------------------------------------------------------------------------------------

PARTS = ("q/k/v/o projections", "MLP matmuls (gate/up/down)", "attention over the KV pool",
         "norms + rotary + elementwise", "LM head", "sampling (argmax)")
PROJ, MLP, ATTN, ELEMENTWISE, HEAD, SAMPLING = PARTS
WARMUP = 3  # decode steps before the timed ones


class PartClock:
    """Seconds per part of the steps run while it is open, summed over layers: forward hooks
    on the model's modules, wrappers around the runner's attention backend and rotary
    function. The MLP block's own time less its matmuls (activation, product) counts as
    elementwise; embedding, residual adds and the runner's Python are left to the rest."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.seconds, self.undo = runner, defaultdict(float), []

    def __enter__(self) -> PartClock:
        fast = self.runner.fast
        for layer in fast.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                self.hook(module, PROJ)
            for module in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                self.hook(module, MLP)
            self.hook(mlp, "MLP block")
            self.hook(layer.input_layernorm, ELEMENTWISE)
            self.hook(layer.post_attention_layernorm, ELEMENTWISE)
        self.hook(fast.decoder.rotary_emb, ELEMENTWISE)
        self.hook(fast.decoder.norm, ELEMENTWISE)
        self.hook(fast.model.get_output_embeddings(), HEAD)
        self.wrap(self.runner.backend, "write", ATTN)
        self.wrap(self.runner.backend, "attend", ATTN)
        self.wrap(fast, "_rope", ELEMENTWISE)
        return self

    def __exit__(self, *exc) -> None:
        for undo in reversed(self.undo):
            undo()

    def hook(self, module, part: str) -> None:
        start = [0.0]

        def before(*_) -> None:
            start[0] = time.perf_counter()

        def after(*_) -> None:
            self.seconds[part] += time.perf_counter() - start[0]
        self.undo += [module.register_forward_pre_hook(before).remove,
                      module.register_forward_hook(after).remove]

    def wrap(self, owner, name: str, part: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
        setattr(owner, name, timed)
        self.undo.append(lambda: setattr(owner, name, fn))

    def take(self) -> dict[str, float]:
        """ms per part since the last take (the MLP block folded into elementwise)."""
        s, self.seconds = self.seconds, defaultdict(float)
        s[ELEMENTWISE] += s.pop("MLP block", 0.0) - s[MLP]
        return {part: 1000 * s[part] for part in PARTS}


def decode_step(runner: ModelRunner, seqs: list[list[int]], clock: PartClock | None) -> float:
    """One greedy step of every sequence (cache ids 0..B-1; each gains a token): ms, the
    argmax's share added to the clock."""
    start = time.perf_counter()
    logits = torch.cat(runner.forward([RunnerRow(i, s, 1) for i, s in enumerate(seqs)]))  # [B, V]
    sampled = time.perf_counter()
    tokens = logits.argmax(-1).tolist()  # [B]
    if clock:
        clock.seconds[SAMPLING] += time.perf_counter() - sampled
    for s, token in zip(seqs, tokens):
        s.append(token)
    return 1000 * (time.perf_counter() - start)


def step_parts(runner: ModelRunner, B: int, context: int, steps: int) -> dict:
    """B seeded random prompts of `context` tokens, prefilled, WARMUP steps, `steps` plain
    steps, then `steps` with the clock: medians of the step ms (both) and of each part."""
    gen = torch.Generator().manual_seed(B)
    seqs = torch.randint(0, min(runner.vocab_size, 30000), (B, context), generator=gen).tolist()
    for _ in range(1 + WARMUP):  # the prefill, then the warm-up
        decode_step(runner, seqs, None)
    plain = [decode_step(runner, seqs, None) for _ in range(steps)]
    hooked, parts = [], []
    with PartClock(runner) as clock:
        for _ in range(steps):
            hooked.append(decode_step(runner, seqs, clock))
            parts.append(clock.take())
    runner.release(list(range(B)))
    ms = {part: statistics.median(p[part] for p in parts) for part in PARTS}
    step = statistics.median(hooked)
    return {"batch": B, "step_ms": statistics.median(plain), "hooked_step_ms": step,
            "parts_ms": ms, "rest_ms": step - sum(ms.values())}


def read_gbps(gib: int = 2, repeats: int = 5) -> float:
    """GB/s of a `gib` GiB bfloat16 tensor's sum (a read of it), median of `repeats`."""
    t = torch.ones(gib << 29, dtype=torch.bfloat16)  # [gib GiB / 2 bytes]
    return t.nbytes / median_s(t.sum, repeats) / 1e9


SWEEP_TILES = (1, 2, 4, 8, 16)  # rows per call of the prepacked kernel
VERIFY_ROWS = 9  # a batch-1 verify at k = 8: ceil(9 / T) calls at tile T


def tiled(weight: torch.Tensor, tile: int) -> RowTiledLinear:
    """The services' row-invariant linear (invariant_ops) over `weight`, pinned to `tile`
    rows a call."""
    linear = RowTiledLinear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    linear.tile, linear.candidates = tile, ()
    return linear


def row_blocks(runner: ModelRunner) -> str:
    """The block sizes the runner's row-invariant linears use (after a forward), '/'-joined."""
    sizes = {m._plan[2] for m in runner.model.modules()
             if isinstance(m, RowTiledLinear) and m._plan is not None}
    return " | ".join("/".join(map(str, s)) for s in sorted(sizes)) or "?"


def tile_sweep(weights: list[torch.Tensor], repeats: int) -> list[dict]:
    """ms per matrix of x @ w.T over every layer's matrix in turn (cold from memory, as in a
    step): F.linear on the plain weights at M = 1, then RowTiledLinear (its weight packed
    once for tile T) on x of exactly T rows, for each T in SWEEP_TILES; with what VERIFY_ROWS
    rows cost in ceil(VERIFY_ROWS / T) calls, or why it could not pack."""
    K, dtype, n = weights[0].shape[1], weights[0].dtype, len(weights)
    x1 = torch.randn(1, K).to(dtype)  # [1, in]
    rows = [{"kernel": "F.linear", "tile": 1, "error": None, "verify_ms": None,
             "ms": median_s(lambda: [F.linear(x1, w) for w in weights], repeats) * 1000 / n}]
    for T in SWEEP_TILES:
        row = {"kernel": "oneDNN prepacked", "tile": T, "ms": None, "verify_ms": None,
               "error": None if packable(weights[0]) else "not packable on this CPU / dtype"}
        if row["error"] is None:
            x = torch.randn(T, K).to(dtype)  # [T, in]
            linears = [tiled(w, T) for w in weights]
            for linear in linears:  # packed once, as at a service's first forward
                linear(x)
            row["ms"] = median_s(lambda: [linear(x) for linear in linears], repeats) * 1000 / n
            row["verify_ms"] = math.ceil(VERIFY_ROWS / T) * row["ms"]
        rows.append(row)
    return rows


@cli.command()
@click.option("--model", "name", default="qwen", show_default=True,
              type=click.Choice(["qwen", "smollm2", "tiny"]),
              help="qwen (Qwen2.5-Coder 1.5B), smollm2 (SmolLM2-135M), tiny (random, seconds).")
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--batches", default="1,4", show_default=True)
@click.option("--context", default=64, show_default=True, help="Prompt tokens per sequence.")
@click.option("--steps", default=10, show_default=True, help="Timed decode steps per batch.")
@click.option("--deterministic", "mode", default="auto", show_default=True,
              type=click.Choice(["auto", "on", "off"]),
              help="As the services: auto is on (row-invariant, RowTiledLinear) in bfloat16 "
                   "and float16, off (plain nn.Linear, batch-dependent) in float32.")
@click.option("--out", default=str(RESULTS / "decode_parts.json"), show_default=True)
@torch.inference_mode()
def parts(name, dtype, batches, context, steps, mode, out) -> None:
    """Where one plain decode step's time goes (ModelRunner, eager, warm cache), part by
    part summed over layers, against the memory-bandwidth floor: the parameter bytes, which
    a step reads once, over a 2 GiB read's GB/s measured in the same run. Also the MLP's
    largest matrix (every layer's gate_proj in turn): F.linear at M = 1 against oneDNN's
    weights prepacked, T rows a call, T = 1..16 (what each of RowTiledLinear's blocks costs)."""
    model = load_named(name, resolve_dtype(dtype))
    runner = ModelRunner(model, CPU, max_num_seqs=max(map(int, batches.split(","))),
                         kv_cache_memory=256 << 20,
                         deterministic=resolve_deterministic(mode, dtype))
    gbps = read_gbps()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weights = [layer.mlp.gate_proj.weight for layer in runner.fast.layers]  # [inter, hidden]
    rows = []
    for B in map(int, batches.split(",")):
        row = {**step_parts(runner, B, context, steps), "floor_ms": param_bytes / gbps / 1e6}
        rows.append({**row, "fraction_of_limit": row["floor_ms"] / row["step_ms"]})
    numerics = (f"row-invariant, blocks of {row_blocks(runner)} rows" if runner.deterministic
                else "batch-dependent")  # as the steps above ran
    sweep = tile_sweep(weights, steps)
    limit = gbps * 1e9 / param_bytes
    show_parts(rows, f"{name} {dtype}, {numerics}", context, gbps, param_bytes, limit)
    show_sweep(sweep, weights)
    print("wrote", save(out, model=name, dtype=dtype, deterministic=mode,
                        row_invariant=runner.deterministic, numerics=numerics, context=context,
                        steps=steps, read_gbps=gbps, param_bytes=param_bytes,
                        limit_tokens_per_s=limit, rows=rows, tile_sweep=sweep))


def show_parts(rows: list[dict], what: str, context: int, gbps: float, param_bytes: int,
               limit: float) -> None:
    """The table: a part per line; per batch its ms and (parts) its share of the step."""
    def line(label: str, ms, share=None) -> tuple:
        """ms, share: functions of a row (share a fraction; None: left blank)."""
        return (label, *[c for r in rows for c in (
            fmt(ms(r)), fmt(100 * share(r), ".0f", "%") if share else "")])

    def part(label: str, ms) -> tuple:  # its share of the hooked step
        return line(label, ms, lambda r: ms(r) / r["hooked_step_ms"])
    body = [part(p, lambda r, p=p: r["parts_ms"][p]) for p in PARTS] + [
        part("the rest (Python, framework)", lambda r: r["rest_ms"]),
        part("step, hooks on (the sum)", lambda r: r["hooked_step_ms"]),
        line("step, hooks off", lambda r: r["step_ms"]),
        line("bandwidth floor (params / GB/s); reached", lambda r: r["floor_ms"],
             lambda r: r["fraction_of_limit"])]
    b1 = rows[0]
    show(f"one decode step, by part ({what}, CPU {torch.get_num_threads()} threads, "
         f"{context}-token context; medians)",
         ("part", *[c for r in rows for c in (f"B={r['batch']} ms", "share")]), body,
         caption=f"{cpu_model()}: read {gbps:.1f} GB/s (2 GiB bf16 sum, median of 5); "
                 f"parameters {param_bytes / 1e9:.2f} GB; limit {limit:.1f} tok/s at B=1; "
                 f"reached {b1['batch'] * 1000 / b1['step_ms']:.1f} tok/s at B={b1['batch']}")


def show_sweep(sweep: list[dict], weights: list[torch.Tensor]) -> None:
    """The tile sweep: a kernel and tile per line, ms per matrix, against prepacked T=1, and
    what VERIFY_ROWS rows cost at that tile."""
    one = next(r["ms"] for r in sweep if r["kernel"] != "F.linear")
    nbytes = weights[0].nbytes
    body = [(f"{r['kernel']}, {'M' if r['kernel'] == 'F.linear' else 'T'}={r['tile']}",
             fmt(r["ms"], ".3f"), fmt(r["ms"] and nbytes / r["ms"] / 1e6, ".1f"),
             ratio(r["ms"] and one and r["ms"] / one), fmt(r["verify_ms"], ".3f"))
            for r in sweep]
    errors = "; ".join(f"T={r['tile']}: {r['error']}" for r in sweep if r["error"])
    show(f"MLP gate_proj {list(weights[0].shape)} {str(weights[0].dtype)[6:]}, each of the "
         f"{len(weights)} layers' in turn (cold from memory): ms per matrix",
         ("kernel, rows per call", "ms", "GB/s", "vs T=1",
          f"{VERIFY_ROWS} rows: ceil({VERIFY_ROWS}/T) x ms"), body,
         caption=f"RowTiledLinear runs every matmul as oneDNN prepacked on blocks of "
                 f"{ROW_TILE} rows or of those of {SMALL_TILES} giving the same bits; "
                 "F.linear re-lays out the plain weight on every call"
                 + (f"; not packed: {errors}" if errors else ""))


if __name__ == "__main__":
    cli()
