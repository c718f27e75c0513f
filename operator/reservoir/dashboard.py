"""Generate Reservoir's Grafana dashboard from code (never edit the JSON by hand).

    python -m reservoir.dashboard                 # print the dashboard JSON
    python -m reservoir.dashboard --check PATH    # exit 1 if PATH differs from it

`make dashboard` writes charts/reservoir/files/grafana-dashboard.json, which the chart ships
(and a test keeps equal to this module's output). The panels query only the metrics that
reservoir.metrics declares: per-envelope gauges filtered by the namespace and envelope
variables, per-class counters and histograms by the namespace variable.

Every operator replica exports the per-envelope gauges (reservoir_envelope_*) of the envelopes
it has reconciled: the active one, and a paused one for up to 90 s after it stopped. Panels
over them first take the `max by` the envelope's identifying labels, so that two replicas'
copies of one envelope are not counted twice, and only then sum over envelopes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

Panel = dict[str, Any]

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ENVELOPE = 'namespace=~"$namespace", envelope=~"$envelope"'
NAMESPACE = 'namespace=~"$namespace"'
WIDTH = 24  # Grafana's grid is 24 columns wide


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {
        "datasource": DATASOURCE,
        "expr": expr,
        "legendFormat": legend,
        "range": True,
        "refId": ref,
    }


def timeseries(
    title: str,
    description: str,
    targets: list[tuple[str, str]],
    *,
    unit: str = "short",
    stacked: bool = False,
    maximum: float | None = None,
    overrides: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> Panel:
    refs = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [target(expr, legend, refs[i]) for i, (expr, legend) in enumerate(targets)],
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "min": 0,
                **({} if maximum is None else {"max": maximum}),
                "custom": {
                    "drawStyle": "line",
                    "lineWidth": 1,
                    "fillOpacity": 20 if stacked else 0,
                    "showPoints": "never",
                    "stacking": {"group": "A", "mode": "normal" if stacked else "none"},
                },
            },
            "overrides": overrides or [],
        },
        "options": {
            "legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        **extra,
    }


def quantiles(metric: str, by: str, selector: str, qs: tuple[float, ...]) -> list[tuple[str, str]]:
    """histogram_quantile targets for `metric` (a histogram's base name), one per quantile."""
    targets = []
    for q in qs:
        rate = f"rate({metric}_bucket{{{selector}}}[$__rate_interval])"
        expr = f"histogram_quantile({q}, sum by (le, {by}) ({rate}))"
        label = " ".join("{{" + name.strip() + "}}" for name in by.split(","))
        targets.append((expr, f"p{round(q * 100)} {label}"))
    return targets


def rate(metric: str, selector: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[$__rate_interval]))"


