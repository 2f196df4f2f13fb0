"""One public request, whatever API it came through, and the one place it is validated.

Each API converts its message once into a `GenerationRequest` (its own defaults applied:
OpenAI's temperature 1, gRPC's 0). `RequestLimits.check` bounds every field before any work
is spent on the request (tokenizing a huge text, allocating a sequence), `resolve` checks
what needs the token ids (prompt length, ids in the vocabulary, max_tokens beside the
prompt) and gives the `Generation` the engine runs, which it trusts. InvalidRequestError
names the field and the limit (docs/security.md; invariant 7: work is bounded).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from orchestrator.engine.detokenizer import Detokenizer
from orchestrator.engine.request import Request
from orchestrator.frontend.semconv import Operation
from specdecode.serving.limits import (MAX_CHAT_NAME_BYTES, MAX_REQUEST_ID_CHARS, MAX_SAMPLES,
                                       MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                       TEXT_BYTES_PER_TOKEN)
from specdecode.errors import InvalidRequestError
from specdecode.sequence import SamplingParams, validate_token_ids


@dataclass
class GenerationRequest:
    """A public request as its API sent it, that API's defaults applied."""

    prompt: str | list[int]  # text, or token ids
    # Sampling as sent: max_tokens and the end-of-sequence stop id are set by resolve().
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None = the server's default (cut to the room left)
    n: int = 1
    stop: list[str] = field(default_factory=list)  # stop strings
    ignore_eos: bool = False  # the model's end-of-sequence token does not stop
    num_speculative_tokens: int | None = None  # None = the server's k
    request_id: str = ""  # "" = a fresh one
    prompt_field: str = "prompt"  # where the prompt is in the API's message, for errors
    add_special_tokens: bool = True  # tokenizing adds them (a rendered chat template has them)
    # Where params.structured_output is in the API's message, for errors ("" = its own name).
    grammar_field: str = ""
    operation: Operation = Operation()  # what the telemetry calls it (GenAI conventions)


