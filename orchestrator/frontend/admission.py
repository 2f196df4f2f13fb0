"""What one request may ask for, and how many may be in the orchestrator at once
(docs/security.md; invariant 7: work is bounded).

Two small interfaces both public APIs call, through orchestrator.frontend.generation.Frontend:

- `RequestLimits.check_*`: bounds on a request's fields, checked before any work is spent
  on it (tokenizing a huge text, allocating a sequence); InvalidRequestError names the
  field and the limit.
- `Admission.admit()`: a slot among `max_running + max_queued` requests, or `Overloaded`
  with a retry hint (RESOURCE_EXHAUSTED); the engine loop runs at most `max_running` of
  them at once and the rest wait at the step boundary.

The per-step token budget (chunked prefill) lives in the engine: `max_num_batched_tokens`.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from specdecode.sequence import InvalidRequestError

# A text prompt longer than this many UTF-8 bytes per allowed prompt token cannot fit: it
# is refused before it is tokenized (tokenizing 10 MB takes seconds on the event loop).
TEXT_BYTES_PER_TOKEN = 32
MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True)
class AdmissionConfig:
    """The orchestrator's limits, from its command line."""

    max_prompt_tokens: int = 0  # 0 = the model length less one
    max_running: int = 64  # sequences decoded at once
    max_queued: int = 256  # requests waiting for a running slot
    max_num_batched_tokens: int = 512  # token budget of one step (chunked prefill)
    # Upper bound of the model length, for the request-size limit before the model is
    # known (the public API's message-size limit is set when the server starts).
    max_model_len_hint: int = 32768

    @property
    def max_request_bytes(self) -> int:
        """Largest GenerateRequest worth reading: a prompt of max_prompt_tokens ids (10
        bytes each at most as varints) or of text, plus stop strings and the rest."""
        tokens = self.max_prompt_tokens or self.max_model_len_hint
        return (max(tokens * 10, tokens * TEXT_BYTES_PER_TOKEN)
                + MAX_STOP_STRINGS * (MAX_STOP_STRING_CHARS * 4 + 8)
                + MAX_STOP_TOKEN_IDS * 11 + MAX_REQUEST_ID_CHARS * 4 + 1024)


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request, given the model the orchestrator serves."""

    max_model_len: int
    max_prompt_tokens: int  # < max_model_len
    max_speculative_tokens: int  # the server's k: a request may ask for less, never more

    @classmethod
    def for_model(cls, config: AdmissionConfig, max_model_len: int, k: int) -> RequestLimits:
        cap = max_model_len - 1
        return cls(max_model_len, min(config.max_prompt_tokens or cap, cap), k)

    @property
    def max_text_bytes(self) -> int:
        return self.max_prompt_tokens * TEXT_BYTES_PER_TOKEN

    def check_fields(self, *, request_id: str, text: str | None, num_token_ids: int,
                     temperature: float, top_p: float, stop: list[str],
                     stop_token_ids: list[int], num_speculative_tokens: int | None,
                     text_field: str = "prompt.text") -> None:
        """Checks that need no tokenizer: run them first. `text_field` names the text."""
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError("request_id", f"{len(request_id)} characters; at most "
                                                    f"{MAX_REQUEST_ID_CHARS}")
        if text is not None and len(text.encode()) > self.max_text_bytes:
            raise InvalidRequestError(text_field, f"{len(text.encode())} bytes; at most "
                                      f"{self.max_text_bytes} ({TEXT_BYTES_PER_TOKEN} per "
                                      f"token of the {self.max_prompt_tokens}-token limit)")
        self.check_prompt_len(num_token_ids)
        for name, value in (("temperature", temperature), ("top_p", top_p)):
            if not math.isfinite(value):
                raise InvalidRequestError(name, f"must be a finite number, got {value}")
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"{len(stop)} strings; at most {MAX_STOP_STRINGS}")
        for i, s in enumerate(stop):
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(f"stop[{i}]", f"must have 1 to "
                                          f"{MAX_STOP_STRING_CHARS} characters, got {len(s)}")
        if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"{len(stop_token_ids)} ids; at most "
                                                        f"{MAX_STOP_TOKEN_IDS}")
        k = num_speculative_tokens
        if k is not None and not 0 <= k <= self.max_speculative_tokens:
            raise InvalidRequestError("num_speculative_tokens", f"must be in [0, "
                                      f"{self.max_speculative_tokens}] (this server's k), got {k}")

    def check_prompt_len(self, n: int, field: str = "prompt") -> None:
        if n > self.max_prompt_tokens:
            raise InvalidRequestError(field, f"{n} tokens; the limit is "
                                             f"{self.max_prompt_tokens} (--max-prompt-tokens, "
                                             f"max model length {self.max_model_len})")

    def max_tokens_for(self, prompt_len: int, max_tokens: int, default: int) -> int:
        """The request's max_tokens (0 = `default`, cut to what the model leaves);
        InvalidRequestError when an explicit one cannot fit beside the prompt."""
        room = self.max_model_len - prompt_len
        if max_tokens < 0:
            raise InvalidRequestError("max_tokens", f"must be >= 0, got {max_tokens}")
        if max_tokens == 0:
            return max(1, min(default, room))
        if max_tokens > room:
            raise InvalidRequestError("max_tokens", f"{max_tokens} does not fit: max model "
                                      f"length {self.max_model_len} - {prompt_len} prompt "
                                      f"tokens leaves {room}")
        return max_tokens


class Overloaded(Exception):
    """No slot for another request: RESOURCE_EXHAUSTED; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Admission:
    """Counts requests inside the orchestrator (running or waiting). Thread-safe."""

    def __init__(self, max_running: int, max_queued: int):
        self.max_running, self.max_queued = max_running, max_queued
        self._lock = threading.Lock()
        self._inside = 0
        self._seconds = 1.0  # moving average of a request's time inside, for retry hints

    @property
    def inside(self) -> int:
        return self._inside

    def admit(self) -> Slot:
        with self._lock:
            if self._inside >= self.max_running + self.max_queued:
                waves = 1 + (self._inside - self.max_running) / max(1, self.max_running)
                retry = round(min(60.0, max(1.0, self._seconds * waves)), 1)
                raise Overloaded(f"server busy: {self.max_running} requests running "
                                 f"(--max-running-requests) and {self.max_queued} waiting "
                                 f"(--max-queued-requests); retry in {retry} s", retry)
            self._inside += 1
        return Slot(self)

    def _leave(self, seconds: float) -> None:
        with self._lock:
            self._inside -= 1
            self._seconds = 0.9 * self._seconds + 0.1 * seconds


class Slot:
    """One admitted request; `release` once when it ends (also as a context manager)."""

    def __init__(self, admission: Admission):
        self._admission, self._start, self._open = admission, time.monotonic(), True

    def release(self) -> None:
        if self._open:
            self._open = False
            self._admission._leave(time.monotonic() - self._start)

    def __del__(self) -> None:  # a response dropped before it ran (a client gone early)
        self.release()

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
