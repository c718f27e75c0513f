"""The chart's alert rules are valid, unit-tested case by case, and query real metrics.

`promtool` is built by `make tools` (hack/tools/build.sh) into the same cache as the local
control plane; without it these tests fail rather than skip, so that `make test` cannot pass
with the rules unchecked.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from tests.unit.metric_names import (
    REPO,
    declared_metric_names,
    promtool,
    referenced_metric_names,
)

RULES = REPO / "charts" / "reservoir" / "files" / "prometheus-rules.yaml"
RULE_TESTS = REPO / "tests" / "promtool" / "alerts_test.yaml"

# A per-envelope gauge, and the aggregation that must wrap it: every operator replica exports
# its own copy of an envelope's gauges, so a rule merges them by the envelope's labels.
ENVELOPE_GAUGE = re.compile(r"(?<![A-Za-z0-9_:])reservoir_envelope_[A-Za-z0-9_:]*")
MERGED_BY_ENVELOPE = re.compile(r"(?:max|min) by \(namespace, envelope(?:, \w+)*\) \($")
ENVELOPE_LABEL = re.compile(r"\benvelope\b")
SERIES = re.compile(r"^\s*(\w+)\{(.*)\}\s*$")
LABEL = re.compile(r'(\w+)\s*=\s*"([^"]*)"')


def alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_checks_the_rules() -> None:
    promtool("check", "rules", str(RULES))


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    # rule_files in the test file are relative to its directory.
    promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)


def test_every_alert_has_a_firing_and_a_non_firing_case() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert names, f"no alerts in {RULES}"
    assert names - firing == set(), "alerts without a case where they fire"
    assert names - quiet == set(), "alerts without a case where they must not fire"
    assert (firing | quiet) - names == set(), "test cases for alerts that do not exist"


def test_alerts_are_labelled_and_explained() -> None:
    for rule in alerts():
        name = rule["alert"]
        assert name.startswith("Reservoir"), name
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert rule.get("for"), f"{name} has no for: and would fire on one evaluation"
        assert {"summary", "description"} <= rule["annotations"].keys(), name
        # About envelopes: a per-envelope gauge or the envelope label (a pool's count of
        # envelopes, reservoir_pool_envelopes, is about the pool).
        if ENVELOPE_LABEL.search(rule["expr"]) or "reservoir_envelope_" in rule["expr"]:
            for text in rule["annotations"].values():
                assert "$labels.namespace" in text and "$labels.envelope" in text, name


def test_rules_query_only_metrics_the_operator_declares() -> None:
    declared = declared_metric_names()
    for rule in alerts():
        used = referenced_metric_names(rule["expr"])
        assert used, f"{rule['alert']} queries no reservoir_* metric"
        assert used <= declared, f"{rule['alert']} queries undeclared {sorted(used - declared)}"


def unmerged_envelope_gauges(expr: str) -> list[str]:
    """The per-envelope gauges in `expr` not directly inside a max/min by namespace, envelope."""
    return [
        found.group()
        for found in ENVELOPE_GAUGE.finditer(expr)
        if not MERGED_BY_ENVELOPE.search(expr[: found.start()])
    ]


def test_unmerged_envelope_gauges_are_found() -> None:
    assert unmerged_envelope_gauges("reservoir_envelope_stranded > 0") == [
        "reservoir_envelope_stranded"
    ]
    assert unmerged_envelope_gauges("sum by (namespace, envelope) (reservoir_envelope_claims)")
    assert not unmerged_envelope_gauges(
        "max by (namespace, envelope, resource) (reservoir_envelope_stranded) > 0"
    )


def test_alerts_merge_per_envelope_gauges_of_all_replicas() -> None:
    for rule in alerts():
        assert unmerged_envelope_gauges(rule["expr"]) == [], (
            f"{rule['alert']}: aggregate per-envelope gauges with max/min by (namespace, "
            "envelope, ...), or two operator replicas make it fire twice"
        )


def test_every_per_envelope_alert_fires_once_for_two_replicas() -> None:
    """Each alert over per-envelope gauges has a case where two replicas (different instance
    labels) export the same envelope and it fires with no instance label."""
    covered: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        instances: dict[tuple[str, frozenset[tuple[str, str]]], set[str]] = {}
        for series in case.get("input_series", []):
            match = SERIES.match(series["series"])
            assert match, series["series"]
            labels = dict(LABEL.findall(match.group(2)))
            instance = labels.pop("instance", None)
            if instance is not None:
                key = (match.group(1), frozenset(labels.items()))
                instances.setdefault(key, set()).add(instance)
        if not any(len(found) > 1 for found in instances.values()):
            continue
        for check in case.get("alert_rule_test", []):
            for alert in check.get("exp_alerts") or []:
                assert "instance" not in alert["exp_labels"], case["name"]
                covered.add(check["alertname"])
    per_envelope = {rule["alert"] for rule in alerts() if ENVELOPE_GAUGE.search(rule["expr"])}
    assert per_envelope, "no alert over per-envelope gauges"
    assert per_envelope - covered == set(), "alerts without a two-replica case where they fire"


def test_finalizer_alert_compares_the_due_time_not_the_deletion_age() -> None:
    (rule,) = (rule for rule in alerts() if rule["alert"] == "ReservoirFinalizerStuck")
    used = referenced_metric_names(rule["expr"])
    assert used == {"reservoir_envelope_finalizer_due_timestamp_seconds"}, used