def row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def capacity_panels() -> list[Panel]:
    # One panel per resource (repeated over the resource variable): the four ledger states
    # stack up to the envelope's capacity, drawn as a dashed line on top.
    capacity_line = {
        "matcher": {"id": "byName", "options": "capacity"},
        "properties": [
            {"id": "custom.stacking", "value": {"group": "A", "mode": "none"}},
            {"id": "custom.fillOpacity", "value": 0},
            {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
            {"id": "color", "value": {"fixedColor": "text", "mode": "fixed"}},
        ],
    }
    return [
        row("Capacity"),
        timeseries(
            "Capacity by state: $resource",
            "Envelope capacity of one resource by ledger state, summed over the selected "
            "envelopes: reserved, committed, reconciling and available stack up to capacity.",
            [
                (
                    "sum by (state) (max by (namespace, envelope, resource, state) "
                    f'(reservoir_envelope_capacity{{{ENVELOPE}, resource="$resource"}}))',
                    "{{state}}",
                )
            ],
            stacked=True,
            overrides=[capacity_line],
            repeat="resource",
            repeatDirection="h",
            maxPerRow=2,
            w=12,
        ),
        timeseries(
            "Claims by phase",
            "Claims of the selected envelopes by phase.",
            [
                (
                    "sum by (phase) (max by (namespace, envelope, phase) "
                    f"(reservoir_envelope_claims{{{ENVELOPE}}}))",
                    "{{phase}}",
                )
            ],
            stacked=True,
            w=12,
        ),
        timeseries(
            "Stranded capacity",
            "Capacity held by claims whose lease lapsed or whose envelope is no longer "
            "open (alert: ReservoirCapacityStranded after 30m).",
            [
                (
                    "max by (namespace, envelope, resource) "
                    f"(reservoir_envelope_stranded{{{ENVELOPE}}}) > 0",
                    "{{namespace}}/{{envelope}} {{resource}}",
                )
            ],
            w=12,
        ),
        timeseries(
            "Unhealthy ledgers",
            "Envelopes whose ledger disagrees with their claims or cannot be written "
            "(alert: ReservoirLedgerUnhealthy after 5m).",
            [
                (
                    "min by (namespace, envelope) "
                    f"(reservoir_envelope_ledger_healthy{{{ENVELOPE}}}) == 0",
                    "{{namespace}}/{{envelope}}",
                )
            ],
            w=12,
        ),
        timeseries(
            "Finalizer waits: age and overdue",
            "Age of the oldest claim deletion still waiting on the settlement finalizer, and "
            "how long the earliest waiting deletion is past its due time (at once before the "
            "commit point, else the ambiguity deadline after its lease ends or it detaches: a "
            "deleted Committed claim waits its lease out first). Alert: "
            "ReservoirFinalizerStuck when overdue by more than 5 minutes for 5 minutes.",
            [
                (
                    "time() - min by (namespace, envelope) "
                    f"(reservoir_envelope_oldest_finalizer_timestamp_seconds{{{ENVELOPE}}})",
                    "waiting {{namespace}}/{{envelope}}",
                ),
                (
                    "(time() - max by (namespace, envelope) "
                    f"(reservoir_envelope_finalizer_due_timestamp_seconds{{{ENVELOPE}}})) > 0",
                    "overdue {{namespace}}/{{envelope}}",
                ),
            ],
            unit="s",
            overrides=[
                {
                    "matcher": {"id": "byRegexp", "options": "^overdue .*"},
                    "properties": [
                        {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}}
                    ],
                }
            ],
            w=12,
        ),
    ]


