"""Device holds through Dynamic Resource Allocation (DESIGN.md §7): for each claim the
ledger wants held, a ResourceClaim for exactly its devices and a placeholder pod that
references it, so the real kube-scheduler allocates the devices and binds the pod; for
every other claim, both go. Pure spec builders, a reader of the allocation, and the
create/delete calls. Ledger arithmetic lives in reservoir.core; this knows none of it.

Names are derived from the claim's UID (a claim name may be 253 characters long):
ResourceClaim `reservoir-<uid>`, placeholder pod `reservoir-hold-<uid>`. Both are owned
by the BranchClaim, so they also go when it does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightkube import ApiError, AsyncClient
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from reservoir.core.devices import DeviceFacts
from reservoir.core.model import API_GROUP, API_VERSION, DEVICE_CLASSES
from reservoir.core.text import bounded
from reservoir.k8s import facts as read
from reservoir.k8s.resources import (
    CLAIM_LABEL,
    CLAIM_NAME_ANNOTATION,
    ENVELOPE_LABEL,
    ENVELOPE_NAME_ANNOTATION,
    HAND_OFF_GATE,
    BranchClaim,
    envelope_label,
    get_object,
)

log = logging.getLogger(__name__)

ResourceClaim = create_namespaced_resource(
    "resource.k8s.io", "v1", "ResourceClaim", "resourceclaims"
)
CLAIM_UID_LABEL = f"{API_GROUP}/claim-uid"
# A placeholder carries the workload label too, so that one server-side selector on it
# brings both kinds of pods to the operator's single watch of pods (label selectors cannot
# say "this label or that"); everything that looks for workload pods excludes this label.
PLACEHOLDER_LABEL = f"{API_GROUP}/placeholder-for"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
REQUEST_PREFIX = "dev"  # device request names in the ResourceClaim: dev-0, dev-1, ...


def resource_claim_name(uid: str) -> str:
    return f"reservoir-{uid}"


def placeholder_name(uid: str) -> str:
    return f"reservoir-hold-{uid}"


def _meta(claim: Mapping[str, Any], name: str) -> dict[str, Any]:
    meta = claim["metadata"]
    return {
        "name": name,
        "namespace": meta["namespace"],
        "labels": {
            ENVELOPE_LABEL: envelope_label(claim["spec"]["envelope"]),
            CLAIM_UID_LABEL: meta["uid"],
        },
        "annotations": {ENVELOPE_NAME_ANNOTATION: claim["spec"]["envelope"]},
        "ownerReferences": [
            {
                "apiVersion": f"{API_GROUP}/{API_VERSION}",
                "kind": "BranchClaim",
                "name": meta["name"],
                "uid": meta["uid"],
                "controller": True,
                "blockOwnerDeletion": False,
            }
        ],
    }


def resource_claim_spec(claim: Mapping[str, Any], counts: Mapping[str, int]) -> dict[str, Any]:
    """A ResourceClaim for exactly the claim's devices: one request per device resource."""
    wanted = ((claim["spec"].get("placement") or {}).get("deviceAttributes")) or {}
    requests = []
    for i, (resource, count) in enumerate(sorted(counts.items())):
        exactly: dict[str, Any] = {
            "deviceClassName": DEVICE_CLASSES[resource],
            "allocationMode": "ExactCount",
            "count": count,
        }
        if wanted:
            exactly["selectors"] = [{"cel": {"expression": device_selector(resource, wanted)}}]
        requests.append({"name": f"{REQUEST_PREFIX}-{i}", "exactly": exactly})
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": _meta(claim, resource_claim_name(claim["metadata"]["uid"])),
        "spec": {"devices": {"requests": requests}},
    }


def device_selector(resource: str, attributes: Mapping[str, str]) -> str:
    """A CEL expression: every named attribute of the device has exactly this string value.
    Names and values are restricted by the CRD (identifiers; no quotes or backslashes), so
    they are quoted safely; a device lacking an attribute does not match."""
    driver = DEVICE_CLASSES[resource]
    # A device without the attribute must not match (an error would abort allocation).
    terms = [
        f'"{name}" in device.attributes["{driver}"] && '
        f'device.attributes["{driver}"].{name} == "{value}"'
        for name, value in sorted(attributes.items())
    ]
    return " && ".join(terms)


NO_SIDECAR = {"sidecar.istio.io/inject": "false", "linkerd.io/inject": "disabled"}


