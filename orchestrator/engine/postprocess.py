"""After verification: the stop rules (stop token ids, stop strings, max_tokens, the model's
length), each sequence's new text, its logprobs and usage (nano-vllm's postprocess: the
scheduler's last phase owns the stop rules, the frontend only forwards what they decided)."""

from __future__ import annotations

import torch

from orchestrator.engine.request import Sequence, StepOutput, token_logprobs
from orchestrator.engine.scheduler import tokens_left


def append_tokens(seq: Sequence, tokens: list[int], max_model_len: int) -> list[int]:
    """Append what the stop rules allow of `tokens`; set finish_reason when it ends. The
    tokens after a stop id, or after the token that completes a stop string, are dropped."""
    params = seq.request.sampling_params
    room = tokens_left(seq, max_model_len)
    new = []
    for token in tokens[:room]:
        new.append(token)
        if token in params.stop_token_ids:
            seq.finish_reason = "stop"
            break
    text = seq.request.detokenizer
    if text is not None and (n := text.stop_token_count(seq.output_token_ids, new)) is not None:
        new, seq.finish_reason = new[:n], "stop"
    seq.output_token_ids += new
    seq.stats.completion_tokens += len(new)
    if seq.finish_reason is None and len(new) == room:
        seq.finish_reason = "length"
    return new


def new_text(seq: Sequence) -> str:
    """The text the sequence's output adds (a stop id that ended it shows no text)."""
    text = seq.request.detokenizer
    if text is None:
        return ""
    out, stop_ids = seq.output_token_ids, seq.request.sampling_params.stop_token_ids
    by_id = seq.finish_reason == "stop" and out and out[-1] in stop_ids
    return text.update(out[:-1] if by_id else out, final=seq.finish_reason is not None)


def step_output(seq: Sequence, new: list[int], logprobs: torch.Tensor | None) -> StepOutput:
    """What the step gives the request: logprobs [k+1, V] are the row of its scores."""
    n_top = seq.request.sampling_params.logprobs
    entries = None
    if n_top is not None:
        if logprobs is None:
            raise RuntimeError("the scorer returned no logprobs for a request that asked for them")
        entries = token_logprobs(logprobs, new, n_top)
    return StepOutput(seq.request.request_id, new, seq.finish_reason, seq.stats, entries,
                      new_text(seq))
