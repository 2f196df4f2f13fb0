"""Structured output: what speculation buys under a grammar, and which grammar engine
(docs/design.md, Structured output; numbers in docs/benchmarks.md).

    python bench/structured_bench.py speculation [--pair qwen|tiny] [--dtype bfloat16] [--ks 4,8]
    python bench/structured_bench.py engines [--tokenizers smollm2,qwen] [--repeats 3]

Each subcommand prints one table and writes JSON under bench/results/; `speculation --pair
tiny` and `engines --tokenizers smollm2 --engines llguidance` run in seconds.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import click
import jsonschema
import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the root: bench.harness
from bench.harness import CPU, RESULTS, fmt, qwen_dirs, save, show  # noqa: E402
from orchestrator.engine.request import Request  # noqa: E402
from specdecode.grammar.spec import StructuredOutput  # noqa: E402
from specdecode.models.model_packages import fetch  # noqa: E402
from specdecode.models.checkpoints import load_model, load_tokenizer  # noqa: E402
from specdecode.models.model_loading import resolve_deterministic  # noqa: E402
from specdecode.sequence import SamplingParams  # noqa: E402
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model, byte_tokenizer  # noqa: E402
from specdecode_stack.inprocess import build_inprocess_engine  # noqa: E402


@click.group()
def cli() -> None:
    """Structured output, one question per subcommand."""


# -- speculation -------------------------------------------------------------------------------

DEFAULT_K = 8  # the stack's --num-speculative-tokens default: the most its policy picks
PROMPT_STEPS = 2  # a request's steps that its prompt's length prices (run_once)
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
    target_dir, draft_dir = qwen_dirs()
    tok = load_tokenizer(target_dir)
    prompts = [tok(tok.apply_chat_template(
        [{"role": "user", "content": f"Extract the details as JSON: {text}"}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
        for text, _ in TASKS]
    return (load_model(target_dir, CPU, dtype), load_model(draft_dir, CPU, dtype), tok, draft_dir,
            prompts)


def grammar_seconds(engine) -> tuple[float, int]:
    """Matcher work so far (target, draft, engine): seconds, masks."""
    parts = [engine.scorer.worker.grammars, engine.proposer.worker.grammars, engine.grammars]
    return (sum(g.stats.seconds for g in parts), sum(g.stats.masks for g in parts))


def run_once(engine, prompts, max_tokens: int, k: int, eos: int) -> dict:
    """Each prompt alone (batch 1); totals over the set. `settled_*`: the steps after a
    request's first PROMPT_STEPS (the target's prefill, then the first decode, where a
    draft reads the prompt: a cost of the prompt's length, not of the tokens decoded)."""
    out = {"tokens": 0, "seconds": 0.0, "settled_tokens": 0, "settled_s": 0.0, "draft": 0,
           "accepted": 0, "forced": 0, "outputs": [], "grammar_s": 0.0, "masks": 0}
    for i, (prompt, (_, schema)) in enumerate(zip(prompts, TASKS)):
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=(eos,),
                                structured_output=StructuredOutput("json_schema",
                                                                   json.dumps(schema)))
        forced, (g_s, g_n) = engine.grammars.stats.forced, grammar_seconds(engine)
        engine.add_request(Request(str(i), list(prompt), params, k))
        seq, steps, start = engine.running[str(i)], 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps > PROMPT_STEPS:
                out["settled_tokens"] += engine.last_step.new_tokens
                out["settled_s"] += engine.last_step.total_s
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


def engines(pair: str, dtype: str, ks: list[int], draft_vocab: int, defaults: bool):
    """path -> (engine, the request's k): fixed k with multi-query scoring, and (defaults) a
    second pair of models under the stack's defaults; the tokenizer; the prompts."""
    target, draft, tok, draft_dir, prompts = load_pair(pair, getattr(torch, dtype))
    invariant = resolve_deterministic("auto", dtype)  # as the services run by default
    fixed = build_inprocess_engine(target, draft, "multi-query", max(ks), tokenizer=tok,
                                   draft_vocab_size=draft_vocab, draft_dir=draft_dir,
                                   deterministic=invariant)
    paths = {k: (fixed, k) for k in ks}
    if defaults:  # its own models: the pruned head replaced the other draft's
        target, draft, *_ = load_pair(pair, getattr(torch, dtype))
        engine = build_inprocess_engine(target, draft, "auto", DEFAULT_K, tokenizer=tok,
                                        adaptive=True, draft_vocab_size=draft_vocab,
                                        draft_dir=draft_dir, draft_confidence=0.4,
                                        deterministic=invariant)
        paths |= {"defaults": (engine, DEFAULT_K), "defaults k=0": (engine, 0)}
    return paths, tok, prompts


