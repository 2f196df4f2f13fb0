"""A step request's own checks (ExecuteModelRequest.validate), each naming the field."""

from __future__ import annotations

import pytest

from specdecode.errors import InvalidRequestError
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData, SequenceGroupMetadata)


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
