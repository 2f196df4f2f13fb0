"""PNG plots of benchmark results (matplotlib, the `bench` extra): what docs/benchmarks.md
shows. Each function takes the rows a benchmark wrote to its JSON and one output path."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

PHASES = ("propose", "score", "verify", "overhead")


def _save(fig, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def speedup_by_k(rows: list[dict], model: str, path: str | Path) -> None:
    """Speed-up over target-only against k, one line per scoring method and batch size."""
    rows = [r for r in rows if r["model"] == model and r["mode"] != "target-only"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in sorted({r["mode"] for r in rows}):
        for batch in sorted({r["batch"] for r in rows}):
            line = sorted((r["k"], r["speedup"]) for r in rows
                          if r["mode"] == mode and r["batch"] == batch)
            ax.plot(*zip(*line), marker="o", label=f"{mode}, batch {batch}")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set(xlabel="k (draft tokens per step)", ylabel="speed-up over target-only",
           title=f"{model}: decode speed-up")
    ax.legend(fontsize=8)
    _save(fig, path)


def acceptance_by_position(rows: list[dict], model: str, path: str | Path) -> None:
    """Fraction of speculating sequence-steps that emitted draft position j, per k, at the
    largest batch (the most prompts, the most sequence-steps)."""
    rows = [r for r in rows if r["model"] == model and r["k"] and r["mode"] == "multi-query"]
    batch = max((r["batch"] for r in rows), default=1)
    rows = [r for r in rows if r["batch"] == batch]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in sorted(rows, key=lambda r: r["k"]):
        rates = [n / r["spec_sequences"] if r["spec_sequences"] else 0.0
                 for n in r["accepted_by_position"]]
        ax.plot(range(len(rates)), rates, marker="o", label=f"k={r['k']}")
    ax.set(xlabel="draft position", ylabel="accepted (fraction of sequence-steps)", ylim=(0, 1),
           title=f"{model}: acceptance by draft position, batch {batch}")
    ax.legend(fontsize=8)
    _save(fig, path)


def step_time_split(rows: list[dict], model: str, path: str | Path) -> None:
    """Mean step time split into propose / score / verify / overhead, per configuration."""
    rows = [r for r in rows if r["model"] == model]
    labels = [f"{r['mode']}\nk={r['k']} B={r['batch']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.7), 4))
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        ms = [r["step_ms"][phase] for r in rows]
        ax.bar(range(len(rows)), ms, bottom=bottom, label=phase)
        bottom = [b + m for b, m in zip(bottom, ms)]
    ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=90)
    ax.set(ylabel="ms per step (mean)", title=f"{model}: step time split")
    ax.legend(fontsize=8)
    _save(fig, path)