@dataclass
class Generation:
    """A validated public request: n samples of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # seed None, or the seed of sample 0 (sample i gets seed + i)
    n: int = 1
    stop: list[str] = field(default_factory=list)  # stop strings
    num_speculative_tokens: int | None = None
    deadline: float | None = None  # the client's (time.monotonic()), bounding internal calls
    operation: Operation = Operation()

    def requests(self, tokenizer=None) -> list[Request]:
        """One engine request per sample (ids `<id>` for n = 1, else `<id>/<i>`), each with
        its own detokenizer when there is a tokenizer."""
        out = []
        for i in range(self.n):
            params = self.params
            if params.seed is not None and i:
                params = dataclasses.replace(params, seed=params.seed + i)
            rid = self.request_id if self.n == 1 else f"{self.request_id}/{i}"
            text = Detokenizer(tokenizer, self.stop) if tokenizer is not None else None
            out.append(Request(rid, self.prompt_token_ids, params, self.num_speculative_tokens,
                               deadline=self.deadline, detokenizer=text))
        return out


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request, given the model the orchestrator serves."""

    max_model_len: int
    max_prompt_tokens: int  # < max_model_len
    num_speculative_tokens: int  # the server's k: a request may ask for less, never more
    vocab_size: int
    default_max_tokens: int = 256
    has_tokenizer: bool = True
    # The chat template's own part of each message: tokens at least, bytes
    # (orchestrator.frontend.chat_template.message_overhead).
    chat_message_tokens: int = 1
    chat_message_bytes: int = 0

    @property
    def max_text_bytes(self) -> int:
        return self.max_prompt_tokens * TEXT_BYTES_PER_TOKEN

    def check(self, req: GenerationRequest) -> None:
        """Every bound that needs no tokenizer: run it first."""
        if len(req.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError("request_id", f"{len(req.request_id)} characters; at most "
                                                    f"{MAX_REQUEST_ID_CHARS}")
        self._check_prompt_size(req)
        if req.max_tokens is not None and req.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {req.max_tokens}")
        if not 1 <= req.n <= MAX_SAMPLES:
            raise InvalidRequestError("n", f"must be in [1, {MAX_SAMPLES}], got {req.n}")
        k = req.num_speculative_tokens
        if k is not None and not 0 <= k <= self.num_speculative_tokens:
            raise InvalidRequestError("num_speculative_tokens", f"must be in [0, "
                                      f"{self.num_speculative_tokens}] (this server's k), got {k}")
        self._check_stops(req)
        req.params.validate(self.vocab_size)

    def _check_prompt_size(self, req: GenerationRequest) -> None:
        if isinstance(req.prompt, str):
            if not self.has_tokenizer:
                raise InvalidRequestError(req.prompt_field, "this server has no tokenizer; "
                                                            "send token ids")
            size = len(req.prompt.encode())
            if size > self.max_text_bytes:
                raise InvalidRequestError(req.prompt_field, f"{size} bytes; at most "
                                          f"{self.max_text_bytes} ({TEXT_BYTES_PER_TOKEN} per "
                                          f"token of the {self.max_prompt_tokens}-token limit)")
        else:
            self._check_prompt_len(len(req.prompt), req.prompt_field)

    def check_messages(self, messages: list[dict[str, str]]) -> None:
        """A conversation's size, before its chat template runs: each message renders at
        least the template's per-message tokens (chat_message_tokens), and all its parts
        (role, name, content, and the template's chat_message_bytes per message) at most
        TEXT_BYTES_PER_TOKEN bytes per token."""
        for i, m in enumerate(messages):
            for key in ("role", "name"):
                size = len(m.get(key, "").encode())
                if size > MAX_CHAT_NAME_BYTES:
                    raise InvalidRequestError(f"messages[{i}].{key}", f"{size} bytes; at most "
                                                                      f"{MAX_CHAT_NAME_BYTES}")
        least = len(messages) * self.chat_message_tokens
        if least > self.max_prompt_tokens:
            raise InvalidRequestError("messages", f"{len(messages)} messages render at least "
                                      f"{least} tokens ({self.chat_message_tokens} each); the "
                                      f"limit is {self.max_prompt_tokens} (--max-prompt-tokens)")
        size = sum(len(v.encode()) for m in messages for v in m.values()) + \
            len(messages) * self.chat_message_bytes
        if size > self.max_text_bytes:
            raise InvalidRequestError("messages", f"{size} bytes rendered; at most "
                                      f"{self.max_text_bytes} ({TEXT_BYTES_PER_TOKEN} per token "
                                      f"of the {self.max_prompt_tokens}-token limit)")

    def _check_prompt_len(self, n: int, field_name: str) -> None:
        if n > self.max_prompt_tokens:
            raise InvalidRequestError(field_name, f"{n} tokens; the limit is "
                                                  f"{self.max_prompt_tokens} (--max-prompt-tokens, "
                                                  f"max model length {self.max_model_len})")

    def _check_stops(self, req: GenerationRequest) -> None:
        if len(req.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"{len(req.stop)} strings; at most "
                                              f"{MAX_STOP_STRINGS}")
        for i, s in enumerate(req.stop):
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(f"stop[{i}]", f"must have 1 to "
                                          f"{MAX_STOP_STRING_CHARS} characters, got {len(s)}")
        if req.stop and not self.has_tokenizer:
            raise InvalidRequestError("stop", "this server has no tokenizer to match stop "
                                              "strings; use stop_token_ids")
        if len(req.params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"{len(req.params.stop_token_ids)} ids; "
                                                        f"at most {MAX_STOP_TOKEN_IDS}")

    def resolve(self, req: GenerationRequest, prompt: list[int], request_id: str,
                eos_token_id: int | None) -> Generation:
        """The Generation of a checked request whose prompt is `prompt` (its token ids):
        the prompt's length and ids, max_tokens within what the model leaves, the model's
        end-of-sequence token among the stop ids unless ignore_eos (a grammar's output ends
        with it whatever ignore_eos says: it is the only token a complete grammar allows)."""
        self._check_prompt_len(len(prompt), req.prompt_field)
        validate_token_ids(prompt, [], self.vocab_size, self.max_model_len, req.prompt_field)
        room = self.max_model_len - len(prompt)
        if req.max_tokens is None:
            max_tokens = max(1, min(self.default_max_tokens, room))
        elif req.max_tokens > room:
            raise InvalidRequestError("max_tokens", f"{req.max_tokens} does not fit: max model "
                                      f"length {self.max_model_len} - {len(prompt)} prompt "
                                      f"tokens leaves {room}")
        else:
            max_tokens = req.max_tokens
        stop_ids = tuple(req.params.stop_token_ids)
        if eos_token_id is not None and (not req.ignore_eos or req.params.structured_output):
            stop_ids += (eos_token_id,)
        params = dataclasses.replace(req.params, max_tokens=max_tokens, stop_token_ids=stop_ids)
        return Generation(request_id, list(prompt), params, req.n, list(req.stop),
                          req.num_speculative_tokens, operation=req.operation)
