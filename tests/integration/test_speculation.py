"""Speculative copies with one winner, against the real operator (child-settlement.txt: "When
one attempt wins, cancel the others"): three copies of one branch, the operator killed -9
between two dispatches; one winner, two losers, each settled once by its own facts."""

from __future__ import annotations

from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle
from tests.integration.conftest import StartOperator
from tests.integration.helpers import (
    create_envelope,
    eventually,
    ledger_line,
    settled_ledger,
    wait_phase,
)


def test_three_copies_settle_one_winner_and_two_losers_across_a_kill_9(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    operator = start_operator()
    copies = {
        name: sdk.hold("wf", "search", {"tokens": "30"}, name=name, speculation_group="search")
        for name in ("a", "b", "c")
    }
    for name, claim in copies.items():
        copies[name] = wait_phase(sdk, claim, "Tentative")
    assert sdk.get("a").speculation_group == "search"

    sdk.dispatch(copies["b"])  # b reaches its commit point first ...
    operator.kill()  # ... and the operator dies, before or after it recorded that
    sdk.dispatch(sdk.get("c"))  # c was sent too, while nobody watched
    start_operator()

    # Whatever the dead operator recorded, c's dispatch is a fact: c ran, it is never
    # released as unrun; b < c, so b wins either way (the name breaks a tie).
    loser = wait_phase(sdk, "a", "Released")
    line = ledger_line(sdk, loser)
    assert line is not None and line.superseded_by == "b" and line.settlement is not None
    assert line.settlement.reason == "Superseded"
    sent_loser = eventually(
        "c told it lost",
        lambda: (line := ledger_line(sdk, "c")) is not None and line.superseded_by and line,
    )
    assert sent_loser.cancel_requested, "a cancel request: its usage settles it"
    assert ledger_line(sdk, "b").superseded_by is None  # type: ignore[union-attr]
    settled_ledger(sdk, "wf", reserved="60", available="40")

    sdk.finish(sdk.get("b"), {"tokens": "12"})
    sdk.finish(sdk.get("c"), {"tokens": "5"}, outcome="Cancelled")
    for name in ("b", "c"):
        wait_phase(sdk, name, "Consumed")
    settled_ledger(sdk, "wf", committed="17", reserved="0", available="83")
    for name in ("a", "b", "c"):
        history = sdk.history(name)
        assert sum(1 for move in history if move.to.terminal) == 1, (name, history)
