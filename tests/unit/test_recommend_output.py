"""`kubectl reservoir recommend`: each claim is read with its envelope's contracts, each
envelope's peak use is a sample, and every line says which contract it is judged by."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, cast

from reservoir.cli.plugin import recommendation, recommendation_json, show_recommendation
from reservoir.core.model import LedgerEntry, ReservationEnvelopeStatus
from reservoir.sdk import EnvelopeView, Reservoir

GPU = "nvidia.com/gpu"
AT = datetime(2026, 12, 1, tzinfo=UTC)


def envelope(name: str, peak: str, phase: str = "Closed") -> EnvelopeView:
    status = ReservationEnvelopeStatus.model_validate(
        {
            "phase": phase,
            "totals": {"capacity": {GPU: "8", "tokens": "100k", "rpm": "60"}},
            "contracts": {GPU: "Reusable", "tokens": "Consumable", "rpm": "Replenishing"},
            "peak": {GPU: peak, "rpm": "30"},
        }
    )
    return EnvelopeView(name=name, namespace="ns", status=status)


def settled(tokens: str) -> LedgerEntry:
    """A claim of 4 GPUs, 20k tokens and 5 requests that used 4 GPUs, `tokens` and 2
    requests: its GPUs came back whole (C = 0 for a Reusable resource)."""
    return LedgerEntry.model_validate(
        {
            "claim": "c",
            "phase": "Consumed",
            "reserved": {GPU: "4", "tokens": "20k", "rpm": "5"},
            "usage": {GPU: "4", "tokens": tokens, "rpm": "2"},
            "consumed": {GPU: "0", "tokens": tokens, "rpm": "2"},
            "released": {GPU: "4", "tokens": "1", "rpm": "3"},
            "occupancy": {GPU: "400"},
            "settlement": {"key": "k", "phase": "Consumed", "reason": "Completed", "at": AT},
        }
    )


class Stub:
    """The two reads `recommendation` makes through the SDK."""

    namespace = "ns"

    def __init__(self, views: list[EnvelopeView], records: Mapping[str, list[LedgerEntry]]):
        self.views, self.records = views, records

    def envelopes(self, labels: Mapping[str, str], all_namespaces: bool) -> list[EnvelopeView]:
        return self.views

    def settled_records(self, name: str, namespace: str | None = None) -> list[LedgerEntry]:
        return self.records[name]


def report() -> dict[str, Any]:
    # peaks sorted [2, 4, 4, 8, 8, 8] (n = 6): p50 = 3rd, p95 = 6th; the Pending one is
    # not a sample (it never opened).
    views = [envelope(f"e{i}", p) for i, p in enumerate(["4", "8", "2", "8", "4", "8"])]
    views.append(envelope("waiting", "0", phase="Pending"))
    records = {
        v.name: [settled(t)]
        for v, t in zip(views, ["5k", "6k", "7k", "8k", "9k", "10k", "1"], strict=True)
    }
    sdk = cast(Reservoir, Stub(views, records))
    found, rec = recommendation(sdk, "gpu-jobs", False)
    return {
        "json": json.loads(recommendation_json("gpu-jobs", "ns", found, rec)),
        "table": show_recommendation("gpu-jobs", "ns", found, rec),
    }


def test_recommend_judges_each_resource_by_its_envelopes_contract() -> None:
    shown = report()["json"]
    assert shown["claims"] == 7 and shown["peakEnvelopes"] == 6
    # Only tokens are judged by C against R: the GPUs' C = 0 and rpm's window are not.
    (tokens,) = shown["resources"]
    assert (tokens["resource"], tokens["contract"], tokens["samples"]) == (
        "tokens",
        "Consumable",
        7,
    )
    assert tokens["judgedBy"] == "consumed C against reserved R per claim"
    assert tokens["suggestedRequest"] == "10000"
    gpu, rpm = shown["capacities"]
    assert {k: v for k, v in gpu.items() if k != "explanation"} == {
        "resource": GPU,
        "contract": "Reusable",
        "judgedBy": "peak concurrent use against capacity per envelope",
        "envelopes": 6,
        "p50Peak": "4",
        "p95Peak": "8",
        "maxPeak": "8",
        "p50Capacity": "8",
        "p50PeakRatio": "0.5",
        "p95PeakRatio": "1",
        "atCapacity": 3,
        "suggests": "capacity",
        "suggested": "8",
    }
    assert "3 of 6 envelopes reached their capacity" in gpu["explanation"]
    assert (rpm["resource"], rpm["contract"], rpm["suggests"]) == (
        "rpm",
        "Replenishing",
        "limit per window",
    )
    assert (rpm["p95Peak"], rpm["p95PeakRatio"], rpm["suggested"]) == ("30", "0.5", "30")


def test_recommend_table_names_each_lines_contract() -> None:
    lines = report()["table"].splitlines()
    assert "7 settled Consumed claim(s) counted" in lines[0]
    assert "Consumable: consumed C against reserved R per claim" in lines
    at = lines.index(
        "Reusable and Replenishing: peak use against capacity (the limit per window) per "
        "envelope, over 6 opened envelope(s)"
    )
    assert lines[at + 2].split()[:3] == ["RESOURCE", "CONTRACT", "ENVELOPES"]
    assert lines[at + 3].split() == [
        GPU,
        "Reusable",
        "6",
        "4",
        "8",
        "8",
        "1",
        "3",
        "8",
        "(capacity)",
    ]
    assert lines[at + 4].split() == [
        "rpm", "Replenishing", "6", "30", "30", "60", "0.5", "0", "30", "(limit", "per", "window)"
    ]  # fmt: skip
    assert any(line.startswith(f"{GPU} (Reusable): p95 of the peak in use") for line in lines)
    assert any(line.startswith("tokens (Consumable): p95 of consumed over 7") for line in lines)
    assert all(not line.startswith(f"{GPU}:") for line in lines)  # no C/R line for GPUs
