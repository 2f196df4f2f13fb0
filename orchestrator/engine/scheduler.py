"""Who joins a step, within its token budget (chunked prefill), and how far each may speculate."""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.engine.prefill_pacing import MIN_CHUNK
from orchestrator.engine.request import Sequence


def plan_step(seqs: list[Sequence], k_of: Callable[[Sequence], int],
              budget: int | None, paced: int | None = None) -> list[tuple[Sequence, int | None]]:
    """Who joins this step, within a budget of tokens to compute (chunked prefill).

    Sequences that are decoding always join (k + 1 tokens each), so a running stream never
    waits. Prompts share what is left, in arrival order: a prompt that fits joins whole
    (None); a longer one sends its next chunk, a longer prefix of itself (the prefix
    length), whose output is discarded; the services keep its KV state, so the next chunk
    and finally the whole prompt reuse it. The first prompt always gets at least a quarter
    of the budget, so prompts progress however busy the decoding is. Beside decoding
    sequences, prompts get at most `paced` tokens in all (orchestrator.engine.prefill_pacing:
    what keeps the step's time near a decode step's)."""
    if budget is None:
        return [(s, None) for s in seqs]
    plan: list[tuple[Sequence, int | None]] = []
    left = budget
    prompts = []
    for s in seqs:
        if s.decoding:
            plan.append((s, None))
            left -= k_of(s) + 1
        else:
            prompts.append(s)
    if plan and paced is not None:
        left = min(left, paced)
    for i, s in enumerate(prompts):
        todo = len(s.request.prompt_token_ids) - s.prefilled  # tokens not yet computed
        share = max(left, min(budget // 4, paced or budget)) if i == 0 else left
        if todo <= share:
            plan.append((s, None))
        elif share >= MIN_CHUNK:
            plan.append((s, s.prefilled + share))
        else:
            break  # later prompts wait their turn
        left -= min(todo, share)
    return plan


def speculation_cap(seq: Sequence, k_max: int, max_model_len: int) -> int:
    """The most `seq` may speculate: 0 on its prompt step (no KV state yet), else the
    server's k, lowered by the request's own value and by the room left for k proposals
    plus the bonus token."""
    if not seq.decoding:
        return 0
    own = seq.request.num_speculative_tokens
    k = k_max if own is None else min(own, k_max)
    return max(0, min(k, max_model_len - len(seq.token_ids) - 1))


def tokens_left(seq: Sequence, max_model_len: int) -> int:
    """Tokens the sequence may still emit: its max_tokens and the model's length allow."""
    return min(seq.request.sampling_params.max_tokens - len(seq.output_token_ids),
               max_model_len - len(seq.token_ids))
