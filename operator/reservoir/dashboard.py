"""Generate Reservoir's Grafana dashboard from code (never edit the JSON by hand).

    python -m reservoir.dashboard                 # print the dashboard JSON
    python -m reservoir.dashboard --check PATH    # exit 1 if PATH differs from it

The dashboard is built with Grafana's typed builder, `grafana-foundation-sdk` (Apache-2.0;
Grafana itself is not used): panels, queries, overrides and variables are its typed
builders, so a misspelt option or a wrong type fails mypy instead of giving a panel Grafana
silently ignores. The builder lays the panels out on Grafana's 24-column grid.

`make dashboard` writes charts/reservoir/files/grafana-dashboard.json, which the chart ships
(and a test keeps equal to this module's output). The panels query only the metrics that
reservoir.metrics declares: per-envelope gauges filtered by the namespace and envelope
variables, per-class counters and histograms by the namespace variable, pool gauges by the
pool variable; tests/integration/test_metrics.py evaluates every query against a real
operator's scrape.

Every operator replica exports the per-envelope gauges (reservoir_envelope_*) of the envelopes
it has reconciled: the active one, and a paused one for up to 90 s after it stopped. Panels
over them first take the `max by` (or `min by`) the envelope's identifying labels, so that
two replicas' copies of one envelope are not counted twice, and only then sum over
envelopes. The same holds for the pool gauges and the live-age gauge histogram.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as common_builder
from grafana_foundation_sdk.builders import dashboard as board_builder
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    DynamicConfigValue,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
ENVELOPE = 'namespace=~"$namespace", envelope=~"$envelope"'
NAMESPACE = 'namespace=~"$namespace"'
POOL = 'pool=~"$pool"'
REFS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

# A series drawn dashed: the capacity a stack or a use is measured against, an overdue time.
DASHED = [
    DynamicConfigValue(
        id_val="custom.lineStyle",
        value=common_builder.LineStyle().fill("dash").dash([10, 10]).build(),
    )
]

Targets = Sequence[tuple[str, str]]


def timeseries_panel(
    title: str,
    description: str,
    targets: Targets,
    *,
    unit: str = "short",
    stacked: bool = False,
    minimum: float | None = 0,
    maximum: float | None = None,
    width: int = 12,
    height: int = 8,
) -> timeseries.Panel:
    """A time series panel of `targets` (expression, legend), lines or stacked areas, with a
    table legend of the last values."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .draw_style(common.GraphDrawStyle.LINE)
        .line_width(1)
        .fill_opacity(20 if stacked else 0)
        .show_points(common.VisibilityMode.NEVER)
        .stacking(
            common_builder.StackingConfig()
            .group("A")
            .mode(common.StackingMode.NORMAL if stacked else common.StackingMode.NONE)
        )
        .legend(
            common_builder.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.RIGHT)
            .show_legend(True)
            .calcs(["lastNotNull"])
        )
        .tooltip(
            common_builder.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.MULTI)
            .sort(common.SortOrder.DESCENDING)
        )
    )
    if minimum is not None:
        panel = panel.min(minimum)
    if maximum is not None:
        panel = panel.max(maximum)
    for ref, (expr, legend) in zip(REFS, targets, strict=False):
        panel = panel.with_target(
            prometheus.Dataquery()
            .datasource(DATASOURCE)
            .expr(expr)
            .legend_format(legend)
            .range()
            .ref_id(ref)
        )
    return panel


def quantiles(metric: str, by: str, selector: str, qs: tuple[float, ...]) -> list[tuple[str, str]]:
    """histogram_quantile targets for `metric` (a histogram's base name), one per quantile."""
    targets = []
    for q in qs:
        rate = f"rate({metric}_bucket{{{selector}}}[$__rate_interval])"
        expr = f"histogram_quantile({q}, sum by (le, {by}) ({rate}))"
        targets.append((expr, f"p{round(q * 100)} {legend_of(by)}"))
    return targets


def legend_of(by: str) -> str:
    return " ".join("{{" + name.strip() + "}}" for name in by.split(","))


def rate(metric: str, selector: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[$__rate_interval]))"


