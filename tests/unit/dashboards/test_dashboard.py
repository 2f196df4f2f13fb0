"""The Grafana dashboard (dashboards/specdecode.json): every query filters by namespace,
instance and model, and latency panels show exemplars. (Its queries against what the
services export: tests/integration/test_observability.py.)"""

from __future__ import annotations

import json
import re

from tests.support.paths import ROOT


def test_dashboard_filters_by_namespace_instance_and_model_and_shows_exemplars():
    dashboard = json.loads((ROOT / "dashboards" / "specdecode.json").read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"namespace", "instance", "model"} <= variables
    targets = [t for p in dashboard["panels"] for t in p.get("targets", [])]
    selector = '{namespace=~"$namespace", instance=~"$instance", model_name=~"$model"}'
    for t in targets:
        names = re.findall(r"\bspecdecode_[a-z0-9_]+", t["expr"])
        assert names and t["expr"].count(selector) == len(names), t["expr"]
    latency = [t for t in targets if "_bucket" in t["expr"]]
    assert latency and all(t.get("exemplar") for t in latency)
