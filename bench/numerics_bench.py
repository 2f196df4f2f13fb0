"""Numerics: which operators make a row's numbers depend on its batch, what the deterministic
mode (`--deterministic on`) costs a forward, and whether the stack's greedy outputs then equal
the target-only batch-1 output (docs/benchmarks.md, *Invariant numerics*).

    python bench/numerics_bench.py probes [--model smollm2|qwen|tiny] [--dtypes bfloat16,float32]
    OMP_NUM_THREADS=1 python bench/numerics_bench.py costs --model smollm2 --dtype bfloat16 --clock cpu
    python bench/numerics_bench.py deterministic [--pair qwen|tiny] [--modes on,off]

Each subcommand prints one table and writes JSON under bench/results/; `--model tiny --quick`
and `--pair tiny` run them in seconds to a minute.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the root: bench.harness
from bench.harness import (CPU, PROMPTS, load_named, pair_dirs, save, show,  # noqa: E402
                           stack_config, stack_generate)
from specdecode.executor.attention import AttnBatch, InvariantSdpaBackend, SdpaBackend  # noqa: E402
from specdecode.executor.invariant_ops import ROW_TILE, RowTiledLinear, make_row_invariant  # noqa: E402
from specdecode.executor.model_runner import ModelRunner, RunnerRow  # noqa: E402
from specdecode_stack.local import LocalStack  # noqa: E402

ROWS, QUICK_ROWS = (2, 4, 8, 9, 16, 17, 33, 64, 256), (2, 9, 17)  # batch sizes an operator is probed at
VERIFY_K = (1, 4, 8)
BATCHES = (2, 4, 8)
MODEL = click.option("--model", "model_name", default="smollm2", show_default=True,
                     type=click.Choice(["smollm2", "qwen", "tiny"]))


@click.group()
def cli() -> None:
    """Numerics, one question per subcommand."""


# -- probes ------------------------------------------------------------------------------------


@dataclass
class Probe:
    kind: str  # "operator" or "forward"
    name: str  # what is probed
    context: str  # what the row shares its call with
    dtype: str
    deterministic: bool
    rows: int  # rows compared
    differ: int  # rows whose bits differ from the row alone
    max_abs: float  # the largest |difference|

    @property
    def cell(self) -> str:
        return "=" if not self.differ else f"{self.differ}/{self.rows} ({self.max_abs:.2g})"


def compare(got: torch.Tensor, alone: torch.Tensor) -> tuple[int, int, float]:
    """(rows, rows that differ, max |difference|) of two [rows, ...] tensors."""
    diff = (got.float() - alone.float()).abs().flatten(1)
    bits = (got != alone).flatten(1).any(1)
    return len(got), int(bits.sum()), float(diff.max()) if diff.numel() else 0.0


def rowwise_probes(fn, width: int, dtype, rows: tuple[int, ...]) -> list[tuple[str, int, int, float]]:
    """fn on [M, width] rows: each M of `rows` against every row computed alone."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max(rows), width, generator=gen).to(dtype)
    alone = torch.cat([fn(x[i:i + 1]) for i in range(len(x))])
    return [(f"{M} rows", *compare(fn(x[:M]), alone[:M])) for M in rows]


def attention_probes(backend, kv_heads: int, groups: int, head_dim: int, dtype,
                     length: int = 40) -> list[tuple[str, int, int, float]]:
    """One sequence of `length` keys in a one-layer pool: its queries in a k+1 verify and in a
    whole prefill against a one-token decode at each position."""
    gen = torch.Generator().manual_seed(0)
    kv = backend.allocate(1, kv_heads, 64, head_dim, dtype, CPU)[0]  # [2, kv_heads, 64, D]
    kv[:, :, :length] = torch.randn(2, kv_heads, length, head_dim, generator=gen).to(dtype)
    q = torch.randn(length, kv_heads * groups, head_dim, generator=gen).to(dtype)  # [L, H, D]

    def attend(first: int, last: int) -> torch.Tensor:  # queries first..last-1 over last keys
        batch = AttnBatch([0, last - first], [0], [last], torch.zeros(0, dtype=torch.long), None)
        backend.prepare(batch, groups, CPU)
        return backend.attend(q[first:last], kv, batch, head_dim ** -0.5)

    alone = torch.cat([attend(p, p + 1) for p in range(length)])  # [L, H*D]
    out = [(f"verify k+1={k + 1}", *compare(attend(length - k - 1, length), alone[length - k - 1:]))
           for k in VERIFY_K]
    return out + [("whole prefill", *compare(attend(0, length), alone))]


