"""The engine refuses a bad configuration."""

from __future__ import annotations

import pytest

from tests.support.models import make_engine


def test_engine_rejects_negative_k(target_model):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_engine(target_model, "ngram", "batch-expansion", -1)