def capacity_panels(board: board_builder.Dashboard) -> board_builder.Dashboard:
    # One panel per resource (repeated over the resource variable): the four ledger states
    # stack up to the envelope's capacity, drawn as a dashed line on top.
    capacity_line = [
        DynamicConfigValue(
            id_val="custom.stacking",
            value=common_builder.StackingConfig().group("A").mode(common.StackingMode.NONE).build(),
        ),
        DynamicConfigValue(id_val="custom.fillOpacity", value=0),
        *DASHED,
        DynamicConfigValue(id_val="color", value={"fixedColor": "text", "mode": "fixed"}),
    ]
    return (
        board.with_row(board_builder.Row("Capacity"))
        .with_panel(
            timeseries_panel(
                "Capacity by state: $resource",
                "Envelope capacity of one resource by ledger state, summed over the selected "
                "envelopes: reserved, committed, reconciling and available stack up to "
                "capacity.",
                [
                    (
                        "sum by (state) (max by (namespace, envelope, resource, state) "
                        f'(reservoir_envelope_capacity{{{ENVELOPE}, resource="$resource"}}))',
                        "{{state}}",
                    )
                ],
                stacked=True,
            )
            .override_by_name("capacity", capacity_line)
            .repeat("resource")
            .repeat_direction("h")
            .max_per_row(2)
        )
        .with_panel(
            timeseries_panel(
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
            )
        )
        .with_panel(
            timeseries_panel(
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
            )
        )
        .with_panel(
            timeseries_panel(
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
            )
        )
        .with_panel(
            timeseries_panel(
                "Finalizer waits: age and overdue",
                "Age of the oldest claim deletion still waiting on the settlement finalizer, "
                "and how long the earliest waiting deletion is past its due time (at once "
                "before the commit point, else the ambiguity deadline after its lease ends or "
                "it detaches: a deleted Committed claim waits its lease out first). Alert: "
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
                width=24,
            ).override_by_regexp("^overdue .*", DASHED)
        )
    )


def live_panels(board: board_builder.Dashboard) -> board_builder.Dashboard:
    """Open reservations as they are now, not only once settled (issue 25)."""
    return (
        board.with_row(board_builder.Row("Live reservations"))
        .with_panel(
            timeseries_panel(
                "Held by open claims by phase: $resource",
                "What the selected envelopes' open claims reserve of one resource, by claim "
                "phase: Tentative (before the commit point), Committed and Running (past it), "
                "Detached (reconciling: the outcome is unknown).",
                [
                    (
                        "sum by (phase) (max by (namespace, envelope, resource, phase) "
                        "(reservoir_envelope_claims_reserved"
                        f'{{{ENVELOPE}, resource="$resource"}}))',
                        "{{phase}}",
                    )
                ],
                stacked=True,
            )
            .repeat("resource")
            .repeat_direction("h")
            .max_per_row(2)
        )
        .with_panel(
            timeseries_panel(
                "Open reservations: age p50 / p90 / max by class",
                "Ages of the reservations open now (since each claim first reserved), by "
                "workflow class: a gauge histogram taken at each scrape, so it falls as claims "
                "settle (alert: ReservoirReservationOlderThanExpected on each envelope's "
                "oldest).",
                [
                    (
                        f"histogram_quantile({q}, sum by (le, class) (max by (le, namespace, "
                        f"class) (reservoir_claim_open_age_seconds_bucket{{{NAMESPACE}}})))",
                        f"{label} {{{{class}}}}",
                    )
                    for q, label in ((0.5, "p50"), (0.9, "p90"), (1, "max"))
                ],
                unit="s",
            )
        )
        .with_panel(
            timeseries_panel(
                "Oldest open reservation per envelope",
                "How long ago the oldest claim of each envelope that still holds capacity "
                "first reserved it (renewals never move it).",
                [
                    (
                        "time() - max by (namespace, envelope) "
                        "(reservoir_envelope_oldest_reservation_timestamp_seconds"
                        f"{{{ENVELOPE}}})",
                        "oldest {{namespace}}/{{envelope}}",
                    ),
                ],
                unit="s",
            )
        )
        .with_panel(
            timeseries_panel(
                "Leases: least time left and stalest grant",
                "Per envelope, the least time left on any open lease (dashed; below 0 a lapse "
                "not recorded yet) and the longest time since an open lease was granted or "
                "renewed. A replica that still shows an envelope it stopped reconciling shows "
                "older grants: the freshest view is taken (max time left, min age).",
                [
                    (
                        "max by (namespace, envelope) "
                        f"(reservoir_envelope_lease_remaining_seconds{{{ENVELOPE}}})",
                        "left {{namespace}}/{{envelope}}",
                    ),
                    (
                        "min by (namespace, envelope) "
                        f"(reservoir_envelope_lease_age_seconds{{{ENVELOPE}}})",
                        "since grant {{namespace}}/{{envelope}}",
                    ),
                ],
                unit="s",
                minimum=None,  # a lease past its expiry, not yet recorded, has less than 0
            ).override_by_regexp("^left .*", DASHED)
        )
        .with_panel(
            timeseries_panel(
                "Lease renewal margin p5 / p50",
                "How much of its lease a claim had left when a renewal was granted, by "
                "workflow class. Near 0: workers heartbeat too late for their lease; raise the "
                "lease or heartbeat more often before leases start to lapse.",
                quantiles(
                    "reservoir_lease_renewal_margin_seconds", "class", NAMESPACE, (0.05, 0.5)
                ),
                unit="s",
                width=8,
            )
        )
        .with_panel(
            timeseries_panel(
                "Released and expired amounts by reason",
                "What settled claims returned to their envelopes (R - C) per second, by "
                "resource and settlement reason: LeaseExpired is what expired leases gave back.",
                [
                    (
                        rate("reservoir_claim_released_total", NAMESPACE, "reason, resource"),
                        "{{reason}} {{resource}}",
                    )
                ],
                width=8,
            )
        )
        .with_panel(
            timeseries_panel(
                "Cancels: after dispatch and confirmation p50 / p95",
                "How long after its commit point (dispatch) a claim was cancelled, and how "
                "long the provider took to confirm a cancel (its answer Cancelled), by "
                "workflow class.",
                [
                    *quantiles(
                        "reservoir_claim_cancel_after_dispatch_seconds",
                        "class",
                        NAMESPACE,
                        (0.5, 0.95),
                    ),
                    *(
                        (expr, f"confirmed {legend}")
                        for expr, legend in quantiles(
                            "reservoir_claim_cancel_confirmation_seconds",
                            "class",
                            NAMESPACE,
                            (0.5, 0.95),
                        )
                    ),
                ],
                unit="s",
                width=8,
            )
        )
    )