def layer_operators(model) -> list[tuple[str, object, int]]:
    """(name, fn, input width) of layer 0's linears, the LM head, RMSNorm, SiLU x up and the
    sampler's log_softmax."""
    layer, config = model.model.layers[0], model.config
    found = [(f"linear {name} {m.in_features}x{m.out_features}", m, m.in_features)
             for name, m in [(n, getattr(layer.self_attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
             + [(n, getattr(layer.mlp, n)) for n in ("gate_proj", "up_proj", "down_proj")]]
    head, inter = model.get_output_embeddings(), config.intermediate_size
    return found + [
        (f"LM head {head.in_features}x{head.out_features}", head, head.in_features),
        ("RMSNorm", layer.input_layernorm, config.hidden_size),
        ("SiLU(gate) x up", lambda x: layer.mlp.act_fn(x[:, :inter]) * x[:, inter:], 2 * inter),
        ("log_softmax (sampler, float32)", lambda x: torch.log_softmax(x.float(), -1), config.vocab_size)]


@torch.inference_mode()
def operator_probes(model, dtype, deterministic: bool, rows: tuple[int, ...]) -> list[Probe]:
    if deterministic:  # its linears become RowTiledLinears (off runs first)
        make_row_invariant(model)
    results = [(name, *r) for name, fn, width in layer_operators(model)
               for r in rowwise_probes(fn, width, dtype, rows)]
    rope, positions = model.model.rotary_emb, torch.arange(max(rows))
    cos_sin = lambda p: torch.cat(rope(torch.zeros(1, dtype=dtype), p[None]), -1)[0]  # noqa: E731
    alone = torch.cat([cos_sin(positions[i:i + 1]) for i in range(len(positions))])
    results += [("rotary cos/sin", f"{M} positions", *compare(cos_sin(positions[:M]), alone[:M]))
                for M in rows]
    backend, config = InvariantSdpaBackend() if deterministic else SdpaBackend(), model.config
    kv_heads = config.num_key_value_heads
    results += [(f"attention ({backend.name})", *r) for r in attention_probes(
        backend, kv_heads, config.num_attention_heads // kv_heads,
        model.model.layers[0].self_attn.head_dim, dtype)]
    return [Probe("operator", n, c, str(dtype).removeprefix("torch."), deterministic, *r)
            for n, c, *r in results]


class ForwardProbe:
    """One token sequence decoded alone (the reference) and in the contexts below."""

    def __init__(self, model, deterministic: bool, prompt: int = 24, decode: int = 12):
        self.model, self.deterministic = model, deterministic
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        self.seq = torch.randint(vocab, (prompt + decode,), generator=gen).tolist()
        self.others = [torch.randint(vocab, (n,), generator=gen).tolist()
                       for n in (7, 31, 18, 45, 12, 26, 39)]  # batch mates, other lengths
        self.P = prompt
        self.ref_runner = self.runner()
        self.ref = self.history(self.ref_runner, len(self.seq))  # {position: logits [V]}

    def runner(self) -> ModelRunner:
        return ModelRunner(self.model, CPU, max_model_len=256, max_num_seqs=16,
                           deterministic=self.deterministic)

    def history(self, runner: ModelRunner, upto: int) -> dict[int, torch.Tensor]:
        """Prefill the prompt, then decode one token per forward until `upto` tokens are
        cached; the logits of every position from the prompt's last on."""
        out = {self.P - 1: runner.forward([RunnerRow(0, self.seq[:self.P], 1)])[0][0]}
        for n in range(self.P + 1, upto + 1):
            out[n - 1] = runner.forward([RunnerRow(0, self.seq[:n], 1)])[0][0]
        return out

    def against(self, logits: torch.Tensor, first: int) -> tuple[int, int, float]:
        """Logits [n, V] of positions first.. against the reference's."""
        return compare(logits, torch.stack([self.ref[first + i] for i in range(len(logits))]))

    def kv_against(self, runner: ModelRunner) -> tuple[int, int, float]:
        """The sequence's keys/values in `runner`'s pool against the reference's, per token."""
        def tokens(r: ModelRunner) -> torch.Tensor:
            kv = r.pool.kv.narrow(r.pool.token_dim, r.pool.get(0).start, len(self.seq) - 1)
            return kv.movedim(r.pool.token_dim, 0)  # [tokens, ...]
        return compare(tokens(runner), tokens(self.ref_runner))

    def batched_decode(self, B: int) -> tuple[int, int, float]:
        r = self.runner()
        self.history(r, len(self.seq) - 1)
        mates = self.others[:B - 1]
        for i, m in enumerate(mates, 1):
            r.forward([RunnerRow(i, m[:-1], 1)])
        rows = [RunnerRow(0, self.seq, 1)] + [RunnerRow(i, m, 1) for i, m in enumerate(mates, 1)]
        return self.against(r.forward(rows)[0], len(self.seq) - 1)

    def verify(self, k: int, expanded: bool, mates: int = 0) -> tuple[int, int, float]:
        r = self.runner()
        first = len(self.seq) - k - 1  # the first position scored
        self.history(r, first)
        for i, m in enumerate(self.others[:mates], 1):
            r.forward([RunnerRow(i, m[:-k - 1], 1)])
        if expanded:  # batch expansion: k+1 rows on one cache entry, one query each
            rows = [RunnerRow(0, self.seq[:first + j + 1], 1) for j in range(k + 1)]
            return self.against(torch.cat(r.forward(rows)), first)
        rows = [RunnerRow(0, self.seq, k + 1)] + [RunnerRow(i, m, k + 1)
                                                 for i, m in enumerate(self.others[:mates], 1)]
        return self.against(r.forward(rows)[0], first)

    def chunked(self, chunk: int | None) -> list[tuple[str, int, int, float]]:
        """The sequence computed from nothing in chunks of `chunk` tokens (None: whole, in
        one forward): the logits of positions P-1.. and the pool's keys/values."""
        r = self.runner()
        L, chunk = len(self.seq), chunk or len(self.seq)
        logits = {}
        for start in range(0, L, chunk):
            end = min(L, start + chunk)
            out = r.forward([RunnerRow(0, self.seq[:end], end - start)])[0]
            logits.update({start + i: row for i, row in enumerate(out)})
        what = f"prefill in chunks of {chunk}" if chunk < L else "recomputed whole (a replica)"
        got = torch.stack([logits[p] for p in range(self.P - 1, L)])
        return [(f"logits, {what}", *self.against(got, self.P - 1)),
                (f"keys/values, {what}", *self.kv_against(r))]

    def probes(self, dtype) -> list[Probe]:
        results = [(f"decode in a batch of {B}", *self.batched_decode(B)) for B in BATCHES]
        results += [(f"multi-query verify k={k}", *self.verify(k, False)) for k in VERIFY_K]
        results.append(("multi-query verify k=4, 4 rows", *self.verify(4, False, mates=3)))
        results += [(f"batch expansion k={k}", *self.verify(k, True)) for k in VERIFY_K]
        for chunk in (5, 16, None):
            results += self.chunked(chunk)
        return [Probe("forward", "target forward", c, str(dtype).removeprefix("torch."),
                      self.deterministic, *r) for c, *r in results]


@cli.command()
@MODEL
@click.option("--dtypes", default="bfloat16,float32", show_default=True)
@click.option("--quick", is_flag=True, help="Probe fewer batch sizes (a CI-sized run).")
@click.option("--out", default=None, help="JSON path [bench/results/invariance_<model>.json].")
def probes(model_name, dtypes, quick, out) -> None:
    """Which operators make a row's numbers depend on its batch, per dtype, the mode off and
    on. Operators (layer 0, random inputs at the model's shapes): every linear and the LM
    head, RMSNorm, SiLU x up, the rotary embedding, attention over the KV pool, the sampler's
    log_softmax: a row alone against the same row among M rows (attention: a query of a k+1
    verify or of a whole prefill against the one-token decode at its position). Forwards
    (ModelRunner, one token sequence; the reference: alone at batch 1, prefilled then decoded
    a token per forward): its decode in a batch of 2, 4, 8 beside other lengths; its last k+1
    positions as one multi-query verify; as batch expansion's k+1 rows; its prompt prefilled
    in chunks (logits and pool keys/values); recomputed whole on a fresh runner. A cell reads
    `=` when every row is equal bit for bit, else `n/m` rows differ and the largest gap."""
    found = []
    for dtype in (getattr(torch, d) for d in dtypes.split(",")):
        model = load_named(model_name, dtype)
        for deterministic in (False, True):  # on converts the model's linears: off first
            found += operator_probes(model, dtype, deterministic, QUICK_ROWS if quick else ROWS)
            found += ForwardProbe(model, deterministic).probes(dtype)
    cols = sorted({(p.dtype, p.deterministic) for p in found})
    cells: dict[tuple[str, str], dict] = {}
    for p in found:
        name = p.name.replace(" (sdpa-invariant)", " (sdpa)")
        cells.setdefault((name, p.context), {})[(p.dtype, p.deterministic)] = p.cell
    show(f"Row invariance, {model_name}, CPU, {torch.get_num_threads()} threads: rows that "
         "differ from the row alone",
         ("operator / forward", "context", *(f"{d} {'on' if m else 'off'}" for d, m in cols)),
         [(name, context, *(by.get(c, "") for c in cols)) for (name, context), by in cells.items()])
    save(out or f"bench/results/invariance_{model_name}.json", probes=[asdict(p) for p in found])


# -- costs -------------------------------------------------------------------------------------

FORWARDS = {  # what a cost is measured on: rows x new tokens per row, on a warm cache
    "decode 1 row": (1, 1), "decode 8 rows": (8, 1), "verify 1 row x 9": (1, 9),
    "verify 4 rows x 5": (4, 5), "verify 8 rows x 9": (8, 9), "prefill 64": (1, 64),
    "prefill 512": (1, 512)}
QUICK_FORWARDS = ("decode 1 row", "verify 1 row x 9")
FIXES = ("off", "linears tiled", "attention per query", "on")  # which fix is applied


def fix_runners(model) -> dict[str, ModelRunner]:
    """A runner per fix: neither (off), one, or both (on). The tiled ones run a converted
    copy of the model, so that all four time the same forward side by side."""
    tiled = copy.deepcopy(model)

    def runner(m, attention_fix: bool, deterministic: bool) -> ModelRunner:
        backend = InvariantSdpaBackend() if attention_fix else SdpaBackend()
        return ModelRunner(m, CPU, max_model_len=1024, max_num_seqs=16, backend=backend,
                           deterministic=deterministic)
    return {"off": runner(model, False, False), "linears tiled": runner(tiled, False, True),
            "attention per query": runner(model, True, False), "on": runner(tiled, True, True)}


def fix_costs(runners, rows: int, tokens: int, repeats: int, clock) -> dict[str, float]:
    """One forward's median ms per fix, the fixes' forwards interleaved (a loaded machine's
    drift falls on all)."""
    gen = torch.Generator().manual_seed(0)
    vocab = runners["off"].vocab_size
    prefixes = [torch.randint(vocab, (32,), generator=gen).tolist() for _ in range(rows)]
    batch = [RunnerRow(i, p + torch.randint(vocab, (tokens,), generator=gen).tolist(), tokens)
             for i, p in enumerate(prefixes)]
    for r in runners.values():  # 32 cached tokens per row, and a warm-up
        r.forward([RunnerRow(i, p, 1) for i, p in enumerate(prefixes)])
        r.forward(batch)
    times: dict[str, list[float]] = {fix: [] for fix in FIXES}
    for _ in range(repeats):
        for fix in FIXES:
            start = clock()
            runners[fix].forward(batch)
            times[fix].append(clock() - start)
    return {fix: 1e3 * statistics.median(t) for fix, t in times.items()}


@cli.command()
@MODEL
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--tile", default=None, type=int,
              help="Pin every matmul call of the tiled linears to this many rows [the "
                   f"services' choice: {ROW_TILE} rows, or fewer where they give its bits].")
@click.option("--repeats", default=5, show_default=True, help="Timed forwards per cell.")
@click.option("--clock", default="wall", type=click.Choice(["wall", "cpu"]), show_default=True,
              help="cpu: the process's CPU time per forward (a loaded machine; with "
                   "OMP_NUM_THREADS=1 it is what the forward costs).")
@click.option("--quick", is_flag=True, help="Two forwards (a CI-sized run).")
@click.option("--out", default=None, help="JSON path [bench/results/invariance_costs_<model>.json].")
def costs(model_name, dtype, tile, repeats, clock, quick, out) -> None:
    """What each of the mode's fixes costs a forward (ms, median of --repeats): off, the
    linears tiled (RowTiledLinear), attention per query, both (on)."""
    if tile is not None:
        RowTiledLinear.tile, RowTiledLinear.candidates = tile, ()
    runners = fix_runners(load_named(model_name, getattr(torch, dtype)))
    clock_fn = time.process_time if clock == "cpu" else time.perf_counter
    rows = []
    for name in QUICK_FORWARDS if quick else FORWARDS:
        ms = fix_costs(runners, *FORWARDS[name], repeats, clock_fn)
        rows += [{"fix": fix, "tile": tile, "forward": name, "ms": v} for fix, v in ms.items()]
        print(json.dumps(rows[-4:]), flush=True)
    by = {(r["forward"], r["fix"]): r["ms"] for r in rows}
    show(f"Forward cost of each fix, {model_name} {dtype}, CPU, {torch.get_num_threads()} threads, "
         f"{clock} ms, tile {tile or 'auto'} (median of {repeats})", ("forward", *(f"{fix} ms" for fix in FIXES)),
         [(name, *(f"{by[(name, f)]:.1f}" + ("" if f == "off" else f" ({by[(name, f)] / by[(name, 'off')]:.2f}x)")
                   for f in FIXES)) for name in dict.fromkeys(r["forward"] for r in rows)])
    save(out or f"bench/results/invariance_costs_{model_name}.json", costs=rows)


# -- deterministic -----------------------------------------------------------------------------


def mode_rows(target_dir, draft_dir, dtype: str, scoring: str, mode: str,
              prompts: list[list[int]], max_tokens: int, streams: list[int]) -> list[dict]:
    """Rows (path, streams, tokens/s, outputs) of one stack, its reference first: its own
    target-only output at batch 1 (num_speculative_tokens=0)."""
    rows = []
    with LocalStack(stack_config(target_dir, draft_dir, dtype, scoring=scoring,
                                 deterministic=mode)) as stack:
        for path, k, n in [("target-only", 0, 1), ("defaults", None, 1),
                           *((p, k, n) for n in streams if n > 1
                             for p, k in (("defaults", None), ("k=0", 0)))]:
            outs, wall, _ = stack_generate(stack, prompts, max_tokens, k, n)
            seconds = wall if n > 1 else sum(o.seconds for o in outs)
            draft = sum(o.draft for o in outs)
            rows.append({"mode": mode, "scoring": scoring, "path": path, "streams": n,
                         "tokens": sum(o.tokens for o in outs), "seconds": seconds,
                         "tokens_per_s": sum(o.tokens for o in outs) / seconds,
                         "acceptance": sum(o.accepted for o in outs) / draft if draft else None,
                         "outputs": [o.token_ids for o in outs]})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "outputs"}), flush=True)
    for row in rows:
        row["equal"] = sum(o == r for o, r in zip(row["outputs"], rows[0]["outputs"]))
    return rows