def placeholder_spec(claim: Mapping[str, Any], priority_class: str | None) -> dict[str, Any]:
    """A pod that does nothing but hold the ResourceClaim's devices on their node: pause
    image, a token CPU request, the claim's placement hints, never owned by a Job."""
    uid = claim["metadata"]["uid"]
    hints = claim["spec"].get("placement") or {}
    meta = _meta(claim, placeholder_name(uid))
    # The claim's UID: its name may be longer than a label value (issue 25); kept in an
    # annotation for people.
    meta["labels"][PLACEHOLDER_LABEL] = meta["labels"][CLAIM_LABEL] = uid
    # A mesh's injector would add containers and volumes, which the chart's policy refuses
    # on a placeholder (found by review: no GPU claim could be held in an injected
    # namespace); it holds devices and never talks to anything.
    annotations = meta.setdefault("annotations", {})
    annotations.update(NO_SIDECAR)
    annotations[CLAIM_NAME_ANNOTATION] = claim["metadata"]["name"]
    spec: dict[str, Any] = {
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "resourceClaims": [{"name": "devices", "resourceClaimName": resource_claim_name(uid)}],
        "containers": [
            {
                "name": "hold",
                "image": PAUSE_IMAGE,
                "resources": {
                    "requests": {"cpu": "1m", "memory": "4Mi"},
                    "limits": {"memory": "16Mi"},
                    "claims": [{"name": "devices"}],
                },
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "runAsNonRoot": True,
                    "runAsUser": 65535,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
    }
    if priority_class:
        spec["priorityClassName"] = priority_class
    if hints.get("nodeSelector"):
        spec["nodeSelector"] = dict(hints["nodeSelector"])
    if hints.get("tolerations"):
        spec["tolerations"] = list(hints["tolerations"])
    if hints.get("affinity"):
        spec["affinity"] = dict(hints["affinity"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


@dataclass(frozen=True)
class PlacementAllowList:
    """The placement hints the administrator lets claims copy onto a placeholder pod (of a
    priority that jumps the queue): toleration keys, and node label keys for nodeSelector
    and nodeAffinity. Pod affinity, matchFields and a toleration without a key (every
    taint) are never allowed. The chart's admission policy refuses the same at `kubectl
    apply`; this is the operator's own check before it copies anything."""

    toleration_keys: frozenset[str] = frozenset()
    node_label_keys: frozenset[str] = frozenset()

    def problem(self, hints: Mapping[str, Any]) -> str | None:
        """Why the hints are refused, or None."""
        for toleration in hints.get("tolerations") or []:
            key = toleration.get("key") if isinstance(toleration, Mapping) else None
            if not key or key not in self.toleration_keys:
                return f"toleration key {key or '(none: every taint)'!r} is not allowed"
        for key in hints.get("nodeSelector") or {}:
            if key not in self.node_label_keys:
                return f"nodeSelector key {key!r} is not allowed"
        affinity = hints.get("affinity") or {}
        for kind in ("podAffinity", "podAntiAffinity"):
            if affinity.get(kind):
                return f"{kind} is not allowed"
        node = affinity.get("nodeAffinity") or {}
        required = node.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
        terms = list(required.get("nodeSelectorTerms") or [])
        terms += [
            p.get("preference") or {}
            for p in node.get("preferredDuringSchedulingIgnoredDuringExecution") or []
        ]
        for term in terms:
            if term.get("matchFields"):
                return "nodeAffinity matchFields are not allowed"
            for expression in term.get("matchExpressions") or []:
                if expression.get("key") not in self.node_label_keys:
                    return f"nodeAffinity key {expression.get('key')!r} is not allowed"
        return None


def device_facts(
    resource_claim: Mapping[str, Any], placeholder: Mapping[str, Any] | None
) -> DeviceFacts:
    """What a ResourceClaim (and its placeholder pod) show: where its devices are, whether a
    pod holds them, and the scheduler's reason when none is placed yet."""
    status = resource_claim.get("status") or {}
    allocation = status.get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    node = _allocated_node(allocation, results)
    held = node is not None and bool(status.get("reservedFor"))
    waiting = None
    if placeholder is not None and not held:
        for condition in (placeholder.get("status") or {}).get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                waiting = str(condition.get("message") or condition.get("reason") or "")[:512]
    return DeviceFacts(
        node=node,
        devices=tuple(str(r.get("device", "")) for r in results) if node else (),
        held=held,
        waiting=waiting or None,
    )


def _held_by_workload(rc: Mapping[str, Any], workload: list[Mapping[str, Any]]) -> bool:
    """A workload pod is bound to a node and in the ResourceClaim's reservedFor. Being in
    reservedFor alone is not enough: the scheduler reserves before it binds, and takes the
    reservation back if the binding fails; the placeholder must hold until the binding."""
    status = rc.get("status") or {}
    users = {u.get("uid") for u in status.get("reservedFor") or []}
    return bool(status.get("allocation")) and any(
        (pod.get("spec") or {}).get("nodeName") and pod["metadata"].get("uid") in users
        for pod in workload
    )


def _allocated_node(allocation: Mapping[str, Any], results: list[Any]) -> str | None:
    """The node a node-local allocation is on (its node selector's metadata.name)."""
    if not results:
        return None
    for term in (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []:
        for field in term.get("matchFields") or []:
            if field.get("key") == "metadata.name" and field.get("values"):
                return str(field["values"][0])
    return str(results[0].get("pool", "")) or None  # our pools are named after their node


class DeviceHolder:
    """Creates and deletes the ResourceClaims and placeholder pods the ledger asks for."""

    def __init__(
        self,
        client: AsyncClient,
        priority_class: str | None,
        placement: PlacementAllowList | None = None,
    ) -> None:
        self.client = client
        self.priority_class = priority_class
        # None: hints are copied as they are (a local operator run without the chart)
        self.placement = placement
        # claim uid -> why its ResourceClaim or placeholder could not be created: shown as
        # the claim's queue reason, since no scheduler condition will ever explain it
        self.problems: dict[str, str] = {}
        # Deletes the API server refused or failed, so far: tried again by a later pass.
        self.failed_deletes = 0

    def facts(
        self,
        resource_claims: Mapping[str, Mapping[str, Any]],
        placeholders: Mapping[str, Mapping[str, Any]],
    ) -> dict[str, DeviceFacts]:
        seen = {uid: device_facts(rc, placeholders.get(uid)) for uid, rc in resource_claims.items()}
        for uid, problem in self.problems.items():
            current = seen.get(uid, DeviceFacts())
            if not current.held and current.waiting is None:
                seen[uid] = DeviceFacts(node=current.node, devices=current.devices, waiting=problem)
        return seen

    async def observe(
        self, namespace: str, envelope: str
    ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """The envelope's ResourceClaims and placeholder pods, by claim UID: only those of
        the operator's own names (`reservoir-<uid>`, `reservoir-hold-<uid>`, which the
        admission policies let nobody else create). The labels select them on the API
        server, but a tenant may put them on a decoy: one taken for the real ResourceClaim
        made the devices look released while a pod still used them (found by review)."""
        selector: dict[str, Any] = {ENVELOPE_LABEL: envelope_label(envelope), CLAIM_UID_LABEL: None}
        claims: dict[str, dict[str, Any]] = {}
        try:
            async for rc in self.client.list(ResourceClaim, namespace=namespace, labels=selector):
                body = read.as_dict(rc)
                uid = body["metadata"]["labels"][CLAIM_UID_LABEL]
                if body["metadata"].get("name") == resource_claim_name(uid):
                    claims[uid] = body
        except ApiError as error:
            if error.status.code != 404:
                raise
            # No resource.k8s.io/v1 (no DRA): nothing is held; creating a ResourceClaim
            # fails too, and that refusal is what a GPU claim waits with.
        pods: dict[str, dict[str, Any]] = {}
        async for pod in self.client.list(
            Pod, namespace=namespace, labels={**selector, PLACEHOLDER_LABEL: None}
        ):
            body = pod.to_dict()
            uid = body["metadata"]["labels"][CLAIM_UID_LABEL]
            if body["metadata"].get("name") == placeholder_name(uid):
                pods[uid] = body
        return claims, pods

    async def sync(
        self,
        claims: Mapping[str, Mapping[str, Any]],
        holds: Mapping[str, Mapping[str, int]],
        resource_claims: Mapping[str, Mapping[str, Any]],
        placeholders: Mapping[str, Mapping[str, Any]],
        handed_off: Mapping[str, list[Mapping[str, Any]]] | None = None,  # the recorded pod
    ) -> bool:
        """Hold what the ledger wants held (`holds`: claim uid -> device counts), let go of
        the rest, and complete recorded hand-offs (`handed_off`: claim uid -> its workload
        pods): lift their gate, and delete the placeholder once a workload pod holds the
        devices. Called only after the ledger that asks for it is durable. Returns whether
        every recorded hand-off's gate is lifted now: if not, the caller comes back soon
        (the core settles a pod still gated when the lease lapses as never run)."""
        handed_off = handed_off or {}
        lifted = True
        for uid, workload in handed_off.items():
            for pod in workload:
                lifted = await self._lift_gate(pod) and lifted
            rc, placeholder = resource_claims.get(uid), placeholders.get(uid)
            if rc is not None and placeholder is not None and _held_by_workload(rc, workload):
                await self._delete(Pod, placeholder)
        for uid, counts in holds.items():
            claim = claims.get(uid)
            if claim is None or claim["metadata"].get("deletionTimestamp"):
                continue  # going: its owner references take both objects with it
            problems = []
            make_claim = uid not in resource_claims
            make_placeholder = uid not in placeholders and uid not in handed_off
            if make_claim or make_placeholder:
                # The claim's placement hints are not kept (the writer's records leave them
                # out: they may be a megabyte): read fresh, once per hold made.
                try:
                    claim = await self._read_claim(claim)
                except ApiError as error:  # shown as the claim's queue reason; next pass
                    unread = f"cannot read the claim: {error.status.message}"
                    self.problems[uid] = bounded(unread, 512)
                    continue
                if claim is None or claim["metadata"].get("deletionTimestamp"):
                    continue
                # Checked on the hints about to be copied (the fresh read), not the record.
                refused = self._placement_problem(claim)
                if refused is not None:
                    self.problems[uid] = refused
                    continue  # nothing is held on hints the administrator does not allow
            if make_claim:
                problems.append(
                    await self._create(ResourceClaim, resource_claim_spec(claim, counts))
                )
            if make_placeholder:
                problems.append(
                    await self._create(Pod, placeholder_spec(claim, self.priority_class))
                )
            problem = "; ".join(p for p in problems if p)
            if problem:
                self.problems[uid] = problem
            else:
                self.problems.pop(uid, None)
        self.problems = {uid: p for uid, p in self.problems.items() if uid in holds}
        for uid, pod in placeholders.items():
            if uid not in holds:
                await self._delete(Pod, pod)
        for uid, rc in resource_claims.items():
            if uid not in holds and not rc["metadata"].get("deletionTimestamp"):
                # The API server keeps an allocated claim until no pod uses it; its
                # disappearance is the scheduler-level confirmation that it is free.
                await self._delete(ResourceClaim, rc)
        return lifted

    def _placement_problem(self, claim: Mapping[str, Any]) -> str | None:
        if self.placement is None:
            return None
        hints = claim["spec"].get("placement") or {}
        problem = self.placement.problem(hints)
        if problem is None:
            return None
        return bounded(f"spec.placement refused by the administrator's allow-list: {problem}", 512)

    async def _read_claim(self, record: Mapping[str, Any]) -> dict[str, Any] | None:
        """The claim of `record`, read fresh; None if it is gone or another claim now."""
        meta = record["metadata"]
        found = await get_object(self.client, BranchClaim, meta["name"], meta["namespace"])
        if found is None or found["metadata"]["uid"] != meta["uid"]:
            return None
        return found

    async def _lift_gate(self, pod: Mapping[str, Any]) -> bool:
        """Whether the pod's hand-off gate is gone now (lifted here, or already gone)."""
        gates = (pod.get("spec") or {}).get("schedulingGates") or []
        if not any(g.get("name") == HAND_OFF_GATE for g in gates):
            return True
        kept = [g for g in gates if g.get("name") != HAND_OFF_GATE]
        meta = pod["metadata"]
        try:
            await self.client.patch(
                Pod,
                meta["name"],
                {"spec": {"schedulingGates": kept}},
                namespace=meta["namespace"],
                patch_type=PatchType.MERGE,
            )
        except ApiError as error:
            if error.status.code != 404:
                log.warning("lifting the hand-off gate of %s failed: %s", meta["name"], error)
                return False
        return True

    async def _create(self, kind: Any, body: dict[str, Any]) -> str | None:
        """Create; None when it exists now, else the API server's refusal."""
        try:
            obj = kind.from_dict(body)
            await self.client.create(obj, namespace=body["metadata"]["namespace"])  # type: ignore[call-overload]
        except ApiError as error:
            if error.status.code != 409:  # already there: fine
                log.warning("creating %s failed: %s", body["metadata"]["name"], error)
                return f"cannot create {body['kind']}: {error.status.message}"[:512]
        return None

    async def _delete(self, kind: Any, body: Mapping[str, Any]) -> None:
        meta = body["metadata"]
        try:
            await self.client.delete(kind, meta["name"], namespace=meta["namespace"])
        except ApiError as error:
            if error.status.code != 404:
                log.warning("deleting %s failed: %s", meta["name"], error)
                self.failed_deletes += 1
