"""Grammars compiled once per tokenizer, each within a time limit.

llguidance builds a grammar in native code that cannot be interrupted, and a deeply nested
grammar recurses deeply. So every compile runs in a thread of its own with a large stack
(COMPILE_STACK_BYTES; llguidance drops the GIL meanwhile), at most `max_concurrent` at once,
and its caller waits at most `timeout_s`. A grammar that was too slow, or failed, is
remembered as such: asking again answers at once and starts no new work. Specs are capped in
size (spec.MAX_SPEC_CHARS) and parsing work in kind (LIMITS), so a compile that outlives
its caller's wait still ends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, TimeoutError as FutureTimeout

from specdecode.grammar.spec import StructuredOutput
from specdecode.errors import InvalidRequestError

DEFAULT_COMPILE_TIMEOUT_S = 5.0
COMPILE_STACK_BYTES = 512 << 20  # virtual; a 7,000-rule chain overflows the default 8 MiB
MAX_ERROR_CHARS = 300
_STACK_LOCK = threading.Lock()  # threading.stack_size is process-wide


def _parser_limits():
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)  # errors without grammar dumps


class GrammarCompiler:
    """StructuredOutput -> a fresh llguidance matcher at the grammar's start, for one
    tokenizer. The compiled start state is cached (least recently used beyond cache_size)."""

    def __init__(self, tokenizer, vocab_size: int, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 cache_size: int = 256, max_concurrent: int = 2):
        """tokenizer: a transformers fast tokenizer; vocab_size: the model's (the mask's
        width; ids the tokenizer lacks are never allowed)."""
        import llguidance.hf

        if timeout_s <= 0:
            raise ValueError(f"grammar compile timeout: must be > 0, got {timeout_s}")
        self.llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.eos_token_id: int = tokenizer.eos_token_id
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredOutput, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._slots = threading.Semaphore(max_concurrent)
        self.compiles = 0  # compiles started (cache misses)

    def matcher(self, so: StructuredOutput, field: str | None = None):
        """A new llguidance.LLMatcher at the start of `so`'s grammar. InvalidRequestError
        naming `field` (default so.field) when the spec is malformed, does not compile, or
        did not compile within timeout_s."""
        field = field or so.field
        so.validate(field)
        future = self._entry(so)
        try:
            result = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            result = (f"did not compile within {self.timeout_s:g} s (the server's limit); "
                      "simplify it")
            self._remember(so, result)
        if isinstance(result, str):
            raise InvalidRequestError(field, result)
        return result.deep_copy()

    def _entry(self, so: StructuredOutput) -> Future:
        with self._lock:
            future = self._cache.get(so)
            if future is not None:
                self._cache.move_to_end(so)
                return future
            future = Future()
            self._cache[so] = future
            self._evict()
            self.compiles += 1
        with _STACK_LOCK:
            old = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                threading.Thread(target=self._compile, args=(so, future), daemon=True,
                                 name="grammar-compile").start()
            finally:
                threading.stack_size(old)
        return future

    def _remember(self, so: StructuredOutput, error: str) -> None:
        """Answer `so` with this error from now on (its compile may still be running)."""
        done: Future = Future()
        done.set_result(error)
        with self._lock:
            self._cache[so] = done

    def _evict(self) -> None:
        while len(self._cache) > self.cache_size:
            oldest = next(iter(self._cache))
            if not self._cache[oldest].done():
                break  # running compiles stay until they end
            del self._cache[oldest]

    def _compile(self, so: StructuredOutput, future: Future) -> None:
        """Thread body: the start matcher, or the error message (str)."""
        import llguidance

        with self._slots:
            try:
                grammar = so.to_llguidance()
                matcher = llguidance.LLMatcher(self.llg_tokenizer, grammar, log_level=0,
                                               limits=_parser_limits())
                result = matcher.get_error() if matcher.is_error() else matcher
            except (ValueError, RuntimeError) as exc:  # a grammar text that does not convert
                result = str(exc)
        if isinstance(result, str):
            result = " ".join(result.split())[:MAX_ERROR_CHARS]
        future.set_result(result)
