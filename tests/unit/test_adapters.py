"""The pure parts of the adapters: reading API objects into facts, the plugin's parsing."""

from __future__ import annotations

import pytest

from reservoir.cli.plugin import resources, table
from reservoir.k8s.facts import InvalidClaim, claim_facts, heartbeat_token
from reservoir.sdk import ReservoirError


def claim(**spec: object) -> dict[str, object]:
    return {
        "metadata": {
            "name": "x",
            "uid": "u-1",
            "creationTimestamp": "2026-11-29T10:00:00Z",
            "annotations": {"reservoir.dev/force-settle": "OPS-1"},
        },
        "spec": {"envelope": "wf", "requests": {"tokens": "20k"}, **spec},
        "status": {
            "phase": "Released",
            "settlement": {
                "key": "u-1/1/1",
                "phase": "Released",
                "reason": "Cancelled",
                "at": "2026-11-29T10:00:01Z",
            },
        },
    }


def test_a_claim_object_becomes_facts() -> None:
    facts = claim_facts(claim(dispatch=True), None)
    assert not isinstance(facts, InvalidClaim)
    assert facts.spec.dispatch and not facts.spec.cancel
    assert facts.spec.requests == {"tokens": 20000}
    assert facts.created_at.tzinfo is not None
    assert facts.settled_record is not None
    assert facts.settled_record.settlement is not None
    assert facts.settled_record.settlement.key == "u-1/1/1"
    assert (facts.force_settle, facts.deleting, facts.problem) == ("OPS-1", False, None)


def test_a_settlement_copied_from_another_claim_is_not_this_claims_record() -> None:
    body = claim()
    body["metadata"] = {**body["metadata"], "uid": "u-2"}  # type: ignore[dict-item]
    facts = claim_facts(body, None)
    assert not isinstance(facts, InvalidClaim) and facts.settled_record is None


def test_a_spec_the_operator_cannot_read_is_reported_not_acted_on() -> None:
    facts = claim_facts(claim(requests={"tokens": "-1"}), None)
    assert isinstance(facts, InvalidClaim)
    assert "requests.tokens" in facts.problem


def test_every_lease_renewal_changes_the_heartbeat_token() -> None:
    first = {"spec": {"renewTime": "2026-11-29T10:00:00.000001Z", "holderIdentity": "w1"}}
    again = {"spec": {"renewTime": "2026-11-29T10:00:00.000002Z", "holderIdentity": "w1"}}
    assert heartbeat_token(None) is None
    assert heartbeat_token({"spec": {}}) is None
    assert heartbeat_token(first) != heartbeat_token(again)
    assert heartbeat_token(first) == heartbeat_token(dict(first))


def test_plugin_resource_arguments() -> None:
    assert resources(["tokens=20k", "cost=1.5"]) == {"tokens": "20k", "cost": "1.5"}
    with pytest.raises(ReservoirError, match="RESOURCE=QUANTITY"):
        resources(["tokens"])
    # The last one won silently (a refund then a charge of tokens sent only the charge).
    with pytest.raises(ReservoirError, match="tokens is given twice"):
        resources(["tokens=-1", "tokens=+5"])


def test_plugin_tables_align() -> None:
    assert table([["A", "BB"], ["ccc", "d"]]).splitlines() == ["A    BB", "ccc  d"]