def contract_panels() -> list[Panel]:
    # Each resource keeps a contract (README "Resource contracts"): what is in use of a
    # Reusable or Replenishing resource comes back (as claims end, or as the window
    # passes); what a Consumable one committed does not.
    by = "namespace, envelope, resource, contract"
    dashed = {
        "matcher": {"id": "byRegexp", "options": "^capacity .*"},
        "properties": [
            {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
        ],
    }
    return [
        row("Contracts"),
        timeseries(
            "Reusable and Replenishing: in use, peak and capacity",
            "What is in use now of each Reusable resource (held by claims and child envelopes, "
            "or lent; it all comes back as they end) and Replenishing resource (held, plus "
            "committed in the window; it comes back as the window passes), the most ever in "
            "use at once, and the capacity (the limit per window). In use at capacity while "
            "claims wait: ReservoirReusableSaturated, ReservoirReplenishingThrottled.",
            [
                (
                    f"max by ({by}) (reservoir_envelope_in_use{{{ENVELOPE}}})",
                    "in use {{namespace}}/{{envelope}} {{resource}} ({{contract}})",
                ),
                (
                    f"max by ({by}) (reservoir_envelope_peak_in_use{{{ENVELOPE}}})",
                    "peak {{namespace}}/{{envelope}} {{resource}} ({{contract}})",
                ),
                (
                    f"max by ({by}) (reservoir_envelope_capacity{{{ENVELOPE}, "
                    'state="capacity", contract=~"Reusable|Replenishing"})',
                    "capacity {{namespace}}/{{envelope}} {{resource}} ({{contract}})",
                ),
            ],
            overrides=[dashed],
            w=12,
        ),
        timeseries(
            "Waiting claims: shortfall by contract",
            "What the claim at the head of each envelope's queue is short of, per resource "
            "and contract. Reusable: it comes back as claims end (saturated). Consumable: "
            "short of more than held claims could return means spent "
            "(ReservoirBudgetExhausted). Replenishing: it comes back as the window passes "
            "(throttled).",
            [
                (
                    f"max by ({by}) (reservoir_envelope_shortfall{{{ENVELOPE}}}) > 0",
                    "{{contract}} {{namespace}}/{{envelope}} {{resource}}",
                )
            ],
            w=12,
        ),
        timeseries(
            "Replenishing: committed in the window",
            "What the claims of each Replenishing resource consumed that is still inside "
            "its window, against the limit: it returns to available as the window passes.",
            [
                (
                    "max by (namespace, envelope, resource) "
                    f"(reservoir_envelope_window_committed{{{ENVELOPE}}})",
                    "committed {{namespace}}/{{envelope}} {{resource}}",
                ),
                (
                    f"max by ({by}) (reservoir_envelope_capacity{{{ENVELOPE}, "
                    'state="capacity", contract="Replenishing"})',
                    "capacity {{namespace}}/{{envelope}} {{resource}}",
                ),
            ],
            overrides=[dashed],
            w=12,
        ),
        timeseries(
            "Reusable occupancy by settled claims",
            "Units of each Reusable resource held times seconds (GPU-seconds, "
            "permit-seconds), counted as claims settle, per second by workflow class: the "
            "average number of units settled claims held.",
            [
                (
                    rate("reservoir_claim_occupancy_seconds_total", NAMESPACE, "class, resource"),
                    "{{class}} {{resource}}",
                )
            ],
            w=12,
        ),
    ]


def latency_panels() -> list[Panel]:
    histograms = [
        (
            "Time to admit",
            "reservoir_claim_admission_wait_seconds",
            "Claim created → capacity reserved.",
        ),
        (
            "Time to commit",
            "reservoir_claim_commit_wait_seconds",
            "Capacity reserved → commit point.",
        ),
        (
            "Hold time",
            "reservoir_claim_hold_seconds",
            "Capacity reserved → settled.",
        ),
    ]
    panels = [row("Latency")]
    for title, metric, description in histograms:
        panels.append(
            timeseries(
                f"{title} p50 / p95 / p99",
                f"{description} Quantiles by workflow class.",
                quantiles(metric, "class", NAMESPACE, (0.5, 0.95, 0.99)),
                unit="s",
                w=8,
            )
        )
    return panels


def right_sizing_panels() -> list[Panel]:
    return [
        row("Right-sizing"),
        timeseries(
            "Consumed / reserved (C/R) p50 / p95",
            "Share of the reserved amount of Consumable and Replenishing resources that "
            "settled claims consumed, by workflow class and resource: a p95 well below 1 "
            "means the class asks for more than it uses (see `kubectl reservoir recommend "
            "CLASS`). Reusable resources consume nothing: see peak in use / capacity.",
            quantiles("reservoir_claim_consumed_ratio", "class, resource", NAMESPACE, (0.5, 0.95)),
            unit="percentunit",
            maximum=1,
            w=12,
        ),
        timeseries(
            "Peak in use / capacity",
            "Reusable and Replenishing resources: the most each envelope ever had in use at "
            "once (within one window, for Replenishing), as a share of its capacity (the "
            "limit). Right-sizing judges these by it, not by C/R: well below 1 means the "
            "envelope holds more than its workflow ever uses at once; 1 means claims may "
            "have waited.",
            [
                (
                    f"max by (namespace, envelope, resource, contract) "
                    f"(reservoir_envelope_peak_in_use{{{ENVELOPE}}}) "
                    "/ on (namespace, envelope, resource, contract) "
                    f"max by (namespace, envelope, resource, contract) "
                    f'(reservoir_envelope_capacity{{{ENVELOPE}, state="capacity"}})',
                    "{{namespace}}/{{envelope}} {{resource}} ({{contract}})",
                )
            ],
            unit="percentunit",
            w=12,
        ),
        timeseries(
            "Late reports and overruns",
            "Usage reported after settlement, and claims that consumed more than they "
            "reserved, per second by workflow class.",
            [
                (
                    rate("reservoir_claim_late_reports_total", NAMESPACE, "class"),
                    "late reports {{class}}",
                ),
                (
                    rate("reservoir_claim_overruns_total", NAMESPACE, "class"),
                    "overruns {{class}}",
                ),
            ],
            unit="ops",
            w=12,
        ),
    ]


def lease_panels() -> list[Panel]:
    return [
        row("Leases and transitions"),
        timeseries(
            "Lease renewals, refusals and expiries",
            "Lease renewals by result (granted, refused), and leases that expired by "
            "workflow class, per second.",
            [
                (
                    rate("reservoir_lease_renewals_total", NAMESPACE, "result"),
                    "renewals {{result}}",
                ),
                (
                    rate("reservoir_lease_expiries_total", NAMESPACE, "class"),
                    "expiries {{class}}",
                ),
            ],
            unit="ops",
            w=12,
        ),
        timeseries(
            "Claim transitions by reason",
            "Claim transitions and refusals per second, by reason.",
            [(rate("reservoir_claim_transitions_total", NAMESPACE, "reason"), "{{reason}}")],
            unit="ops",
            w=12,
        ),
    ]


def ledger_panels() -> list[Panel]:
    return [
        row("Ledger"),
        timeseries(
            "Ledger writes by result",
            "Compare-and-swap writes of envelope ledgers per second: written, conflict, "
            "unchanged, refused (alerts: ReservoirLedgerConflictsHigh, "
            "ReservoirLedgerWritesFailing).",
            [(rate("reservoir_ledger_writes_total", NAMESPACE, "result"), "{{result}}")],
            unit="ops",
            stacked=True,
            w=8,
        ),
        timeseries(
            "Ledger errors by reason",
            "Reconciles that could not move a ledger, per second by reason.",
            [(rate("reservoir_ledger_errors_total", NAMESPACE, "reason"), "{{reason}}")],
            unit="ops",
            w=8,
        ),
        timeseries(
            "Ledger reconcile p50 / p95 / p99",
            "Time to read, reconcile and write one envelope's ledger.",
            quantiles(
                "reservoir_ledger_reconcile_seconds", "namespace", NAMESPACE, (0.5, 0.95, 0.99)
            ),
            unit="s",
            w=8,
        ),
        timeseries(
            "Finalizer waits",
            "Deletions held back because their settlement is not recorded yet, per second by kind.",
            [(rate("reservoir_finalizer_waits_total", NAMESPACE, "kind"), "{{kind}}")],
            unit="ops",
            w=12,
        ),
        timeseries(
            "Operator versions",
            "Running operator processes by version (alert: ReservoirOperatorAbsent).",
            [("count by (version) (reservoir_build_info)", "{{version}}")],
            w=12,
        ),
    ]


def variable(name: str, label: str, query: str, *, hide: int = 0) -> dict[str, Any]:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-variable"},
        "refresh": 2,  # on time range change
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
        "hide": hide,
    }


