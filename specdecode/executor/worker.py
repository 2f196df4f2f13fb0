"""A model worker: one single-query decoding step for a batch of sequences.

This is what vLLM 0.4.2 calls the scorer worker's `execute_model`: batch expansion hands it
the expanded batch, the draft proposer calls it once per draft position.
"""

from __future__ import annotations

import torch

from specdecode.grammar.matcher import Grammars
from specdecode.executor.model_runner import ModelRunner, RunnerRow
from specdecode.sampling import TokenHistory, sample_logits
from specdecode.sequence import ExecuteModelRequest, SamplerOutput, SequenceGroupMetadata


class ModelWorker:
    def __init__(self, runner: ModelRunner, purpose: str, grammars: Grammars | None = None):
        """grammars: the grammar states of constrained sequences (structured output); None
        when the model has no tokenizer to build them with (grammars are then ignored: a
        scorer refuses such requests first, a draft proposes unconstrained, still exact)."""
        self.runner = runner
        self.purpose = purpose  # salts seeded draws: "draft" and "target" draw independently
        self.grammars = grammars

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def score_rows(self, groups: list[SequenceGroupMetadata], num_queries: list[int],
                   want_probs: bool, want_logprobs: bool,
                   want_confidence: bool = False) -> SamplerOutput:
        """Logits for the last num_queries[i] positions of each sequence, sampled in order:
        N = sum(num_queries) rows, row (i, j) drawing the token at position len_i - q_i + j + 1."""
        rows = [RunnerRow(sg.kv_cache_id, sg.data.get_token_ids(), q)
                for sg, q in zip(groups, num_queries)]
        logits = self.runner.forward(rows)
        params, positions, histories = [], [], []
        for sg, q in zip(groups, num_queries):
            params += [sg.sampling_params] * q
            positions += range(sg.data.get_len() - q + 1, sg.data.get_len() + 1)
            # Penalties look at the tokens before each row: row j of a multi-query sequence
            # sees the prefix plus proposals[:j], an expanded or draft row its own tokens.
            histories += (TokenHistory.of(sg.data, q) if sg.sampling_params.has_penalties
                          else [None] * q)
        flat = torch.cat(logits) if logits else torch.empty(0, self.vocab_size)  # [N, V]
        allowed = self.grammars.row_masks(groups, num_queries) if self.grammars else None
        return sample_logits(flat, params, positions, self.purpose, want_probs, want_logprobs,
                             histories, want_confidence, allowed)

    def execute_model(self, execute_model_req: ExecuteModelRequest, want_probs: bool = False,
                      want_logprobs: bool = False, want_confidence: bool = False
                      ) -> SamplerOutput:
        """The next token of every sequence: N = batch size rows, in request order."""
        groups = execute_model_req.seq_group_metadata_list
        return self.score_rows(groups, [1] * len(groups), want_probs, want_logprobs,
                               want_confidence)

    def release_sequences(self, seq_ids: list[int]) -> int:
        if self.grammars is not None:
            self.grammars.release(seq_ids)
        return self.runner.release(seq_ids)