def pool_panels(board: board_builder.Dashboard) -> board_builder.Dashboard:
    return (
        board.with_row(board_builder.Row("Pools"))
        .with_panel(
            timeseries_panel(
                "Pool capacity by state",
                "Each selected pool's totals by resource: reserved (held by its open "
                "envelopes), committed (what closed ones used) and available, against its "
                "capacity.",
                [
                    (
                        f"max by (pool, resource, state) (reservoir_pool_capacity{{{POOL}}})",
                        "{{pool}} {{resource}} {{state}}",
                    )
                ],
            )
        )
        .with_panel(
            timeseries_panel(
                "Pool envelopes: admitted and waiting",
                "Root envelopes drawing on each selected pool: reserved (admitted) and pending "
                "(waiting for admission). Waiting long while the pool is near full: alert "
                "ReservoirPoolSaturated.",
                [
                    (
                        "sum by (pool, state) (max by (pool, namespace, state) "
                        f"(reservoir_pool_envelopes{{{POOL}}}))",
                        "{{pool}} {{state}}",
                    )
                ],
                stacked=True,
            )
        )
        .with_panel(
            timeseries_panel(
                "Fair share by namespace",
                "Each namespace's weighted dominant share of each selected pool: the largest "
                "fraction of any one resource its open envelopes hold, divided by its weight. "
                "The pool admits the lowest first, so under saturation the lines level out; "
                "one staying above the others holds what it was admitted before the others "
                "came, or what a guarantee keeps for it.",
                [
                    (
                        f"max by (pool, namespace) (reservoir_pool_namespace_share{{{POOL}}})",
                        "{{pool}} {{namespace}}",
                    )
                ],
                unit="percentunit",
                width=24,
            )
        )
    )


