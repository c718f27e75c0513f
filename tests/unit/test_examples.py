"""The examples' manifests are valid against the models the CRDs are generated from, keep
the rules the CRDs' CEL adds (contracts name capacity resources, a device resource is
Reusable, windowSeconds iff Replenishing), and show what the README says they show: two
8-GPU branches in an 8-GPU envelope, a concurrency permit per branch, a rate limit that
refills within the demo's run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from reservoir.core.model import (
    DEFAULT_REUSABLE,
    DEVICE_CLASSES,
    BranchClaimSpec,
    ContractType,
    ReservationEnvelopeSpec,
)
from reservoir.core.quantity import parse_quantity, parse_resources

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def contract_of(spec: ReservationEnvelopeSpec, resource: str) -> ContractType:
    declared = spec.contracts.get(resource)
    if declared is not None:
        return declared.type
    return ContractType.REUSABLE if resource in DEFAULT_REUSABLE else ContractType.CONSUMABLE


def valid_envelope(obj: dict[str, Any]) -> ReservationEnvelopeSpec:
    """The envelope's spec as the API server would take it: the model, and the CEL rules
    on contracts the model does not run."""
    assert obj["apiVersion"] == "reservoir.dev/v1alpha1" and obj["kind"] == "ReservationEnvelope"
    spec = ReservationEnvelopeSpec.model_validate(obj["spec"])
    assert set(spec.contracts) <= set(spec.capacity), "contracts name resources of the capacity"
    for name, contract in spec.contracts.items():
        replenishing = contract.type is ContractType.REPLENISHING
        assert (contract.window_seconds is not None) == replenishing, name
        if name in DEVICE_CLASSES:
            assert contract.type is ContractType.REUSABLE, name
    return spec


def yaml_documents() -> list[dict[str, Any]]:
    return [
        doc
        for path in sorted(EXAMPLES.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def test_the_yaml_examples_are_valid_and_their_claims_fit_their_envelope() -> None:
    docs = yaml_documents()
    envelopes = {
        d["metadata"]["name"]: valid_envelope(d) for d in docs if d["kind"] == "ReservationEnvelope"
    }
    claims = [BranchClaimSpec.model_validate(d["spec"]) for d in docs if d["kind"] == "BranchClaim"]
    assert envelopes and claims
    for claim in claims:
        capacity = envelopes[claim.envelope].capacity
        assert set(claim.requests) <= set(capacity)
        assert all(claim.requests[r] <= capacity[r] for r in claim.requests)
    research = envelopes["research-agent"]
    assert contract_of(research, "concurrency") is ContractType.REUSABLE
    assert contract_of(research, "tokens") is ContractType.CONSUMABLE
    assert all(claim.requests["concurrency"] == 1 for claim in claims)


def test_the_gpu_example_runs_two_whole_envelope_branches_in_an_8_gpu_envelope() -> None:
    gpu = example("gpu_branch")
    spec = valid_envelope(gpu.envelope("demo"))
    requests = parse_resources(gpu.REQUESTS)
    assert spec.capacity["nvidia.com/gpu"] == 8 == requests["nvidia.com/gpu"]
    assert contract_of(spec, "nvidia.com/gpu") is ContractType.REUSABLE
    # Two branches' tokens fit: the second is admitted once the first one's GPUs return.
    assert 2 * parse_resources(gpu.USAGE)["tokens"] + requests["tokens"] <= spec.capacity["tokens"]


def test_the_agent_workflow_holds_a_concurrency_permit_per_branch() -> None:
    agent = example("agent_workflow")
    spec = valid_envelope(agent.envelope("demo"))
    assert contract_of(spec, "concurrency") is ContractType.REUSABLE
    assert spec.capacity["concurrency"] == agent.PERMITS < len(agent.TOOLS)
    assert parse_quantity(agent.REQUESTS["concurrency"]) == 1
    assert len(agent.FOLLOW_UPS) == agent.PERMITS  # every permit is reused after the first step


def test_the_rate_limit_example_refills_within_the_demos_run() -> None:
    limit = example("provider_rate_limit")
    spec = valid_envelope(limit.envelope("demo"))
    contract = spec.contracts["requests"]
    assert contract.type is ContractType.REPLENISHING
    assert contract.window_seconds == limit.WINDOW_SECONDS <= 30
    assert spec.capacity["requests"] == limit.LIMIT


@pytest.mark.parametrize("declared", [{"nvidia.com/gpu": {"type": "Consumable"}}])
def test_the_check_refuses_what_the_crd_refuses(declared: dict[str, Any]) -> None:
    obj = example("gpu_branch").envelope("demo")
    obj["spec"]["contracts"] = declared
    with pytest.raises(AssertionError):
        valid_envelope(obj)
