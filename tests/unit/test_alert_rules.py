"""The chart's alert rules are valid, unit-tested case by case, and query real metrics.

`promtool` is built by `make tools` (hack/tools/build.sh) into the same cache as the local
control plane; without it these tests fail rather than skip, so that `make test` cannot pass
with the rules unchecked.
"""

from __future__ import annotations

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
        if "envelope" in rule["expr"] or "reservoir_envelope_" in rule["expr"]:
            for text in rule["annotations"].values():
                assert "$labels.namespace" in text and "$labels.envelope" in text, name


def test_rules_query_only_metrics_the_operator_declares() -> None:
    declared = declared_metric_names()
    for rule in alerts():
        used = referenced_metric_names(rule["expr"])
        assert used, f"{rule['alert']} queries no reservoir_* metric"
        assert used <= declared, f"{rule['alert']} queries undeclared {sorted(used - declared)}"
