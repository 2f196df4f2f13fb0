"""Draft-model proposer: up to k single-token steps of a small model (top-1, no tree).
A prompt row proposes nothing; its KV state is computed (a call with k = 0 only does that).

A greedy sequence proposes the draft's argmax; a sampled one draws from the draft's own
truncated distribution q, which is returned so rejection sampling stays lossless.
Each forward pass is a `draft_model.forward` span.

A call that drafts ahead (ExecuteModelRequest.draft_ahead, asynchronous drafting) proposes
nothing when its rows' KV state does not fit in the pool beside everyone else's: a lookahead
never evicts another sequence's prefix.

Early stop (`confidence` > 0): a sequence stops drafting after a token its draft was unsure
of, the largest probability of that position's distribution (greedy: the argmax's softmax
probability; sampled: max q) below `confidence`. The unsure token is still proposed (its
forward is paid for; the verify may accept it), the next position is not. The decision reads
only the draft's own distributions of the prefix, so verification stays exact
(docs/design.md, adaptive speculation).

Structured output: a constrained sequence drafts from q masked by its grammar (the worker's
Grammars), and a position where the grammar allows one token only takes that token with no
forward at all (jump-forward; q is then its point mass, and the target, masked alike, accepts
it with probability 1).
"""

from __future__ import annotations

import torch

from proposer_svc.common import pack_proposals, speculation_len
from specdecode.telemetry import tracing
from specdecode.interfaces import SpeculativeProposals, SpeculativeProposer, wants_probs
from specdecode.sequence import ExecuteModelRequest
from specdecode.executor.worker import ModelWorker


class DraftModelProposer(SpeculativeProposer):
    def __init__(self, worker: ModelWorker, confidence: float = 0.0):
        """confidence: stop a sequence's draft after a token below it (0 = never stop early)."""
        if not 0.0 <= confidence <= 1.0:
            raise ValueError(f"draft confidence: must be in [0, 1], got {confidence}")
        self.worker = worker
        self.confidence = confidence

    def get_proposals(self, execute_model_req: ExecuteModelRequest) -> SpeculativeProposals:
        groups = execute_model_req.seq_group_metadata_list
        k = execute_model_req.num_lookahead_slots
        k_seq = [speculation_len(sg, k, self.worker.max_model_len) for sg in groups]  # [B]
        if execute_model_req.draft_ahead and not self.worker.runner.fits(
                {sg.kv_cache_id: sg.data.get_len() + n for sg, n in zip(groups, k_seq)}):
            k_seq = [0] * len(groups)  # a full pool drafts nothing ahead: no one is evicted
        want_probs = wants_probs(groups)
        early_stop = self.confidence > 0.0
        drafted: list[list[int]] = [[] for _ in groups]
        probs = torch.zeros(len(groups), k, self.worker.vocab_size) if want_probs else None
        # Prompt rows (a prompt or its chunk) propose nothing: the first forward computes
        # their KV state beside the drafting rows, so their first proposal starts warm.
        prompts = [i for i, sg in enumerate(groups) if sg.is_prompt]
        for step in range(max(*k_seq, 1 if prompts else 0, 0)):
            active = self._take_forced(groups, drafted, probs, step,
                                       [i for i, n in enumerate(k_seq) if n > step])
            warm = prompts if step == 0 else []
            if not active and not warm:  # every sequence stopped early or took a forced token
                continue
            batch = [*(groups[i].with_appended(drafted[i]) for i in active),
                     *(groups[i] for i in warm)]
            with tracing.child_span("draft_model.forward", {"specdecode.draft_position": step,
                                                              "specdecode.batch_size": len(batch)}):
                out = self.worker.execute_model(execute_model_req.clone(batch),
                                                want_probs=want_probs,
                                                want_confidence=early_stop)
            tokens = out.sampled_token_ids.tolist()
            unsure = ((out.confidence < self.confidence).tolist() if early_stop
                      else [False] * len(active))
            for row, i in enumerate(active):
                drafted[i].append(tokens[row])
                if probs is not None:
                    probs[i, step] = out.sampled_token_probs[row]
                if unsure[row]:
                    k_seq[i] = step + 1
        ids, lens = pack_proposals(drafted, k)
        return SpeculativeProposals(proposal_token_ids=ids, proposal_probs=probs,
                                    proposal_lens=lens)

    def _take_forced(self, groups, drafted: list[list[int]], probs: torch.Tensor | None,
                     step: int, active: list[int]) -> list[int]:
        """Append the token a grammar forces at this draft position (no forward); returns
        the active rows that still need one."""
        grammars = self.worker.grammars
        if grammars is None or not active:
            return active
        forced = grammars.forced_tokens([groups[i].with_appended(drafted[i]) for i in active])
        rest = []
        for i, token in zip(active, forced):
            if token is None:
                rest.append(i)
                continue
            drafted[i].append(token)
            grammars.stats.forced += 1
            if probs is not None:
                probs[i, step] = 0.0
                probs[i, step, token] = 1.0
        return rest

    def release_sequences(self, seq_ids: list[int]) -> int:
        return self.worker.release_sequences(seq_ids)