def contract_panels(board: board_builder.Dashboard) -> board_builder.Dashboard:
    # Each resource keeps a contract (README "Resource contracts"): what is in use of a
    # Reusable or Replenishing resource comes back (as claims end, or as the window
    # passes); what a Consumable one committed does not.
    by = "namespace, envelope, resource, contract"
    return (
        board.with_row(board_builder.Row("Contracts"))
        .with_panel(
            timeseries_panel(
                "Reusable and Replenishing: in use, peak and capacity",
                "What is in use now of each Reusable resource (held by claims and child "
                "envelopes, or lent; it all comes back as they end) and Replenishing resource "
                "(held, plus committed in the window; it comes back as the window passes), the "
                "most ever in use at once, and the capacity (the limit per window). In use at "
                "capacity while claims wait: ReservoirReusableSaturated, "
                "ReservoirReplenishingThrottled.",
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
            ).override_by_regexp("^capacity .*", DASHED)
        )
        .with_panel(
            timeseries_panel(
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
            )
        )
        .with_panel(
            timeseries_panel(
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
            ).override_by_regexp("^capacity .*", DASHED)
        )
        .with_panel(
            timeseries_panel(
                "Reusable occupancy by settled claims",
                "Units of each Reusable resource held times seconds (GPU-seconds, "
                "permit-seconds), counted as claims settle, per second by workflow class: the "
                "average number of units settled claims held.",
                [
                    (
                        rate(
                            "reservoir_claim_occupancy_seconds_total", NAMESPACE, "class, resource"
                        ),
                        "{{class}} {{resource}}",
                    )
                ],
            )
        )
    )


def latency_panels(board: board_builder.Dashboard) -> board_builder.Dashboard:
    histograms = [
        ("Time to admit", "reservoir_claim_admission_wait_seconds", "Claim created → reserved."),
        ("Time to commit", "reservoir_claim_commit_wait_seconds", "Reserved → commit point."),
        (
            "Hold time",
            "reservoir_claim_hold_seconds",
            "Capacity reserved → settled, branches that ran.",
        ),
    ]
    board = board.with_row(board_builder.Row("Latency"))
    for title, metric, description in histograms:
        board = board.with_panel(
            timeseries_panel(
                f"{title} p50 / p95 / p99",
                f"{description} Quantiles by workflow class.",
                quantiles(metric, "class", NAMESPACE, (0.5, 0.95, 0.99)),
                unit="s",
                width=8,
            )
        )
    return board


def right_sizing_panels(board: board_builder.Dashboard) -> board_builder.Dashboard:
    return (
        board.with_row(board_builder.Row("Right-sizing"))
        .with_panel(
            timeseries_panel(
                "Consumed / reserved (C/R) p50 / p95",
                "Share of the reserved amount of Consumable and Replenishing resources that "
                "settled claims consumed, by workflow class and resource: a p95 well below 1 "
                "means the class asks for more than it uses (see `kubectl reservoir recommend "
                "CLASS`). Reusable resources consume nothing: see peak in use / capacity.",
                quantiles(
                    "reservoir_claim_consumed_ratio", "class, resource", NAMESPACE, (0.5, 0.95)
                ),
                unit="percentunit",
                maximum=1,
            )
        )
        .with_panel(
            timeseries_panel(
                "Peak in use / capacity",
                "Reusable and Replenishing resources: the most each envelope ever had in use "
                "at once (within one window, for Replenishing), as a share of its capacity "
                "(the limit). Right-sizing judges these by it, not by C/R: well below 1 means "
                "the envelope holds more than its workflow ever uses at once; 1 means claims "
                "may have waited.",
                [
                    (
                        "max by (namespace, envelope, resource, contract) "
                        f"(reservoir_envelope_peak_in_use{{{ENVELOPE}}}) "
                        "/ on (namespace, envelope, resource, contract) "
                        "max by (namespace, envelope, resource, contract) "
                        f'(reservoir_envelope_capacity{{{ENVELOPE}, state="capacity"}})',
                        "{{namespace}}/{{envelope}} {{resource}} ({{contract}})",
                    )
                ],
                unit="percentunit",
            )
        )
        .with_panel(
            timeseries_panel(
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
                width=24,
            )
        )
    )


