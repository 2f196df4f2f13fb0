"""The limits: bounds of the proposer and scorer (per call, and how long a sequence's state
outlives the last call that named it: specdecode.serving.leases), and the constants every bound is
set from (docs/security.md; invariant 7).

Checked on the protobuf message before it is decoded or any model work starts, so an
oversized call costs a few microseconds and gets INVALID_ARGUMENT naming the limit. The
orchestrator's own calls stay inside them when its --max-running-requests and
--num-speculative-tokens are at most these.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.errors import InvalidRequestError
from specdecode.v1 import model_info_pb2, sequence_pb2

# One constant per limit (the CLI's ranges, the services' defaults, the public API's bounds).
MAX_K = 16  # draft tokens per sequence and step: the most any server or call allows
MAX_SAMPLES = 16  # samples of one public request (n)
# A text prompt longer than this many UTF-8 bytes per allowed prompt token cannot fit: it
# is refused before it is tokenized (tokenizing 10 MB takes seconds on the event loop).
TEXT_BYTES_PER_TOKEN = 32
MAX_REQUEST_ID_CHARS = 128
MAX_CHAT_NAME_BYTES = 256  # a chat message's role or name (OpenAI's are words)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_RELEASE_IDS = 1 << 16  # sequence ids in one ReleaseSequences call


@dataclass(frozen=True)
class ServiceLimits:
    max_batch_seqs: int = 256  # sequences in one call
    max_speculative_tokens: int = MAX_K  # num_lookahead_slots (k) of one call
    max_batch_tokens: int = 0  # token ids in one call (0 = max_batch_seqs x max model len)
    # Seconds a sequence's state (delta token store, KV cache) is kept after the last call
    # that named it, when no release comes.
    sequence_lease_seconds: float = 300.0

    def check(self, m: sequence_pb2.ExecuteModelRequest, max_model_len: int,
              field: str = "request") -> None:
        n = len(m.seq_group_metadata_list)
        if n > self.max_batch_seqs:
            raise InvalidRequestError(f"{field}.seq_group_metadata_list",
                                      f"{n} sequences; at most {self.max_batch_seqs} per call "
                                      f"(--max-batch-seqs)")
        if m.num_lookahead_slots > self.max_speculative_tokens:
            raise InvalidRequestError(f"{field}.num_lookahead_slots",
                                      f"{m.num_lookahead_slots}; at most "
                                      f"{self.max_speculative_tokens} (--max-speculative-tokens)")
        tokens = sum(len(d.prompt_token_ids) + len(d.output_token_ids)
                     for sg in m.seq_group_metadata_list for d in sg.seq_data.values())
        cap = self.max_batch_tokens or self.max_batch_seqs * max_model_len
        if tokens > cap:
            raise InvalidRequestError(f"{field}.seq_group_metadata_list",
                                      f"{tokens} token ids; at most {cap} per call "
                                      f"(--max-batch-tokens)")

    @staticmethod
    def check_release(m: model_info_pb2.ReleaseSequencesRequest) -> None:
        if len(m.seq_ids) > MAX_RELEASE_IDS:
            raise InvalidRequestError("seq_ids", f"{len(m.seq_ids)} ids; at most "
                                                 f"{MAX_RELEASE_IDS} per call")
        if m.seq_ids and min(m.seq_ids) < 0:
            raise InvalidRequestError("seq_ids", f"sequence ids are >= 0, got {min(m.seq_ids)}")
