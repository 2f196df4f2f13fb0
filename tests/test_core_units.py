"""Model runner cache behaviour, n-gram lookup, device selection and bad input."""

from __future__ import annotations

import pytest
import torch

from proposer_svc.ngram import NgramProposer, ngram_lookup
from specdecode.device import DeviceUnavailableError, resolve_device, resolve_dtype
from specdecode.model_runner import ModelRunner, RunnerRow
from specdecode.errors import InvalidRequestError
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData, SequenceGroupMetadata)
from tests.conftest import CPU, make_engine


@torch.inference_mode()
def full_logits(model, tokens):
    return model(torch.tensor([tokens])).logits[0].float()


def test_runner_batches_ragged_rows_with_cache_hits_rollbacks_and_misses(target_model):
    runner = ModelRunner(target_model, CPU)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 9, 3, 12)]
    for step in range(3):
        rows = [RunnerRow(i, s, min(3, len(s))) for i, s in enumerate(seqs)]
        for row, got in zip(rows, runner.forward(rows)):
            want = full_logits(target_model, row.token_ids)[-row.num_queries:]
            assert torch.allclose(got, want, atol=1e-4), step
        # Even rows grow (cache hit); odd rows replace their last token (rollback).
        seqs = [s + [7, 8] if i % 2 == 0 else s[:-1] + [9, 10, 11] for i, s in enumerate(seqs)]
    assert runner.stats.cache_misses == 4 and runner.stats.cache_hits == 8
    # A prefix-sharing row set (batch expansion) reads one entry; the longest is kept.
    rows = [RunnerRow(0, seqs[0] + [1, 2, 3][:j], 1) for j in range(4)]
    for row, got in zip(rows, runner.forward(rows)):
        assert torch.allclose(got, full_logits(target_model, row.token_ids)[-1:], atol=1e-4)
    assert runner.release([0, 1, 99]) == 2 and runner.num_cached_sequences == 2


def test_runner_recomputes_when_cache_disagrees(target_model):
    runner = ModelRunner(target_model, CPU)
    runner.forward([RunnerRow(0, [1, 2, 3, 4], 1)])
    # Same id, different history (e.g. another replica served the last step): miss.
    (got,) = runner.forward([RunnerRow(0, [9, 9, 9, 9, 9], 1)])
    assert runner.stats.cache_hits == 0 and runner.stats.cache_misses == 2
    assert torch.allclose(got, full_logits(target_model, [9, 9, 9, 9, 9])[-1:], atol=1e-4)


def test_runner_evicts_least_recent(target_model):
    runner = ModelRunner(target_model, CPU, max_num_seqs=2)
    for i in range(3):
        runner.forward([RunnerRow(i, [1, 2, 3], 1)])
    assert runner.num_cached_sequences == 2 and runner.release([0]) == 0


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3], k=3, n_min=1, n_max=3) == [9, 1, 2]
    assert ngram_lookup([1, 2, 3, 4], k=3, n_min=1, n_max=3) == []
    # As in vLLM, the earliest match of the longest n-gram wins (the latest gave [2, 5]);
    # short tails give ragged proposals.
    assert ngram_lookup([5, 1, 5, 2, 5], k=4, n_min=1, n_max=1) == [1, 5, 2, 5]
    # The longest n-gram first: [2, 3] recurs once, [3] twice.
    assert ngram_lookup([3, 7, 2, 3, 8, 2, 3], k=2, n_min=1, n_max=2) == [8, 2]
    # The suffix never matches itself.
    assert ngram_lookup([4, 4], k=2, n_min=1, n_max=2) == [4]


def test_ngram_proposer_skips_prompts_and_respects_max_len():
    params = SamplingParams()
    mk = lambda sid, toks, out: SequenceGroupMetadata(
        str(sid), not out, {sid: SequenceData(toks, out)}, params)
    req = ExecuteModelRequest([mk(0, [1, 2, 1], []), mk(1, [1, 2, 1], [2]), mk(2, [3] * 8, [3])],
                              num_lookahead_slots=3)
    props = NgramProposer(max_model_len=12).get_proposals(req)
    # Row 0 is a prompt; row 2 would pass the max model length (9 + 3 + 1 > 12).
    assert props.proposal_lens.tolist() == [0, 2, 0]
    assert props.proposal_token_ids[1].tolist() == [1, 2, -1]
    assert props.proposal_probs is None


def test_device_selection():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda", "npu")
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")
    with pytest.raises(DeviceUnavailableError, match="torch_npu"):
        resolve_device("npu")  # torch_npu is an optional extra, absent here
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailableError, match="cuda"):
            resolve_device("cuda")
    assert resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8")


def test_engine_rejects_negative_k(target_model):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_engine(target_model, "ngram", "batch-expansion", -1)


def test_execute_model_request_validation():
    sg = SequenceGroupMetadata("r", False, {0: SequenceData([1, 2], [3])}, SamplingParams())
    with pytest.raises(InvalidRequestError, match="num_lookahead_slots"):
        ExecuteModelRequest([sg], num_lookahead_slots=-1).validate(10, 100)
    with pytest.raises(InvalidRequestError, match="token_ids"):
        ExecuteModelRequest([sg]).validate(vocab_size=3, max_model_len=100)
    with pytest.raises(InvalidRequestError, match="allows fewer than 3"):
        ExecuteModelRequest([sg]).validate(vocab_size=10, max_model_len=3)
    empty = SequenceGroupMetadata("r", True, {0: SequenceData([])}, SamplingParams())
    with pytest.raises(InvalidRequestError, match="prompt token"):
        ExecuteModelRequest([empty]).validate(10, 100)


def test_mismatched_draft_and_target_are_refused():
    from specdecode.model_info import IncompatibleModelsError, ModelInfo, check_compatible
    target = ModelInfo("target", 256, "abc", 256)
    check_compatible(ModelInfo("draft", 256, "abc", 128), target)
    with pytest.raises(IncompatibleModelsError) as err:
        check_compatible(ModelInfo("draft", 300, "xyz", 256), target)
    message = str(err.value)
    assert "vocab_size: proposer 300 != scorer 256" in message
    assert "tokenizer_fingerprint: proposer 'xyz' != scorer 'abc'" in message