def lease_panels(board: board_builder.Dashboard) -> board_builder.Dashboard:
    return (
        board.with_row(board_builder.Row("Leases and transitions"))
        .with_panel(
            timeseries_panel(
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
            )
        )
        .with_panel(
            timeseries_panel(
                "Claim transitions by reason",
                "Claim transitions and refusals per second, by reason.",
                [(rate("reservoir_claim_transitions_total", NAMESPACE, "reason"), "{{reason}}")],
                unit="ops",
            )
        )
    )


def ledger_panels(board: board_builder.Dashboard) -> board_builder.Dashboard:
    return (
        board.with_row(board_builder.Row("Ledger"))
        .with_panel(
            timeseries_panel(
                "Ledger writes by result",
                "Compare-and-swap writes of envelope ledgers per second: written, conflict, "
                "unchanged, refused (alerts: ReservoirLedgerConflictsHigh, "
                "ReservoirLedgerWritesFailing).",
                [(rate("reservoir_ledger_writes_total", NAMESPACE, "result"), "{{result}}")],
                unit="ops",
                stacked=True,
                width=8,
            )
        )
        .with_panel(
            timeseries_panel(
                "Ledger errors by reason",
                "Reconciles that could not move a ledger, per second by reason.",
                [(rate("reservoir_ledger_errors_total", NAMESPACE, "reason"), "{{reason}}")],
                unit="ops",
                width=8,
            )
        )
        .with_panel(
            timeseries_panel(
                "Ledger reconcile p50 / p95 / p99",
                "Time to read, reconcile and write one envelope's ledger.",
                quantiles(
                    "reservoir_ledger_reconcile_seconds", "namespace", NAMESPACE, (0.5, 0.95, 0.99)
                ),
                unit="s",
                width=8,
            )
        )
        .with_panel(
            timeseries_panel(
                "Finalizer waits",
                "Deletions held back because their settlement is not recorded yet, per second "
                "by kind.",
                [(rate("reservoir_finalizer_waits_total", NAMESPACE, "kind"), "{{kind}}")],
                unit="ops",
            )
        )
        .with_panel(
            timeseries_panel(
                "Operator versions",
                "Running operator processes by version (alert: ReservoirOperatorAbsent).",
                [("count by (version) (reservoir_build_info)", "{{version}}")],
            )
        )
    )


def variable(name: str, label: str, query: str) -> board_builder.QueryVariable:
    """A multi-value query variable over label values, all selected by default."""
    return (
        board_builder.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query({"query": query, "refId": f"{name}-variable"})
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .all_value(".*")
        .multi(True)
        .current(VariableOption(selected=True, text=["All"], value=["$__all"]))
        .sort(VariableSort.ALPHABETICAL_ASC)
    )


def builder() -> board_builder.Dashboard:
    """The Reservoir dashboard, as the SDK's builder."""
    board = (
        board_builder.Dashboard("Reservoir")
        .uid("reservoir")
        .description(
            "Capacity held for branching AI workflows: envelopes, claims, leases, pools and "
            "ledgers. Generated by `python -m reservoir.dashboard`; do not edit by hand."
        )
        .tags(["reservoir", "kubernetes"])
        .readonly()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .version(1)
        .time("now-6h", "now")
        .refresh("30s")
        .timezone("browser")
        .with_variable(
            board_builder.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        .with_variable(
            variable("namespace", "Namespace", "label_values(reservoir_envelope_info, namespace)")
        )
        .with_variable(
            variable(
                "envelope",
                "Envelope",
                'label_values(reservoir_envelope_info{namespace=~"$namespace"}, envelope)',
            )
        )
        .with_variable(
            variable(
                "resource",
                "Resource",
                f"label_values(reservoir_envelope_capacity{{{ENVELOPE}}}, resource)",
            )
        )
        .with_variable(variable("pool", "Pool", "label_values(reservoir_pool_capacity, pool)"))
    )
    for section in (
        capacity_panels,
        live_panels,
        pool_panels,
        contract_panels,
        latency_panels,
        right_sizing_panels,
        lease_panels,
        ledger_panels,
    ):
        board = section(board)
    return board


def dashboard() -> dict[str, Any]:
    """The Reservoir dashboard as Grafana's JSON model, panels numbered in order."""
    model: dict[str, Any] = json.loads(json.dumps(builder().build(), cls=JSONEncoder))
    for number, panel in enumerate(model["panels"], start=1):
        panel["id"] = number
    return model


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