def path_row(path, rs, own, reference, tok, eos) -> dict:
    """A path's medians over the repeats, its ratios to the same engine's k=0, and (first
    repeat) acceptance, the grammar's share and cost, validity and equality to k=0."""
    tps = [r["tokens"] / r["seconds"] for r in rs]
    ratios = [a / (r["tokens"] / r["seconds"]) for a, r in zip(tps, own)]
    settled = [r["settled_tokens"] / r["settled_s"] for r in rs]
    settled_ratios = [a / (r["settled_tokens"] / r["settled_s"]) for a, r in zip(settled, own)]
    r0 = rs[0]
    return {"k": path, "tokens_per_s": statistics.median(tps), "tokens_per_s_runs": tps,
            "speedup": statistics.median(ratios), "speedup_runs": ratios,
            "settled_tokens_per_s": statistics.median(settled),
            "settled_speedup": statistics.median(settled_ratios),
            "acceptance": r0["accepted"] / r0["draft"] if r0["draft"] else None,
            "draft_tokens": r0["draft"],
            "forced_share": r0["forced"] / r0["tokens"],
            "grammar_us_per_token": r0["grammar_s"] / r0["tokens"] * 1e6,
            "us_per_mask": r0["grammar_s"] / max(r0["masks"], 1) * 1e6,
            "valid": valid(tok, r0["outputs"], eos), "tokens": r0["tokens"],
            "equal_tokens": sum(a == b for o, ref in zip(r0["outputs"], reference) for a, b in zip(o, ref)),
            "reference_tokens": sum(map(len, reference))}


@cli.command()
@click.option("--pair", default="qwen", type=click.Choice(["qwen", "tiny"]), show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--ks", default="4,8", show_default=True, help="Speculation lengths to compare.")
@click.option("--max-tokens", default=200, show_default=True)
@click.option("--repeats", default=2, show_default=True)
@click.option("--draft-vocab", default=32768, show_default=True)
@click.option("--defaults/--no-defaults", default=True, show_default=True,
              help="Also the stack's defaults (adaptive k) against their own k=0.")
@click.option("--out", default=None, help="[bench/results/structured_<pair>_<dtype>.json]")
def speculation(pair, dtype, ks, max_tokens, repeats, draft_vocab, defaults, out) -> None:
    """JSON-schema extraction prompts at batch 1, in-process (specdecode_stack.inprocess),
    the draft's head pruned as the stack's default is: k=0 against fixed k (multi-query),
    and (--defaults) a second pair of models under the stack's defaults (adaptive k <= 8,
    auto scoring, early stop at confidence 0.4) against its own k=0. Every run has the
    grammar's jump-forward: the comparison is speculation alone. Per path: tokens/s (median
    over repeats), the ratio to k=0 in the same repeat, acceptance, the share of tokens the
    grammar forced, the grammar's cost per emitted token (target's, draft's and engine's
    matcher work) and per mask, valid outputs, and tokens equal to k=0's; and tokens/s and
    the ratio after each request's first PROMPT_STEPS steps, decode alone (the target's
    prefill and the draft's read of the prompt: on a CPU without matrix units, a 70-token
    prompt costs as much as 15 decode steps beside a 60-token answer)."""
    paths, tok, prompts = engines(pair, dtype, [0, *map(int, ks.split(","))], draft_vocab, defaults)
    eos = tok.eos_token_id
    for engine, k in paths.values():
        run_once(engine, prompts[:1], 8, k, eos)  # warm-up: first forwards at each k
    zero_of = {path: next(q for q, (e, qk) in paths.items() if e is engine and qk == 0)
               for path, (engine, _) in paths.items()}  # the same engine's k=0 path
    runs = {path: [] for path in paths}
    for _ in range(repeats):  # interleaved: the machine drifts between repeats
        for path, (engine, k) in paths.items():
            runs[path].append(run_once(engine, prompts, max_tokens, k, eos))
    rows = [path_row(path, rs, runs[zero_of[path]], runs[0][0]["outputs"], tok, eos)
            for path, rs in runs.items()]
    show(f"Structured output, {pair} pair, {dtype}, batch 1, {len(TASKS)} JSON-schema "
         f"extraction prompts, <= {max_tokens} tokens each",
         ("path", "tokens/s", "vs k=0", "per repeat", "after the prompt: tokens/s", "vs k=0",
          "acceptance", "forced", "grammar us/token", "us/mask", "valid", "equal to k=0"),
         [(r["k"] if isinstance(r["k"], str) else f"k={r['k']}", f"{r['tokens_per_s']:.2f}",
           f"{r['speedup']:.2f}x", f"{min(r['speedup_runs']):.2f}-{max(r['speedup_runs']):.2f}x",
           f"{r['settled_tokens_per_s']:.2f}", f"{r['settled_speedup']:.2f}x",
           "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}", f"{r['forced_share']:.0%}",
           f"{r['grammar_us_per_token']:.0f}", f"{r['us_per_mask']:.0f}", f"{r['valid']}/{len(TASKS)}",
           f"{r['equal_tokens']}/{r['reference_tokens']}") for r in rows], width=180)
    save(out or f"bench/results/structured_{pair}_{dtype}.json", pair=pair, dtype=dtype,
         max_tokens=max_tokens, rows=rows)


# -- engines -----------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                           "vip": {"type": "boolean"}},
            "required": ["name", "email"]},
        "items": {
            "type": "array", "minItems": 1,
            "items": {"type": "object",
                      "properties": {"sku": {"type": "string"},
                                     "quantity": {"type": "integer", "minimum": 1},
                                     "price": {"type": "number"},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
                      "required": ["sku", "quantity", "price"]}},
        "total": {"type": "number"},
        "shipping": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "country": {"enum": ["FR", "DE", "US", "JP"]}},
            "required": ["city", "country"]},
    },
    "required": ["id", "status", "customer", "items", "total"],
}
DOCUMENT = {
    "id": 1042, "status": "shipped",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.org", "vip": True},
    "items": [{"sku": "KB-101", "quantity": 2, "price": 49.5, "tags": ["keyboard", "usb"]},
              {"sku": "MS-7", "quantity": 1, "price": 19.99, "tags": []}],
    "total": 118.99,
    "shipping": {"street": "12 Rue de Rivoli", "city": "Paris", "country": "FR"},
}
K = 8  # draft tokens per step for the "masks k+1" column


