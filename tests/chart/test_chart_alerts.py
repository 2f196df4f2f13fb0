"""The chart's PrometheusRule through promtool: the rules load, and each alert fires on the
series that mean trouble and stays quiet on healthy ones (`promtool test rules`, Prometheus'
own rule evaluation over synthetic series, one sample a minute)."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from chartlib import NAMESPACE, of_kind

SETS = ["metrics.prometheusRule.enabled=true", "metrics.prometheusRule.alertLabels.team=llm"]
# What the ServiceMonitor's scrape adds: the namespace and the Service name as job.
ORCHESTRATOR = {"namespace": NAMESPACE, "job": "sd-specdecode-orchestrator"}


def series(name: str, values: str, **labels) -> dict:
    selector = ", ".join(f'{k}="{v}"' for k, v in {**ORCHESTRATOR, **labels}.items())
    return {"series": f"{name}{{{selector}}}", "values": values}


def alert(name: str, eval_time: str, *firing: tuple[dict, str]) -> dict:
    """The alerts expected at eval_time: (labels, summary) of each (the description is the rule's)."""
    return {"alertname": name, "eval_time": eval_time,
            "exp_alerts": [{"exp_labels": labels, "exp_annotations": {"summary": summary}}
                           for labels, summary in firing]}


def ttft_buckets(slow: bool) -> list[dict]:
    """10 requests a minute, all under 1 s (fast) or all between 10 and 30 s (slow)."""
    counts = {"1": "0+0x30" if slow else "0+10x30", "10": "0+0x30" if slow else "0+10x30",
              "30": "0+10x30", "+Inf": "0+10x30"}
    return [series("specdecode_time_to_first_token_seconds_bucket", v, le=le, model_name="m")
            for le, v in counts.items()]


CASES = {
    "scorer-down": ([
        series("specdecode_replica_up", "1x4 0x20", role="scorer", replica="10.0.0.1:50053"),
    ], [
        alert("SpecDecodeScorerDown", "3m"),
        alert("SpecDecodeScorerDown", "7m",
              ({"namespace": NAMESPACE, "severity": "critical", "team": "llm"}, "No scorer replica is reachable in llm")),
    ]),
    # Scraped by the Prometheus operator, which adds its own `service` target label.
    "scorer-down-scraped-by-the-operator": ([
        series("specdecode_replica_up", "1x4 0x20", role="scorer", replica="10.0.0.1:50053",
               service="sd-specdecode-orchestrator"),
    ], [
        alert("SpecDecodeScorerDown", "7m",
              ({"namespace": NAMESPACE, "severity": "critical", "team": "llm"}, "No scorer replica is reachable in llm")),
    ]),
    "one-scorer-of-two-down": ([
        series("specdecode_replica_up", "1x4 0x20", role="scorer", replica="10.0.0.1:50053"),
        series("specdecode_replica_up", "1x24", role="scorer", replica="10.0.0.2:50053"),
    ], [alert("SpecDecodeScorerDown", "10m")]),
    "acceptance-collapse": ([
        # 2 draft tokens/s; 5% accepted in model a, 50% in model b.
        series("specdecode_draft_tokens_total", "0+120x60", model_name="a"),
        series("specdecode_accepted_tokens_total", "0+6x60", model_name="a"),
        series("specdecode_draft_tokens_total", "0+120x60", model_name="b"),
        series("specdecode_accepted_tokens_total", "0+60x60", model_name="b"),
        # Model c drafts too little to judge (0.1 tokens/s, nothing accepted).
        series("specdecode_draft_tokens_total", "0+6x60", model_name="c"),
        series("specdecode_accepted_tokens_total", "0x60", model_name="c"),
    ], [
        alert("SpecDecodeAcceptanceCollapse", "20m"),  # below the threshold, not yet for 15m
        alert("SpecDecodeAcceptanceCollapse", "40m",
              ({"namespace": NAMESPACE, "model_name": "a", "severity": "warning", "team": "llm"},
               "Draft acceptance of a is 5%")),
    ]),
    "queue-growth": ([series("specdecode_waiting_requests", "0+2x40")], [
        alert("SpecDecodeQueueGrowth", "12m"),
        alert("SpecDecodeQueueGrowth", "30m", ({"namespace": NAMESPACE, "severity": "warning", "team": "llm"},
                                               "60 requests wait to join a step in llm")),
    ]),
    "queue-long-but-steady": ([series("specdecode_waiting_requests", "20x40")],
                              [alert("SpecDecodeQueueGrowth", "30m")]),
    "slow-first-token": (ttft_buckets(slow=True), [
        alert("SpecDecodeTimeToFirstTokenHigh", "25m",
              ({"namespace": NAMESPACE, "model_name": "m", "severity": "warning", "team": "llm"},
               "p99 time to first token of m is 29.8s"))]),
    "fast-first-token": (ttft_buckets(slow=False), [alert("SpecDecodeTimeToFirstTokenHigh", "25m")]),
    "other-release": ([series("specdecode_waiting_requests", "0+2x40", job="other-specdecode-orchestrator")],
                      [alert("SpecDecodeQueueGrowth", "30m")]),
}


@pytest.fixture(scope="module")
def rule(helm):
    (rule,) = of_kind(helm.render(sets=SETS), "PrometheusRule")
    return rule


@pytest.fixture(scope="module")
def rules_file(rule, tmp_path_factory):
    path = tmp_path_factory.mktemp("rules") / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def test_rules_load(promtool, rules_file):
    proc = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True, text=True)
    assert proc.returncode == 0 and "SUCCESS: 4 rules found" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("case", list(CASES))
def test_alert_fires_only_on_trouble(promtool, rule, rules_file, case):
    inputs, alerts = CASES[case]
    descriptions = {r["alert"]: r["annotations"]["description"] for r in rule["spec"]["groups"][0]["rules"]}
    for a in alerts:
        for expected in a["exp_alerts"]:
            expected["exp_annotations"]["description"] = descriptions[a["alertname"]]
    tests = rules_file.parent / f"{case}.test.yaml"
    tests.write_text(yaml.safe_dump({"rule_files": [str(rules_file)], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": inputs, "alert_rule_test": alerts}]}))
    proc = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def test_alerts_can_be_turned_off_and_tuned(helm):
    (rule,) = of_kind(helm.render(sets=[*SETS, "metrics.prometheusRule.scorerDown.enabled=false",
                                        "metrics.prometheusRule.queueGrowth.waitingRequests=50",
                                        'metrics.prometheusRule.selector=cluster="a"']), "PrometheusRule")
    rules = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert "SpecDecodeScorerDown" not in rules and len(rules) == 3
    assert "> 50" in rules["SpecDecodeQueueGrowth"]["expr"]
    assert 'specdecode_waiting_requests{cluster="a"}' in rules["SpecDecodeQueueGrowth"]["expr"]
    assert not of_kind(helm.render(), "PrometheusRule")
