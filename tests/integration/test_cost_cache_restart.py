"""`--cost-cache` through real service processes (issue 32): both services keep their
start-up tables on disk, and a restarted one checks the kept table with two forwards and
serves it, instead of timing every cell. Whether the check agrees depends on the host (the
kept table was timed beside the other service's start-up), so either outcome is accepted, but
one of them must be logged, and a table served from the cache is the kept one."""

from __future__ import annotations

import json
import re

import grpc

from orchestrator.cluster.remote import RemoteProposer, RemoteScorer
from specdecode.api.client import SpecDecodeClient
from specdecode_stack.local import LocalStack, StackConfig

ROLES = {"scorer": RemoteScorer, "proposer": RemoteProposer}


def served_table(stack: LocalStack, role: str) -> list[list[float]]:
    with grpc.insecure_channel(stack.service_addresses[role]) as channel:
        return ROLES[role](channel).model_info().forward_cost.seconds


def kept_tables(directory) -> dict[str, list[list[float]]]:
    out = {}
    for path in directory.glob("forward-costs-*.json"):
        data = json.loads(path.read_text())
        out[data["key"]["role"]] = data["seconds"]
    return out


def test_restarted_services_take_their_kept_tables_after_a_check(tiny_model_dirs, tmp_path):
    log = tmp_path / "stack.log"
    log.write_text("")
    cache = tmp_path / "costs"
    config = StackConfig(target_model=tiny_model_dirs["target"],
                         draft_model=tiny_model_dirs["draft"], tokenizer="none", device="cpu",
                         port=0, num_speculative_tokens=3, cost_cache=str(cache),
                         log_file=str(log), log_format="text", log_level="info")
    with LocalStack(config) as stack:
        kept = kept_tables(cache)
        assert set(kept) == {"scorer", "proposer"}
        for role in ROLES:  # the start-up tables are the ones kept
            assert served_table(stack, role) == kept[role]
        for role in ROLES:
            kept, before = kept_tables(cache), len(log.read_text())  # as re-measured so far
            stack.restart(role)
            tail = log.read_text()[before:]
            taken = re.search(r"forward costs from \S+forward-costs-", tail)
            checked = "kept forward costs off at width" in tail
            assert taken or checked, f"the restarted {role} did not check its kept table"
            if taken:
                assert served_table(stack, role) == kept[role]
        with SpecDecodeClient(stack.address) as client:
            assert len(client.generate([1, 2, 3], max_tokens=8).token_ids) == 8