def engine_tokenizer(name: str):
    """smollm2's, or the Qwen pair's read from its GGUF alone (no model conversion)."""
    if name == "smollm2":
        return load_tokenizer(None)
    gguf = fetch("qwen2.5-coder-1.5b")
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


class Llguidance:
    name = "llguidance"

    def __init__(self, tok, vocab_size: int):
        import llguidance.hf
        import llguidance.torch
        self.llg, self.ops = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def bitmask(self, n: int) -> torch.Tensor:
        return self.ops.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matcher, bitmask: torch.Tensor, row: int = 0) -> None:
        self.ops.fill_next_token_bitmask(matcher, bitmask, row)

    def consume(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab_size: int):
        import xgrammar
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)))

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matcher, bitmask: torch.Tensor, row: int = 0) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def consume(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)


def byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's printable symbol -> the byte it stands for (GPT-2's table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, vocab_size: int):
        import outlines_core
        self.oc = outlines_core
        decode = byte_level_decoder()
        special = set(tok.all_special_ids)
        vocab: dict[bytes, list[int]] = {}
        for token, i in tok.get_vocab().items():
            if i not in special and i < vocab_size and all(c in decode for c in token):
                vocab.setdefault(bytes(decode[c] for c in token), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tok.eos_token_id, vocab)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary), max_rollback=64)

    def bitmask(self, n: int) -> torch.Tensor:
        return torch.zeros(n, (self.vocab_size + 31) // 32, dtype=torch.int32)

    def fill(self, guide, bitmask: torch.Tensor, row: int = 0) -> None:
        out = bitmask[row]
        guide.write_mask_into(out.data_ptr(), out.numel(), out.element_size())

    def consume(self, guide, token: int) -> None:
        guide.advance(token, return_tokens=False)

    def rollback(self, guide, n: int) -> None:
        guide.rollback_state(n)


ENGINES = {"llguidance": (Llguidance, "llguidance"), "xgrammar": (Xgrammar, "xgrammar"),
           "outlines-core": (OutlinesCore, "outlines_core")}


def quantiles_us(seconds: list[float]) -> tuple[float, float]:
    ordered = sorted(seconds)
    return (statistics.median(ordered) * 1e6, ordered[int(0.9 * (len(ordered) - 1))] * 1e6)


def masks_per_step_s(engine, matcher, bitmask, tokens: list[int]) -> list[float]:
    """The k+1 masks of each window of K document tokens (advance with a mask at each
    position, one more, roll back), then on to the next window."""
    step_s = []
    for at in range(0, len(tokens) - K, K):
        start = time.perf_counter()
        for j, token in enumerate(tokens[at:at + K]):
            engine.fill(matcher, bitmask, j)
            engine.consume(matcher, token)
        engine.fill(matcher, bitmask, K)
        engine.rollback(matcher, K)
        step_s.append(time.perf_counter() - start)
        for token in tokens[at:at + K]:
            engine.consume(matcher, token)
    return step_s


def measure(engine, tokens: list[int], repeats: int) -> dict:
    bitmask = engine.bitmask(K + 1)
    compile_s, first_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        matcher = engine.compile(SCHEMA)
        compile_s.append(time.perf_counter() - start)
        engine.fill(matcher, bitmask)  # an engine that compiles lazily pays here
        first_s.append(time.perf_counter() - start)
    mask_s, consume_s = [], []
    for token in tokens:
        start = time.perf_counter()
        engine.fill(matcher, bitmask)
        mask_s.append(time.perf_counter() - start)
        allowed = bool((bitmask[0, token // 32] >> (token % 32)) & 1)
        assert allowed, f"{engine.name}: the document's token {token} is masked out"
        start = time.perf_counter()
        engine.consume(matcher, token)
        consume_s.append(time.perf_counter() - start)
    matcher.reset()  # each engine's own: back to the start
    step_s = masks_per_step_s(engine, matcher, bitmask, tokens)
    mask_med, mask_p90 = quantiles_us(mask_s)
    return {"compile_ms": statistics.median(compile_s) * 1e3,
            "compile_ms_runs": [s * 1e3 for s in compile_s],
            "first_mask_ms": statistics.median(first_s) * 1e3,
            "mask_us_median": mask_med, "mask_us_p90": mask_p90,
            "consume_us_median": quantiles_us(consume_s)[0],
            "masks_k1_ms_median": statistics.median(step_s) * 1e3 if step_s else None,
            "tokens": len(tokens)}


@cli.command("engines")
@click.option("--tokenizers", default="smollm2,qwen", show_default=True)
@click.option("--engines", "engine_names", default="llguidance,xgrammar,outlines-core", show_default=True)
@click.option("--repeats", default=3, show_default=True, help="Compiles per engine (median).")
@click.option("--out", default=str(RESULTS / "grammar_engines.json"), show_default=True)
def grammar_engines(tokenizers: str, engine_names: str, repeats: int, out: str) -> None:
    """Which grammar engine: llguidance (the project's), xgrammar and outlines-core (measured
    when installed: `pip install xgrammar outlines-core`), one CPU thread, per tokenizer:
    setup (the engine's view of the tokenizer), compile (a nested JSON schema, cold, median
    of --repeats), mask (the allowed-token bitmask at every position of a valid document,
    median / p90), consume, and the k+1 masks a scorer needs for one k=8 draft."""
    torch.set_num_threads(1)
    rows = []
    for tok_name in tokenizers.split(","):
        tok = engine_tokenizer(tok_name)
        tokens = tok(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False).input_ids
        for name in engine_names.split(","):
            cls, module = ENGINES[name]
            row = {"tokenizer": tok_name, "vocab_size": len(tok), "engine": name}
            if importlib.util.find_spec(module) is None:
                rows.append({**row, "installed": False})
                continue
            start = time.perf_counter()
            engine = cls(tok, len(tok))
            rows.append({**row, "installed": True, "setup_ms": (time.perf_counter() - start) * 1e3,
                         **measure(engine, tokens, repeats)})
    show(f"Grammar engines: nested JSON schema, {len(json.dumps(DOCUMENT))}-char document, one CPU thread",
         ("tokenizer", "vocab", "engine", "setup ms", "compile ms", "compile + 1st mask ms",
          "mask us (med / p90)", "consume us", f"k+1 masks ms (k={K})"),
         [(r["tokenizer"], r["vocab_size"], r["engine"], "not installed") if not r["installed"] else
          (r["tokenizer"], r["vocab_size"], r["engine"], f"{r['setup_ms']:.0f}", f"{r['compile_ms']:.1f}",
           f"{r['first_mask_ms']:.1f}", f"{r['mask_us_median']:.0f} / {r['mask_us_p90']:.0f}",
           f"{r['consume_us_median']:.0f}", fmt(r["masks_k1_ms_median"])) for r in rows], width=150)
    save(out, rows=[r for r in rows if r["installed"]])


if __name__ == "__main__":
    cli()
