"""The start-up compatibility check of a draft and a target (invariant 4)."""

from __future__ import annotations

import pytest


def test_mismatched_draft_and_target_are_refused():
    from specdecode.model_info import IncompatibleModelsError, ModelInfo, check_compatible
    target = ModelInfo("target", 256, "abc", 256)
    check_compatible(ModelInfo("draft", 256, "abc", 128), target)
    with pytest.raises(IncompatibleModelsError) as err:
        check_compatible(ModelInfo("draft", 300, "xyz", 256), target)
    message = str(err.value)
    assert "vocab_size: proposer 300 != scorer 256" in message
    assert "tokenizer_fingerprint: proposer 'xyz' != scorer 'abc'" in message
