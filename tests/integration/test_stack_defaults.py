"""The three services at their defaults (adaptive k, auto scoring, a pruned draft head)
as real processes: lossless, and reporting their measured costs."""

from __future__ import annotations

from orchestrator.engine.speculation_policy import REASONS
from tests.support.adaptive import MAX_TOKENS, PROMPTS
from tests.support.references import reference_greedy


def test_stack_defaults_are_lossless_and_report_costs(tiny_model_dirs, target_model,
                                                      monkeypatch):
    """The three services at their defaults (adaptive k, auto scoring) with a pruned draft
    head: greedy output equals the target's; both services report measured costs, each
    measured alone (a service starts once the one before it serves: timed while the other
    loaded, a table came out 8x off); the orchestrator exports the chosen k."""
    import re
    import urllib.request

    import grpc

    from specdecode.api.client import SpecDecodeClient
    from orchestrator.cluster.remote import RemoteProposer, RemoteScorer
    from specdecode_stack import local
    from specdecode_stack.local import LocalStack, StackConfig

    events = []
    spawn, wait = LocalStack._spawn, local.wait_process_serving
    monkeypatch.setattr(LocalStack, "_spawn", lambda self, role, *args: (
        events.append(("start", role)), spawn(self, role, *args))[1])
    monkeypatch.setattr(local, "wait_process_serving", lambda address, *args: (
        wait(address, *args), events.append(("serving", address)))[0])
    config = StackConfig(target_model=tiny_model_dirs["target"], draft_model=tiny_model_dirs["draft"],
                         tokenizer="none", device="cpu", port=0, draft_vocab_size=64)
    assert (config.scoring, config.speculation) == ("auto", "adaptive")
    with LocalStack(config) as stack:
        assert events == [("start", "scorer"), ("serving", stack.service_addresses["scorer"]),
                          ("start", "proposer"), ("serving", stack.service_addresses["proposer"]),
                          ("start", "orchestrator"), ("serving", stack.address)]
        with SpecDecodeClient(stack.address) as client:
            for p in PROMPTS:
                assert client.generate(p, max_tokens=MAX_TOKENS).token_ids == \
                    reference_greedy(target_model, p, MAX_TOKENS)
        for role, cls in (("proposer", RemoteProposer), ("scorer", RemoteScorer)):
            with grpc.insecure_channel(stack.service_addresses[role]) as channel:
                info = cls(channel).model_info()
            assert info.forward_cost.rows == [1, 4] and info.forward_cost(1, 5) > 0
        assert info.scoring_method == "auto"
        body = urllib.request.urlopen(
            f"http://127.0.0.1:{stack.metrics_ports['orchestrator']}/metrics").read().decode()
        counts = {m[1]: float(m[2]) for m in re.finditer(
            r'^specdecode_chosen_k_count\{[^}]*reason="(\w*)"[^}]*\} (\S+)$', body, re.M)}
        count = sum(counts.values())  # labels: model_name, reason
        assert counts["capped"] >= len(PROMPTS) and set(counts) <= set(REASONS)  # prompt steps
        assert re.search(r"^specdecode_predicted_speedup_count(?:\{[^}]*\})? [1-9]", body, re.M)
        assert count >= len(PROMPTS) * 2  # one per sequence-step, prompt steps included
