"""The data model every component speaks, mirroring vLLM 0.4.2's `vllm.sequence`.

Only what speculative decoding needs is kept: one sequence per group (no beam search),
no block tables (each service keeps its own KV cache keyed by `cache_id`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from specdecode.errors import InvalidRequestError, fields_of
from specdecode.grammar.spec import StructuredOutput

SeqId = int
TokenId = int


MAX_LOGPROBS = 20  # the most top log-probabilities a request may ask for per token
# The smallest sampling temperature and repetition penalty: logits divided by smaller ones
# can overflow float32 to inf, and the sampled distribution to NaN (vLLM treats a
# temperature below 1e-5 as greedy; here it is refused, and 0 is greedy).
MIN_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 0.01


def validate_token_ids(prompt: list[TokenId], output: list[TokenId], vocab_size: int,
                       max_model_len: int, field: str) -> None:
    """The one check of a sequence's token ids, for the public API's prompts and the
    services' sequences alike: a prompt, ids in the vocabulary, fewer than max_model_len.
    InvalidRequestError names `field` (`field.token_ids` for ids outside the vocabulary)."""
    if not prompt:
        raise InvalidRequestError(field, "needs at least one prompt token")
    bad = [t for t in (*prompt, *output) if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"{field}.token_ids",
                                  f"ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    length = len(prompt) + len(output)
    if length >= max_model_len:
        raise InvalidRequestError(
            field, f"{length} tokens; the model allows fewer than {max_model_len}")


@dataclass
class SamplingParams:
    """How one request samples. temperature 0 means greedy.

    Every control below shapes the distribution that both the draft and the target model
    sample from at each position (see specdecode.sampling.processed_logits), so rejection
    sampling compares like with like and stays exact. Penalties follow vLLM's meaning:
    repetition_penalty looks at prompt and output tokens, presence and frequency penalties
    at output tokens only.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = whole vocabulary
    top_p: float = 1.0  # in (0, 1]
    seed: int | None = None  # None = nondeterministic
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0  # in [0, 1]: drop tokens below min_p x the top token's probability
    repetition_penalty: float = 1.0  # > 0; 1 = off. Seen tokens' logits: / if > 0, x if < 0
    presence_penalty: float = 0.0  # in [-2, 2]: minus this once for each token already output
    frequency_penalty: float = 0.0  # in [-2, 2]: minus this times the token's output count
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # Log-probabilities to report per emitted token: None = none, 0 = the chosen token's,
    # n = also the n most likely (at most MAX_LOGPROBS). They are the target model's own,
    # before any control above (the model's distribution, as OpenAI and vLLM report it).
    logprobs: int | None = None
    # The grammar the output must follow (specdecode.grammar): its mask shapes p and q like
    # the controls above. None = unconstrained.
    structured_output: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the distribution depends on the tokens before each position."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate(self, vocab_size: int | None = None) -> None:
        """The distribution's controls (the public API's validator and the services' peer
        checks both call this; max_tokens is the public request's: frontend.request)."""
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise InvalidRequestError("temperature", f"must be a finite number, 0 (greedy) or "
                                                     f">= {MIN_TEMPERATURE}, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 100.0:
            raise InvalidRequestError("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}"
                                                            f", 100], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value}")
        bad_bias = {t: b for t, b in self.logit_bias.items() if not -100.0 <= b <= 100.0}
        if bad_bias:
            raise InvalidRequestError("logit_bias", f"values must be in [-100, 100], got "
                                                    f"{dict(list(bad_bias.items())[:5])}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError("logprobs",
                                      f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.structured_output is not None:
            self.structured_output.validate()
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(
                    "stop_token_ids", f"ids {bad} outside the vocabulary [0, {vocab_size})")
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(
                    "logit_bias", f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")


@dataclass
class SequenceData:
    """The token ids of one sequence: its prompt and what was generated so far."""

    prompt_token_ids: list[TokenId]
    output_token_ids: list[TokenId] = field(default_factory=list)

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_token_ids(self) -> list[TokenId]:
        return [*self.prompt_token_ids, *self.output_token_ids]


@dataclass
class SequenceGroupMetadata:
    """One sequence of one request, as a step sees it."""

    request_id: str
    is_prompt: bool  # True until the sequence has its first generated token
    seq_data: dict[SeqId, SequenceData]  # exactly one entry (no beam search)
    sampling_params: SamplingParams
    # Sequence id whose KV cache this sequence may read (the analogue of vLLM 0.4.2's
    # block_tables): an expanded target sequence reads its parent's cache.
    # None = its own sequence id.
    cache_id: SeqId | None = None
    # Speculation length for this sequence; None = the request's num_lookahead_slots.
    num_speculative_tokens: int | None = None

    @property
    def seq_id(self) -> SeqId:
        (seq_id,) = self.seq_data
        return seq_id

    @property
    def data(self) -> SequenceData:
        return self.seq_data[self.seq_id]

    @property
    def kv_cache_id(self) -> SeqId:
        return self.seq_id if self.cache_id is None else self.cache_id

    def with_appended(self, token_ids: list[TokenId], seq_id: SeqId | None = None,
                      cache_id: SeqId | None = None) -> SequenceGroupMetadata:
        """A copy with token_ids appended to the output, optionally under another sequence
        id that reads `cache_id`'s KV cache (an expanded target sequence)."""
        data = SequenceData(self.data.prompt_token_ids, [*self.data.output_token_ids, *token_ids])
        return dataclasses.replace(
            self, seq_data={self.seq_id if seq_id is None else seq_id: data},
            cache_id=self.cache_id if cache_id is None else cache_id)


@dataclass
class ExecuteModelRequest:
    """One step's batch."""

    seq_group_metadata_list: list[SequenceGroupMetadata]
    num_lookahead_slots: int = 0  # k: speculative tokens per sequence this step
    # Proposals drafted ahead of their verification (asynchronous drafting): a proposer
    # with a KV pool proposes nothing rather than evict another sequence's state for them.
    draft_ahead: bool = False

    def clone(self, seq_group_metadata_list: list[SequenceGroupMetadata]) -> ExecuteModelRequest:
        return dataclasses.replace(self, seq_group_metadata_list=seq_group_metadata_list)

    def validate(self, vocab_size: int, max_model_len: int) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if self.num_lookahead_slots < 0:
            raise InvalidRequestError(
                "num_lookahead_slots", f"must be >= 0, got {self.num_lookahead_slots}")
        seen: set[SeqId] = set()
        for i, sg in enumerate(self.seq_group_metadata_list):
            where = f"seq_group_metadata_list[{i}]"
            if len(sg.seq_data) != 1:
                raise InvalidRequestError(f"{where}.seq_data", "must hold exactly one sequence")
            if sg.seq_id < 0 or sg.seq_id in seen:
                raise InvalidRequestError(f"{where}.seq_data", f"sequence id {sg.seq_id} is "
                                          "negative or appears twice in the batch")
            seen.add(sg.seq_id)
            validate_token_ids(sg.data.prompt_token_ids, sg.data.output_token_ids, vocab_size,
                               max_model_len, where)
            if sg.num_speculative_tokens is not None and sg.num_speculative_tokens < 0:
                raise InvalidRequestError(f"{where}.num_speculative_tokens",
                                          f"must be >= 0, got {sg.num_speculative_tokens}")
            with fields_of(f"{where}.sampling_params"):
                sg.sampling_params.validate(vocab_size)


@dataclass
class SamplerOutput:
    """Target (or draft) model output for N single-query rows."""

    sampled_token_ids: torch.Tensor  # [N] long
    sampled_token_probs: torch.Tensor | None  # [N, V] float32, None when not asked for
    logprobs: torch.Tensor | None  # [N, V] float32, None when not asked for
    # [N] float32: the row's largest probability (sampling.sample_logits), when asked for
    confidence: torch.Tensor | None = None