def test_device_attributes_become_the_resource_claims_selector() -> None:
    from reservoir.k8s.devices import device_selector, resource_claim_spec

    claim = {
        "metadata": {"name": "c", "namespace": "ns", "uid": "u-1"},
        "spec": {
            "envelope": "e",
            "placement": {"deviceAttributes": {"productName": "NVIDIA-H100-80GB-HBM3"}},
        },
    }
    body = resource_claim_spec(claim, {"nvidia.com/gpu": 2})
    exactly = body["spec"]["devices"]["requests"][0]["exactly"]
    assert exactly["count"] == 2 and exactly["deviceClassName"] == "gpu.reservoir.dev"
    assert exactly["selectors"][0]["cel"]["expression"] == (
        '"productName" in device.attributes["gpu.reservoir.dev"] && '
        'device.attributes["gpu.reservoir.dev"].productName == "NVIDIA-H100-80GB-HBM3"'
    )
    assert body["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert " && " in device_selector("nvidia.com/gpu", {"a": "1", "b": "2"})


def test_the_placeholder_goes_only_once_the_workload_pod_is_bound_and_reserved() -> None:
    """Found by the no-window audit: the scheduler puts a pod in reservedFor before it
    binds it (and takes it out if binding fails); deleting the placeholder then leaves
    reservedFor empty, and the controller manager frees the devices."""
    from reservoir.k8s.devices import _held_by_workload

    rc = {"status": {"allocation": {"devices": {}}, "reservedFor": [{"uid": "p"}, {"uid": "w"}]}}
    unbound = {"metadata": {"uid": "w"}, "spec": {}}
    bound = {"metadata": {"uid": "w"}, "spec": {"nodeName": "gpu-node-0"}}
    stranger = {"metadata": {"uid": "x"}, "spec": {"nodeName": "gpu-node-0"}}
    assert not _held_by_workload(rc, [unbound])
    assert not _held_by_workload(rc, [stranger])
    assert _held_by_workload(rc, [bound])
    assert not _held_by_workload({"status": {"reservedFor": [{"uid": "w"}]}}, [bound])


class PatchClient:
    """Answers a pod patch with the given status code (200: accepted)."""

    def __init__(self, code: int) -> None:
        self.code, self.patched = code, 0

    async def patch(self, *_: object, **__: object) -> None:
        from lightkube import ApiError
        from lightkube.models.meta_v1 import Status

        self.patched += 1
        if self.code != 200:
            raise ApiError(status=Status(code=self.code, message="refused (fake)"))


def test_sync_says_whether_every_recorded_hand_off_gate_is_lifted() -> None:
    """Issue 21 §3.5: a failed lift was only logged, and nothing brought the writer back
    before the lease lapsed. Now sync says so and the writer comes back soon."""
    import asyncio
    from typing import Any

    from reservoir.k8s.devices import DeviceHolder
    from reservoir.k8s.resources import HAND_OFF_GATE

    def gated(gates: list[str]) -> dict[str, Any]:
        meta = {"name": "w", "namespace": "t", "uid": "w"}
        return {"metadata": meta, "spec": {"schedulingGates": [{"name": g} for g in gates]}}

    def sync(code: int, pod: dict[str, Any]) -> tuple[bool, int]:
        client = PatchClient(code)
        holder = DeviceHolder(client, None)  # type: ignore[arg-type]
        lifted = asyncio.run(holder.sync({}, {}, {}, {}, {"c": [pod]}))
        return lifted, client.patched

    assert sync(500, gated([HAND_OFF_GATE])) == (False, 1)
    assert sync(200, gated([HAND_OFF_GATE])) == (True, 1)
    assert sync(404, gated([HAND_OFF_GATE])) == (True, 1), "a pod gone has no gate to lift"
    assert sync(500, gated(["someone-else"])) == (True, 0), "nothing of ours to lift"


def test_a_gated_pod_mounting_another_claims_devices_is_not_this_claims_workload() -> None:
    """Issue 21: a pod labelled for claim x but referencing claim y's ResourceClaim would be
    handed x's hold and have its gate lifted, then run on y's devices."""
    uid, other = "0f0e0d0c-0b0a-4909-8807-060504030201", "11111111-2222-4333-8444-555555555555"
    body = claim()
    body["metadata"]["uid"] = uid  # type: ignore[index]

    def gated(name: str, resource_claim: str) -> dict[str, object]:
        return {
            "metadata": {"name": name, "uid": f"pod-{name}", "creationTimestamp": "2026"},
            "spec": {
                "schedulingGates": [{"name": "reservoir.dev/hand-off"}],
                "resourceClaims": [{"name": "d", "resourceClaimName": resource_claim}],
            },
        }

    own, hostile = gated("own", f"reservoir-{uid}"), gated("hostile", f"reservoir-{other}")
    facts = claim_facts(body, None, [hostile])
    assert not isinstance(facts, InvalidClaim) and facts.pod is None
    facts = claim_facts(body, None, [hostile, own])
    assert not isinstance(facts, InvalidClaim) and facts.pod is not None
    assert facts.pod.gated_pod == "pod-own" and facts.pod.uids == frozenset({"pod-own"})
    # A ResourceClaim of the tenant's own (not Reservoir's) is the tenant's business.
    mine = gated("mine", "reservoir-scratch")
    facts = claim_facts(body, None, [mine])
    assert not isinstance(facts, InvalidClaim) and facts.pod is not None


def test_placement_hints_outside_the_allow_list_are_refused() -> None:
    from reservoir.k8s.devices import PlacementAllowList

    allowed = PlacementAllowList(
        toleration_keys=frozenset({"nvidia.com/gpu"}),
        node_label_keys=frozenset({"kubernetes.io/hostname", "zone"}),
    )
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    fine = {
        "tolerations": [gpu],
        "nodeSelector": {"kubernetes.io/hostname": "gpu-node-2"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In"}]}]
                },
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 1, "preference": {"matchExpressions": [{"key": "zone"}]}}
                ],
            }
        },
    }
    assert allowed.problem(fine) is None and allowed.problem({}) is None
    refused = {
        "toleration key '(none: every taint)' is not allowed": {
            "tolerations": [{"operator": "Exists"}]
        },
        "toleration key 'node-role.kubernetes.io/control-plane' is not allowed": {
            "tolerations": [gpu, {"key": "node-role.kubernetes.io/control-plane"}]
        },
        "nodeSelector key 'team' is not allowed": {"nodeSelector": {"team": "b"}},
        "podAffinity is not allowed": {"affinity": {"podAffinity": {"x": 1}}},
        "podAntiAffinity is not allowed": {"affinity": {"podAntiAffinity": {"x": 1}}},
        "nodeAffinity matchFields are not allowed": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name"}]}]
                    }
                }
            }
        },
        "nodeAffinity key 'team' is not allowed": {
            "affinity": {
                "nodeAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 1, "preference": {"matchExpressions": [{"key": "team"}]}}
                    ]
                }
            }
        },
    }
    for problem, hints in refused.items():
        assert allowed.problem(hints) == problem


