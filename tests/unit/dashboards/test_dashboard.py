"""The Grafana dashboard (dashboards/specdecode.json): every query filters by namespace,
instance and model (the proposer's series by the draft model), and latency panels show exemplars. (Its queries against what the
services export: tests/integration/test_observability.py.)"""

from __future__ import annotations

import json
import re

from tests.support.paths import ROOT


def test_dashboard_filters_by_namespace_instance_and_model_and_shows_exemplars():
    dashboard = json.loads((ROOT / "dashboards" / "specdecode.json").read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"namespace", "instance", "model", "draft"} <= variables
    targets = [t for p in dashboard["panels"] for t in p.get("targets", [])]
    # The target model's variable filters the orchestrator's and scorer's series, the draft
    # model's the proposer's (role="proposer", or its RPC methods).
    selector = r'\{namespace=~"\$namespace", instance=~"\$instance", model_name=~"\$(model|draft)"([^}]*)\}'
    for t in targets:
        names = re.findall(r"\bspecdecode_[a-z0-9_]+", t["expr"])
        selectors = re.findall(selector, t["expr"])
        assert names and len(selectors) == len(names), t["expr"]
        for variable, rest in selectors:
            assert (variable == "draft") == ('role="proposer"' in rest or 'method=~".*ProposerService/' in rest), t["expr"]
    latency = [t for t in targets if "_seconds_bucket" in t["expr"]]
    assert latency and all(t.get("exemplar") for t in latency)
