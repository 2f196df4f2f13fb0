"""The orchestrator's request metrics under vLLM's names, for what reads a vLLM server's
/metrics (an InferencePool's endpoint picker, vLLM's dashboards, `vllm bench`): the same
series, only renamed, each kept to a metric whose meaning is vLLM's. Served on the HTTP
API's /metrics beside our own names (orchestrator.frontend.vllm_api)."""

from __future__ import annotations

import copy

# vLLM's name -> ours (counters without the _total both add).
VLLM_NAMES = {
    "vllm:num_requests_running": "specdecode_running_sequences",
    "vllm:num_requests_waiting": "specdecode_waiting_requests",
    "vllm:prompt_tokens": "specdecode_prompt_tokens",
    "vllm:generation_tokens": "specdecode_generation_tokens",
    "vllm:time_to_first_token_seconds": "specdecode_time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "specdecode_inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds": "specdecode_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds": "specdecode_e2e_request_latency_seconds",
    "vllm:spec_decode_num_draft_tokens": "specdecode_draft_tokens",
}


class VllmNames:
    """A collector: the families of `source` that VLLM_NAMES lists, under vLLM's names."""

    def __init__(self, source):
        self.source = source
        self.renames = {ours: theirs for theirs, ours in VLLM_NAMES.items()}

    def collect(self):
        for family in self.source.collect():
            theirs = self.renames.get(family.name)
            if theirs is None:
                continue
            renamed = copy.copy(family)
            renamed.name = theirs
            renamed.samples = [s._replace(name=theirs + s.name[len(family.name):])
                               for s in family.samples]
            yield renamed
