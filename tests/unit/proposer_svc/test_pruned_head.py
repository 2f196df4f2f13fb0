"""The pruned draft head: logits for a frequency-ranked subset, -inf elsewhere, EOS kept."""

from __future__ import annotations

import torch

from proposer_svc.pruned_head import PrunedLMHead, frequency_order, prune_lm_head
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model


def test_pruned_head_scores_the_subset_and_minus_inf_elsewhere(draft_model):
    model = build_tiny_model(TinyModelSpec(seed=2, num_layers=1))
    head = model.get_output_embeddings()
    keep = torch.tensor([0, 3, 7, 100, 255])
    pruned = PrunedLMHead(head, keep)
    hidden = torch.randn(2, 3, head.weight.shape[1])
    full, out = head(hidden), pruned(hidden)
    assert out.shape == full.shape
    torch.testing.assert_close(out[..., keep], full[..., keep])
    mask = torch.ones(full.shape[-1], dtype=torch.bool)
    mask[keep] = False
    assert torch.isneginf(out[..., mask]).all()


def test_frequency_order_follows_bpe_merges(tmp_path):
    (tmp_path / "tokenizer.json").write_text(
        '{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "ba": 3, "bab": 4},'
        ' "merges": ["b a", "a b", "ba b"]}, "added_tokens": [{"id": 5}]}')
    # added token first, then bytes, then merges in order; ids no entry names go last
    assert frequency_order(tmp_path, 7) == [5, 0, 1, 3, 2, 4, 6]
    assert frequency_order(None, 3) == [0, 1, 2]


def test_prune_lm_head_keeps_eos():
    model = build_tiny_model(TinyModelSpec(seed=2, num_layers=1))
    model.config.eos_token_id = 200
    assert prune_lm_head(model, None, 64) == 65
    assert 200 in model.lm_head.keep.tolist()
    assert prune_lm_head(build_tiny_model(TinyModelSpec(seed=2, num_layers=1)), None, 0) == 256