def layout(panels: list[Panel]) -> list[Panel]:
    """Number the panels and place them left to right, wrapping at the grid's width."""
    placed = []
    x = y = row_height = 0
    for number, panel in enumerate(panels, start=1):
        panel = dict(panel)
        if panel["type"] == "row":
            w, h = WIDTH, 1
        else:
            w, h = panel.pop("w", WIDTH), panel.pop("h", 8)
        if x + w > WIDTH or panel["type"] == "row":
            x, y, row_height = 0, y + row_height, 0
        panel["id"] = number
        panel["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
        x, row_height = x + w, max(row_height, h)
        if panel["type"] == "row":
            x, y, row_height = 0, y + h, 0
        placed.append(panel)
    return placed


def dashboard() -> dict[str, Any]:
    """The Reservoir dashboard as Grafana's JSON model."""
    panels = [
        *capacity_panels(),
        *contract_panels(),
        *latency_panels(),
        *right_sizing_panels(),
        *lease_panels(),
        *ledger_panels(),
    ]
    return {
        "title": "Reservoir",
        "uid": "reservoir",
        "description": "Capacity held for branching AI workflows: envelopes, claims, leases "
        "and ledgers. Generated by `python -m reservoir.dashboard`; do not edit by hand.",
        "tags": ["reservoir", "kubernetes"],
        "editable": False,
        "graphTooltip": 1,  # shared crosshair
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "type": "datasource",
                    "name": "datasource",
                    "label": "Data source",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                variable(
                    "namespace", "Namespace", "label_values(reservoir_envelope_info, namespace)"
                ),
                variable(
                    "envelope",
                    "Envelope",
                    'label_values(reservoir_envelope_info{namespace=~"$namespace"}, envelope)',
                ),
                variable(
                    "resource",
                    "Resource",
                    f"label_values(reservoir_envelope_capacity{{{ENVELOPE}}}, resource)",
                ),
            ]
        },
        "panels": layout(panels),
    }


def render() -> str:
    return json.dumps(dashboard(), sort_keys=True, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print Reservoir's Grafana dashboard JSON.")
    parser.add_argument(
        "--check",
        type=Path,
        metavar="PATH",
        help="exit 1 if PATH differs from the generated dashboard (run `make dashboard`)",
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    if not args.check.exists() or args.check.read_text(encoding="utf-8") != text:
        print(f"out of date (run `make dashboard`): {args.check}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
