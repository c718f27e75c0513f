"""Serving classes (reservoir.core.serving_classes; client-disconnect.txt: interactive chat,
batch enrichment and agentic workflows are different policy problems): a class presets the
policy and the priority, the envelope's own fields override it, an unknown class is an error
that says which classes exist, and the operator checks an administrator's classes at start.
The CRD leaves the class's fields without defaults, so what an envelope set is what its
stored spec holds."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from reservoir import crdgen
from reservoir.core.model import DeadlineAction, QueueBoundAction, ReservationEnvelopeSpec
from reservoir.core.serving_classes import (
    BUILT_IN,
    CLASS_POLICY_FIELDS,
    UnknownServingClassError,
    effective_spec,
    parse_classes,
)
from tests.unit.sim import Sim

CRDS = Path(__file__).resolve().parents[2] / "crds"


def spec(**fields: Any) -> ReservationEnvelopeSpec:
    """As the operator reads a stored envelope: only what was set (no schema defaults)."""
    return ReservationEnvelopeSpec.model_validate({"capacity": {"tokens": "100"}, **fields})


def test_a_class_presets_the_policy_and_the_envelopes_own_fields_win() -> None:
    interactive = effective_spec(spec(servingClass="Interactive"), BUILT_IN)
    assert interactive.policy.default_lease_seconds == 30
    assert interactive.policy.at_ambiguity_deadline is DeadlineAction.RELEASE
    assert interactive.policy.queue_bound_seconds == 30 and interactive.priority == 100
    mine = effective_spec(
        spec(servingClass="Interactive", priority=5, policy={"defaultLeaseSeconds": 45}),
        BUILT_IN,
    )
    assert mine.policy.default_lease_seconds == 45, "the envelope's own field wins"
    assert mine.policy.max_queue_seconds == 30, "the rest from the class"
    assert mine.priority == 5
    batch = effective_spec(spec(servingClass="Batch"), BUILT_IN)
    assert batch.policy.at_queue_bound is QueueBoundAction.HOLD and batch.priority == -100
    plain = spec(policy={"defaultLeaseSeconds": 45})
    assert effective_spec(plain, BUILT_IN) is plain, "no class: unchanged"
    assert effective_spec(spec(), BUILT_IN).policy.default_lease_seconds == 60, "the default"


def test_an_unknown_class_says_which_exist() -> None:
    with pytest.raises(UnknownServingClassError, match=r"no class 'Gold'.*Agentic, Batch"):
        effective_spec(spec(servingClass="Gold"), BUILT_IN)


def test_an_administrators_classes_add_to_or_replace_the_built_in_ones_once_checked() -> None:
    classes = parse_classes(
        {
            "Realtime": {"priority": 200, "policy": {"defaultLeaseSeconds": 15}},
            "Batch": {"policy": {"maxQueueSeconds": 60}},
        }
    )
    assert set(classes) == {"Interactive", "Batch", "Agentic", "Realtime"}
    assert classes["Batch"].policy.max_queue_seconds == 60
    assert classes["Batch"].policy.default_lease_seconds is None, "replaced, not merged"
    with pytest.raises(ValueError, match=r"'Bad': policy\.defaultLeaseSeconds"):
        parse_classes({"Bad": {"policy": {"defaultLeaseSeconds": 0}}})
    with pytest.raises(ValueError, match=r"'Typo': policy\.leaseSeconds"):
        parse_classes({"Typo": {"policy": {"leaseSeconds": 10}}})


def test_the_crd_leaves_the_class_fields_without_defaults() -> None:
    """A default the API server filled in would always hide the class."""
    envelope = yaml.safe_load((CRDS / "reservoir.dev_reservationenvelopes.yaml").read_text())
    spec_schema = envelope["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    spec_schema = spec_schema["spec"]["properties"]
    policy = spec_schema["policy"]["properties"]
    for field in CLASS_POLICY_FIELDS:
        camel = crdgen.to_camel(field)
        assert "default" not in policy[camel], camel
    assert "default" not in spec_schema["priority"]
    assert policy["providerLookupMaxSeconds"].get("default") == 300, "others keep theirs"


def test_the_class_decides_a_claims_lease_in_the_core() -> None:
    """The pass sees the effective policy: an Interactive envelope's claim gets 30 s."""
    sim = Sim()
    sim.envelope = sim.envelope.__class__(
        **{
            **sim.envelope.__dict__,
            "spec": effective_spec(spec(servingClass="Interactive"), BUILT_IN),
        }
    )
    sim.create("a").reconcile()
    assert sim.entry("a").expires_at == sim.now + timedelta(seconds=30)


def test_the_operator_checks_the_classes_file_at_start(tmp_path: Path) -> None:
    bad = tmp_path / "classes.yaml"
    bad.write_text("Bad:\n  policy: {defaultLeaseSeconds: -1}\n")
    run = subprocess.run(
        [sys.executable, "-m", "reservoir.cli.operator", "--serving-classes", str(bad)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 2 and "--serving-classes: serving class 'Bad'" in run.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "reservoir.cli.operator", "--serving-classes", "/nonexistent"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert missing.returncode == 2 and "cannot read /nonexistent" in missing.stderr
