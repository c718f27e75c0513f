"""The Grafana dashboard shipped by the chart is the one reservoir.dashboard generates, its
queries are valid PromQL over metrics the operator declares, and its layout is sound."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from grafana_foundation_sdk.models import dashboard as models
from grafana_foundation_sdk.models import prometheus

from reservoir import dashboard
from tests.unit.metric_names import (
    REPO,
    declared_metric_names,
    promtool,
    referenced_metric_names,
)

CHECKED_IN = REPO / "charts" / "reservoir" / "files" / "grafana-dashboard.json"

# A per-envelope gauge, and the aggregation that must wrap it: every operator replica exports
# its own copy of an envelope's gauges, which a sum would count once per replica.
ENVELOPE_GAUGE = re.compile(r"(?<![A-Za-z0-9_:])reservoir_envelope_[A-Za-z0-9_:]*")
MERGED_BY_ENVELOPE = re.compile(r"(?:max|min) by \(namespace, envelope(?:, \w+)*\) \($")

# Grafana's variables, replaced by values of the right kind so promtool can parse the query.
VARIABLES = {
    "$__rate_interval": "5m",
    "$namespace": ".*",
    "$envelope": ".*",
    "$resource": "cpu",
    "$pool": ".*",
}


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in board["panels"]:
        found.append(panel)
        found += panel.get("panels", [])  # the panels of a collapsed row
    return found


def expressions(board: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(board) for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            exprs.append(query)
    return exprs


def test_checked_in_dashboard_is_generated() -> None:
    assert dashboard.main(["--check", str(CHECKED_IN)]) == 0, (
        "run `make dashboard` and commit the result"
    )
    assert json.loads(CHECKED_IN.read_text()) == dashboard.dashboard()


def test_check_fails_on_a_hand_edited_file(tmp_path: Path) -> None:
    edited = json.loads(dashboard.render())
    edited["title"] = "Edited by hand"
    path = tmp_path / "dashboard.json"
    path.write_text(json.dumps(edited, sort_keys=True, indent=2) + "\n")
    assert dashboard.main(["--check", str(path)]) == 1
    assert dashboard.main(["--check", str(tmp_path / "missing.json")]) == 1


def test_title_and_variables() -> None:
    board = dashboard.dashboard()
    assert board["title"] == "Reservoir"
    assert board["editable"] is False
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert {"datasource", "namespace", "envelope", "resource", "pool"} <= variables.keys()
    assert variables["datasource"]["type"] == "datasource"
    for name in ("namespace", "envelope", "resource", "pool"):
        query = variables[name]["query"]["query"]
        assert query.startswith("label_values("), name
        assert query.endswith(f", {name})"), name
        assert variables[name]["multi"] and variables[name]["includeAll"], name


def test_the_dashboard_is_built_by_the_typed_sdk() -> None:
    """Every panel is the SDK's typed model (a row or a time series panel) and every query
    its Prometheus data query, before any JSON is written."""
    built = dashboard.builder().build()
    assert built.panels
    for panel in built.panels:
        assert isinstance(panel, models.Panel | models.RowPanel), type(panel)
        if isinstance(panel, models.Panel):
            assert panel.type_val == "timeseries", panel.title
            assert panel.targets, panel.title
            assert all(isinstance(t, prometheus.Dataquery) for t in panel.targets), panel.title


def test_every_query_uses_only_declared_metrics() -> None:
    declared = declared_metric_names()
    used: set[str] = set()
    for expr in expressions(dashboard.dashboard()):
        names = referenced_metric_names(expr)
        assert names, f"queries no reservoir_* metric: {expr}"
        assert names <= declared, f"undeclared {sorted(names - declared)} in {expr}"
        used |= names
    # The panels the dashboard promises, by the metrics they need.
    for metric in (
        "reservoir_envelope_capacity",
        "reservoir_envelope_claims",
        "reservoir_envelope_stranded",
        "reservoir_claim_admission_wait_seconds_bucket",
        "reservoir_claim_commit_wait_seconds_bucket",
        "reservoir_claim_hold_seconds_bucket",
        "reservoir_claim_consumed_ratio_bucket",
        "reservoir_lease_renewals_total",
        "reservoir_lease_expiries_total",
        "reservoir_ledger_writes_total",
        "reservoir_ledger_errors_total",
        "reservoir_envelope_oldest_finalizer_timestamp_seconds",
        "reservoir_envelope_finalizer_due_timestamp_seconds",
        # Contracts (issue 22)
        "reservoir_envelope_in_use",
        "reservoir_envelope_peak_in_use",
        "reservoir_envelope_window_committed",
        "reservoir_envelope_shortfall",
        "reservoir_claim_occupancy_seconds_total",
        # Live exposure (issue 25)
        "reservoir_envelope_claims_reserved",
        "reservoir_envelope_oldest_reservation_timestamp_seconds",
        "reservoir_envelope_lease_remaining_seconds",
        "reservoir_envelope_lease_age_seconds",
        "reservoir_claim_open_age_seconds_bucket",
        "reservoir_claim_released_total",
        "reservoir_lease_renewal_margin_seconds_bucket",
        "reservoir_claim_cancel_after_dispatch_seconds_bucket",
        "reservoir_claim_cancel_confirmation_seconds_bucket",
        "reservoir_pool_capacity",
        "reservoir_pool_envelopes",
    ):
        assert metric in used, f"no panel shows {metric}"


def test_panels_merge_per_envelope_gauges_of_all_replicas() -> None:
    board = dashboard.dashboard()
    for panel in panels(board):
        for query in panel.get("targets", []):
            expr = query["expr"]
            for found in ENVELOPE_GAUGE.finditer(expr):
                assert MERGED_BY_ENVELOPE.search(expr[: found.start()]), (
                    f"{panel['title']}: merge {found.group()} over replicas with max/min by "
                    f"(namespace, envelope, ...) before summing: {expr}"
                )


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    # promtool parses recording rules' expressions; label_values() is Grafana's, not PromQL.
    rules = []
    for index, expr in enumerate(expressions(dashboard.dashboard())):
        if expr.startswith("label_values("):
            match = re.fullmatch(r"label_values\((.*), \w+\)", expr)
            assert match, expr
            expr = match.group(1)
        for variable, value in sorted(VARIABLES.items(), key=lambda kv: -len(kv[0])):
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"unknown variable in {expr}"
        rules.append({"record": f"dashboard:query_{index}", "expr": expr})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    promtool("check", "rules", str(path))


def test_panel_ids_are_unique_and_grid_positions_valid() -> None:
    board = dashboard.dashboard()
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    assert all(isinstance(i, int) and i > 0 for i in ids)
    occupied: dict[tuple[int, int], str] = {}
    for panel in panels(board):
        pos = panel["gridPos"]
        assert set(pos) == {"x", "y", "w", "h"}, panel["title"]
        assert all(isinstance(v, int) for v in pos.values()), panel["title"]
        assert pos["x"] >= 0 and pos["y"] >= 0 and pos["w"] >= 1 and pos["h"] >= 1
        assert pos["x"] + pos["w"] <= 24, f"{panel['title']} is wider than the grid"
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                other = occupied.setdefault((x, y), panel["title"])
                assert other == panel["title"], f"{panel['title']} overlaps {other}"
        assert panel["title"], f"panel {panel['id']} has no title"
        if panel["type"] != "row":
            assert panel["targets"], f"{panel['title']} has no query"