async def test_the_operator_holds_nothing_on_refused_hints_and_says_why() -> None:
    """Issue 21: hints are copied onto a priority-1,000,000 pod; with an allow-list (the
    chart's --restrict-placement) refused ones create neither the ResourceClaim nor the
    placeholder, and the claim's queue reason names the refusal."""
    from collections.abc import AsyncIterator

    from reservoir.k8s.claim_source import claim_record
    from reservoir.k8s.devices import DeviceHolder, PlacementAllowList

    body = {
        "metadata": {"name": "c", "namespace": "ns", "uid": "u-1"},
        "spec": {"envelope": "e", "placement": {"tolerations": [{"operator": "Exists"}]}},
    }

    class Recording:
        """Answers the fresh read of the claim (a LIST by name); records creations."""

        def __init__(self) -> None:
            self.created: list[str] = []

        def list(self, *_: object, **__: object) -> AsyncIterator[dict[str, object]]:
            async def listing() -> AsyncIterator[dict[str, object]]:
                yield body

            return listing()

        async def create(self, obj: object, namespace: str) -> None:
            self.created.append(type(obj).__name__)

    client = Recording()
    holder = DeviceHolder(client, "reservoir-placeholder", PlacementAllowList())  # type: ignore[arg-type]
    # The writer's record keeps no hints: the allow-list is checked on the fresh read.
    record = claim_record(body)
    assert "placement" not in record["spec"]
    await holder.sync({"u-1": record}, {"u-1": {"nvidia.com/gpu": 1}}, {}, {})
    assert client.created == []
    waiting = holder.facts({}, {})["u-1"].waiting
    assert waiting is not None and waiting.startswith(
        "spec.placement refused by the administrator's allow-list: toleration key"
    )
    # Without an allow-list (a local run without the chart) the hints are copied.
    open_holder = DeviceHolder(client, "reservoir-placeholder")  # type: ignore[arg-type]
    await open_holder.sync({"u-1": record}, {"u-1": {"nvidia.com/gpu": 1}}, {}, {})
    assert client.created == ["ResourceClaim", "Pod"]
