"""The remote service clients in-process: one encoding of a step's request serves both."""

from __future__ import annotations


def test_step_request_is_encoded_once_for_both_services():
    """The proposer and scorer clients share one encoding of the step's request."""
    from orchestrator.cluster.remote import _encode_request
    from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,
                                     SequenceGroupMetadata)

    def request():
        return ExecuteModelRequest([SequenceGroupMetadata(
            "r", False, {0: SequenceData([1, 2], [3])}, SamplingParams())], 2)
    first = request()
    assert _encode_request(first) is _encode_request(first)
    second = request()
    encoded = _encode_request(second)
    assert encoded is not _encode_request(first) and encoded == _encode_request(second)