@cli.command()
@click.option("--pair", default="qwen", type=click.Choice(["qwen", "tiny"]), show_default=True,
              help="tiny: random test models, to check this bench in seconds.")
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--modes", default="on,off", show_default=True)
@click.option("--scorings", default="multi-query,batch-expansion", show_default=True)
@click.option("--streams", default="1,4,8", show_default=True)
@click.option("--classes", default=",".join(PROMPTS), show_default=True)
@click.option("--per-class", default=2, show_default=True, help="Prompts per class.")
@click.option("--max-tokens", default=48, show_default=True)
@click.option("--results", default="bench/results", show_default=True,
              type=click.Path(path_type=Path))
def deterministic(pair, dtype, modes, scorings, streams, classes, per_class, max_tokens, results) -> None:
    """The mode through the stack: is every greedy output the target-only batch-1 output, and
    what does it cost? Per mode and scoring method one stack (the defaults otherwise): its
    target-only output at batch 1 (the reference), the defaults alone, and the defaults and
    k=0 with --streams in flight. Columns: tokens/s (batch 1: all tokens over the time of
    the prompts one after the other; streams: over the wall time), prompts equal to the
    reference, acceptance, on/off. Modes alternate per scoring method (drift falls on both)."""
    target_dir, draft_dir, encode = pair_dirs(pair)
    prompts = [encode(p) for c in classes.split(",") for p in PROMPTS[c][:per_class]]
    start, rows = time.perf_counter(), []
    for i, scoring in enumerate(scorings.split(",")):
        order = modes.split(",")
        for mode in order if i % 2 == 0 else order[::-1]:
            rows += mode_rows(target_dir, draft_dir, dtype, scoring, mode, prompts, max_tokens,
                              [int(s) for s in streams.split(",")])
    by = {(r["scoring"], r["path"], r["streams"], r["mode"]): r for r in rows}
    off = lambda r: by.get((r["scoring"], r["path"], r["streams"], "off"))  # noqa: E731
    show(f"{pair} {dtype}, {len(prompts)} prompts x {max_tokens} tokens, one run of "
         f"{(time.perf_counter() - start) / 60:.1f} min",
         ("scoring", "path", "streams", "mode", "tokens/s", "on/off",
          f"equal to target-only b1 (of {len(prompts)})", "acceptance"),
         [(r["scoring"], r["path"], r["streams"], r["mode"], f"{r['tokens_per_s']:.2f}",
           f"{r['tokens_per_s'] / off(r)['tokens_per_s']:.2f}x" if off(r) and r["mode"] == "on" else "",
           r["equal"], "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}") for r in rows], width=150)
    save(results / f"deterministic_{pair}_{dtype}.json", rows=rows)


if __name__ == "__main__":
    cli()
