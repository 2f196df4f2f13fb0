"""Structured output under speculation: JSON-schema extraction prompts at batch 1, target
alone (k=0) against the draft speculating (docs/benchmarks.md, Structured output).

    python bench/structured_bench.py [--pair qwen|tiny] [--dtype bfloat16] [--ks 4,8]
                                     [--max-tokens 200] [--repeats 2]

In-process engines (specdecode_stack.inprocess), the draft's head pruned to its 32,768 most
frequent tokens as the stack's default is: fixed k with multi-query scoring, and (`--defaults`)
a second pair of models under the stack's defaults (adaptive k <= 8, auto scoring, the draft's
early stop at confidence 0.4) against its own k=0 (issue 36's must-show). Every run has the
grammar's jump-forward (forced tokens appended with no forward): the comparison is
speculation alone. Per path: tokens/s (median over repeats, each prompt one request), the ratio
to k=0 in the same repeat, acceptance (accepted / draft tokens), the share of tokens the
grammar forced, the grammar's cost per emitted token (the target's, the draft's and the
engine's matcher work: syncs and masks) and per mask, whether every output is valid against
its schema, and the tokens equal to k=0's (bf16 kernels for 1 and k+1 query tokens can flip
near-ties). JSON lands in bench/results/structured_<pair>_<dtype>.json.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

import click
import jsonschema
import torch
from rich.console import Console
from rich.table import Table

from orchestrator.engine.request import Request
from specdecode.grammar.spec import StructuredOutput
from specdecode.models.model_packages import fetch
from specdecode.models.checkpoints import load_model, load_tokenizer, resolve_model_dir
from specdecode.sequence import SamplingParams
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model, byte_tokenizer
from specdecode_stack.inprocess import build_inprocess_engine

DEFAULT_K = 8  # the stack's --num-speculative-tokens default: the most its policy picks
S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(required: list[str], **props) -> dict:
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


TASKS = [
    ("Maria Garcia, 34, is a software engineer in Madrid; write to maria.garcia@example.com.",
     obj(["name", "age", "occupation", "city", "email"], name=S, age=I, occupation=S, city=S,
         email=S)),
    ("Order 4521: two USB-C cables at 9.99 each and one laptop stand at 34.50, shipped to "
     "Berlin, paid by card.",
     obj(["order_id", "items", "city", "payment"], order_id=I, city=S,
         items={"type": "array", "items": obj(["name", "quantity", "unit_price"], name=S,
                                              quantity=I, unit_price=N)},
         payment={"enum": ["card", "cash", "transfer"]})),
    ("The PyData meetup is on 2024-05-17 at 18:30 in room 4B, with 45 attendees; topics: "
     "pandas, polars and DuckDB.",
     obj(["title", "date", "time", "room", "attendees", "topics"], title=S, date=S, time=S,
         room=S, attendees=I, topics={"type": "array", "items": S})),
    ("Review of the Aero 15 laptop: 4 stars. Great screen and battery, but loud fans and a "
     "heavy charger. I would buy it again.",
     obj(["product", "rating", "pros", "cons", "recommend"], product=S,
         rating={"type": "integer", "minimum": 1, "maximum": 5}, recommend=B,
         pros={"type": "array", "items": S}, cons={"type": "array", "items": S})),
    ("Flight LH 1234 of Lufthansa leaves Frankfurt for Lisbon at 07:45; 3 seats booked, "
     "window preferred.",
     obj(["airline", "flight", "from", "to", "departure", "seats", "window"], airline=S,
         flight=S, departure=S, seats=I, window=B, **{"from": S, "to": S})),
]


def load_pair(pair: str, dtype: torch.dtype):
    """(target, draft, tokenizer, draft dir for the head's frequency ranks, prompts)."""
    if pair == "tiny":
        tok = byte_tokenizer()
        spec = TinyModelSpec(seed=1, vocab_size=len(tok), max_position_embeddings=2048)
        target = build_tiny_model(spec)
        draft = build_tiny_model(dataclasses.replace(spec, seed=2, num_layers=1))
        prompts = [list(f"Extract JSON: {text}\n".encode()) for text, _ in TASKS]
        return target, draft, tok, None, prompts
    draft_dir = resolve_model_dir(fetch("qwen2.5-coder-0.5b"))
    target_dir = resolve_model_dir(fetch("qwen2.5-coder-1.5b"))
    tok = load_tokenizer(target_dir)
    prompts = [tok(tok.apply_chat_template(
        [{"role": "user", "content": f"Extract the details as JSON: {text}"}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
        for text, _ in TASKS]
    return (load_model(target_dir, torch.device("cpu"), dtype),
            load_model(draft_dir, torch.device("cpu"), dtype), tok, draft_dir, prompts)


def grammar_seconds(engine) -> tuple[float, int]:
    """Matcher work so far (target, draft, engine): seconds, masks."""
    parts = [engine.scorer.worker.grammars, engine.proposer.worker.grammars, engine.grammars]
    return (sum(g.stats.seconds for g in parts), sum(g.stats.masks for g in parts))


def run_once(engine, prompts, max_tokens: int, k: int, eos: int) -> dict:
    """Each prompt alone (batch 1); totals over the set."""
    out = {"tokens": 0, "seconds": 0.0, "draft": 0, "accepted": 0, "forced": 0,
           "outputs": [], "grammar_s": 0.0, "masks": 0}
    for i, (prompt, (_, schema)) in enumerate(zip(prompts, TASKS)):
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=(eos,),
                                structured_output=StructuredOutput("json_schema",
                                                                   json.dumps(schema)))
        forced, (g_s, g_n) = engine.grammars.stats.forced, grammar_seconds(engine)
        start = time.perf_counter()
        seq = engine.generate([Request(str(i), list(prompt), params, k)])[str(i)]
        out["seconds"] += time.perf_counter() - start
        out["tokens"] += len(seq.output_token_ids)
        out["draft"] += seq.stats.draft_tokens
        out["accepted"] += seq.stats.accepted_tokens
        out["forced"] += engine.grammars.stats.forced - forced
        g_s2, g_n2 = grammar_seconds(engine)
        out["grammar_s"] += g_s2 - g_s
        out["masks"] += g_n2 - g_n
        out["outputs"].append(seq.output_token_ids)
    return out


def valid(tok, outputs: list[list[int]], eos: int) -> int:
    ok = 0
    for ids, (_, schema) in zip(outputs, TASKS):
        if ids and ids[-1] == eos:
            try:
                jsonschema.validate(json.loads(tok.decode(ids[:-1])), schema)
                ok += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    return ok


@click.command()
@click.option("--pair", default="qwen", type=click.Choice(["qwen", "tiny"]), show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--ks", default="4,8", show_default=True, help="Speculation lengths to compare.")
@click.option("--max-tokens", default=200, show_default=True)
@click.option("--repeats", default=2, show_default=True)
@click.option("--draft-vocab", default=32768, show_default=True)
@click.option("--defaults/--no-defaults", default=True, show_default=True,
              help="Also the stack's defaults (adaptive k) against their own k=0.")
@click.option("--out", default=None, help="[bench/results/structured_<pair>_<dtype>.json]")
def main(pair, dtype, ks, max_tokens, repeats, draft_vocab, defaults, out) -> None:
    target, draft, tok, draft_dir, prompts = load_pair(pair, getattr(torch, dtype))
    ks = [0, *map(int, ks.split(","))]
    fixed = build_inprocess_engine(target, draft, "multi-query", max(ks), tokenizer=tok,
                                   draft_vocab_size=draft_vocab, draft_dir=draft_dir)
    paths = {k: (fixed, k) for k in ks}  # path -> (engine, the request's k)
    if defaults:  # its own models: the pruned head replaced the other draft's
        target, draft, *_ = load_pair(pair, getattr(torch, dtype))
        engine = build_inprocess_engine(target, draft, "auto", DEFAULT_K, tokenizer=tok,
                                        adaptive=True, draft_vocab_size=draft_vocab,
                                        draft_dir=draft_dir, draft_confidence=0.4,
                                        deterministic=dtype in ("bfloat16", "float16"))
        paths |= {"defaults": (engine, DEFAULT_K), "defaults k=0": (engine, 0)}
    eos = tok.eos_token_id
    for engine, k in paths.values():
        run_once(engine, prompts[:1], 8, k, eos)  # warm-up: first forwards at each k
    zero_of = {path: next(q for q, (e, qk) in paths.items() if e is engine and qk == 0)
               for path, (engine, _) in paths.items()}  # the same engine's k=0 path
    runs = {path: [] for path in paths}
    for _ in range(repeats):
        for path, (engine, k) in paths.items():  # interleaved: the machine drifts between
            runs[path].append(run_once(engine, prompts, max_tokens, k, eos))  # repeats
    table = Table(title=f"Structured output, {pair} pair, {dtype}, batch 1, {len(TASKS)} "
                        f"JSON-schema extraction prompts, <= {max_tokens} tokens each")
    for col in ("path", "tokens/s", "vs k=0", "per repeat", "acceptance", "forced",
                "grammar us/token", "us/mask", "valid", "equal to k=0"):
        table.add_column(col)
    rows, reference = [], runs[0][0]["outputs"]
    for k, rs in runs.items():
        own = runs[zero_of[k]]
        tps = [r["tokens"] / r["seconds"] for r in rs]
        ratios = [a / b for a, b in zip(tps, [r["tokens"] / r["seconds"] for r in own])]
        r0 = rs[0]
        same = sum(a == b for o, ref in zip(r0["outputs"], reference) for a, b in zip(o, ref))
        row = {"k": k, "tokens_per_s": statistics.median(tps), "tokens_per_s_runs": tps,
               "speedup": statistics.median(ratios), "speedup_runs": ratios,
               "acceptance": r0["accepted"] / r0["draft"] if r0["draft"] else None,
               "forced_share": r0["forced"] / r0["tokens"],
               "grammar_us_per_token": r0["grammar_s"] / r0["tokens"] * 1e6,
               "us_per_mask": r0["grammar_s"] / max(r0["masks"], 1) * 1e6,
               "valid": valid(tok, r0["outputs"], eos), "tokens": r0["tokens"],
               "equal_tokens": same, "reference_tokens": sum(map(len, reference))}
        rows.append(row)
        table.add_row(k if isinstance(k, str) else f"k={k}", f"{row['tokens_per_s']:.2f}",
                      f"{row['speedup']:.2f}x",
                      f"{min(ratios):.2f}-{max(ratios):.2f}x",
                      "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}",
                      f"{row['forced_share']:.0%}", f"{row['grammar_us_per_token']:.0f}",
                      f"{row['us_per_mask']:.0f}", f"{row['valid']}/{len(TASKS)}",
                      f"{same}/{row['reference_tokens']}")
    Console(width=150).print(table)
    path = Path(out or f"bench/results/structured_{pair}_{dtype}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pair": pair, "dtype": dtype, "max_tokens": max_tokens,
                                "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
