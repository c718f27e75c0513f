"""Every `x-kubernetes-validations` rule in crds/, held to account by a real API server.

A rule that does not read `oldSelf` is checked on every write that carries its field: the
stored object always satisfies it, so there is nothing to bypass. A transition rule (one
that reads `oldSelf`) runs only when its field exists both before and after the write.
Delete the field (or its parent), then write the forbidden value, and the rule would never
run, unless the schema refuses the deletion (required) or puts the field back (a default).

So every transition rule needs a case in `CASES` (a new rule without one fails
`test_every_rule_in_the_crds_is_classified`), and each case is tried on the API server:
the forbidden change on its own; after removing, in six different ways, the field the rule
sits on, its parents, and every field the rule reads; and after first changing a field the
rule reads to another value the schema allows (a "detour"). The ValidatingAdmissionPolicy
rules in crds/ (CEL over `object` and `oldObject`) are held to the same standard. The rules
are read from crds/ at test time, never copied here.

The same real API server also decides quantities: it must accept exactly the strings the
operator's `parse_quantity` accepts (one shared definition, checked with a corpus and with
Hypothesis), and an envelope can never have a missing or empty capacity.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from lightkube import KubeConfig
from lightkube.config.client_adapter import Client, ConnectionParams

from reservoir.core.quantity import QuantityError, parse_quantity
from tests.clusters import ClusterHandle

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO / "crds"
GROUP, VERSION = "reservoir.dev", "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
PLURALS = {
    "BranchClaim": "branchclaims",
    "ReservationEnvelope": "reservationenvelopes",
    "ReservationPool": "reservationpools",
}
CLUSTER_SCOPED = {"ReservationPool"}
POOL_PREFIX = "rules-pool-"  # every pool these tests make: deleted at the end
MANAGER = "crd-rules-test"

JsonDict = dict[str, Any]
FieldPath = tuple[str, ...]


# --- the rules, as the CRDs declare them ------------------------------------------------


@dataclass(frozen=True)
class Rule:
    kind: str
    version: str
    path: FieldPath  # property names from the object root; "*" a map's values, "[]" list items
    rule: str
    message: str
    optional_old_self: bool
    policy: str = ""  # the ValidatingAdmissionPolicy declaring it; "" for a CRD schema rule

    @property
    def transition(self) -> bool:
        return "oldSelf" in self.rule or "oldObject" in self.rule

    @property
    def where(self) -> str:
        where = f"policy {self.policy}" if self.policy else dotted(self.path)
        return f"{self.kind}/{self.version} {where}"


def dotted(path: FieldPath) -> str:
    return ".".join(path) or "<root>"


def manifests() -> list[JsonDict]:
    """Everything in crds/, read now (it may have been regenerated since collection)."""
    found: list[JsonDict] = []
    for file in sorted(CRDS.glob("*.yaml")):
        found += [doc for doc in yaml.safe_load_all(file.read_text()) if doc]
    return found


def is_policy(doc: JsonDict) -> bool:
    return doc.get("kind") == "ValidatingAdmissionPolicy"


def crd_rules() -> list[Rule]:
    """Every CEL rule in crds/: the CRDs' x-kubernetes-validations, and the validations of
    the ValidatingAdmissionPolicies shipped with them."""
    found: list[Rule] = []
    docs = manifests()
    kinds = {
        doc["spec"]["names"]["plural"]: doc["spec"]["names"]["kind"]
        for doc in docs
        if doc.get("kind") == "CustomResourceDefinition"
    }
    for doc in docs:
        if doc.get("kind") == "CustomResourceDefinition":
            kind = doc["spec"]["names"]["kind"]
            for version in doc["spec"]["versions"]:
                schema = version.get("schema", {}).get("openAPIV3Schema", {})
                found += _rules_in(kind, version["name"], schema, ())
        elif is_policy(doc):
            for match in doc["spec"]["matchConstraints"]["resourceRules"]:
                for resource in match["resources"]:
                    for version in match["apiVersions"]:
                        for item in doc["spec"].get("validations", []):
                            found.append(
                                Rule(
                                    kinds.get(resource.split("/")[0], resource),
                                    version,
                                    (),
                                    str(item["expression"]),
                                    str(item.get("message") or item.get("messageExpression")),
                                    False,
                                    doc["metadata"]["name"],
                                )
                            )
    return found


def _rules_in(kind: str, version: str, node: JsonDict, path: FieldPath) -> list[Rule]:
    found = [
        Rule(
            kind,
            version,
            path,
            str(item["rule"]),
            str(item.get("message") or item.get("messageExpression") or ""),
            bool(item.get("optionalOldSelf", False)),
        )
        for item in node.get("x-kubernetes-validations", [])
    ]
    for name, child in node.get("properties", {}).items():
        found += _rules_in(kind, version, child, (*path, name))
    if isinstance(node.get("additionalProperties"), dict):
        found += _rules_in(kind, version, node["additionalProperties"], (*path, "*"))
    if isinstance(node.get("items"), dict):
        found += _rules_in(kind, version, node["items"], (*path, "[]"))
    for combinator in ("allOf", "anyOf", "oneOf"):
        for branch in node.get(combinator, []):
            found += _rules_in(kind, version, branch, path)
    if isinstance(node.get("not"), dict):
        found += _rules_in(kind, version, node["not"], path)
    return found


# --- a thin, unmocked client for the API server ----------------------------------------


@dataclass
class Reply:
    code: int
    body: JsonDict
    warnings: list[str] = field(default_factory=list)  # the Warning headers

    @property
    def ok(self) -> bool:
        return 200 <= self.code < 300

    @property
    def invalid(self) -> bool:
        """Refused by validation: 422 Unprocessable Entity, reason Invalid."""
        return self.code == 422 and self.body.get("reason") == "Invalid"

    @property
    def causes(self) -> list[tuple[str, str]]:
        details = self.body.get("details") or {}
        return [(c.get("field", ""), c.get("message", "")) for c in details.get("causes", [])]

    def __str__(self) -> str:
        return f"{self.code} accepted" if self.ok else f"{self.code} {self.body.get('message')}"


class Api:
    def __init__(self, kubeconfig: Path) -> None:
        config = KubeConfig.from_file(str(kubeconfig)).get()
        assert config is not None, kubeconfig
        self.http = Client(config, ConnectionParams())

    def close(self) -> None:
        self.http.close()

    def url(self, kind: str, ns: str, name: str = "", status: bool = False) -> str:
        scope = "" if kind in CLUSTER_SCOPED else f"namespaces/{ns}/"
        url = f"/apis/{GROUP}/{VERSION}/{scope}{PLURALS[kind]}"
        if name:
            url += f"/{name}"
        return url + "/status" if status else url

    def send(
        self,
        method: str,
        url: str,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
    ) -> Reply:
        response = self.http.request(
            method,
            url,
            content=None if body is None else json.dumps(body),
            headers={"Content-Type": content_type},
            params=params,
        )
        try:
            payload = response.json() if response.content else {}
        except ValueError:
            payload = {"message": response.text}
        body = payload if isinstance(payload, dict) else {}
        return Reply(response.status_code, body, response.headers.get_list("warning"))

    def get(self, kind: str, ns: str, name: str) -> JsonDict:
        reply = self.send("GET", self.url(kind, ns, name))
        assert reply.ok, f"GET {kind}/{name}: {reply}"
        return reply.body

    def exists(self, kind: str, ns: str, name: str) -> bool:
        return self.send("GET", self.url(kind, ns, name)).code != 404

    def create(self, obj: JsonDict, ns: str, dry_run: bool = False) -> Reply:
        params = {"dryRun": "All"} if dry_run else None
        return self.send("POST", self.url(obj["kind"], ns), obj, params=params)

    def merge(self, kind: str, ns: str, name: str, patch: JsonDict, status: bool = False) -> Reply:
        url = self.url(kind, ns, name, status)
        return self.send("PATCH", url, patch, "application/merge-patch+json")

    def json_patch(
        self, kind: str, ns: str, name: str, ops: list[JsonDict], status: bool = False
    ) -> Reply:
        return self.send(
            "PATCH", self.url(kind, ns, name, status), ops, "application/json-patch+json"
        )

    def put(self, obj: JsonDict, ns: str, status: bool = False) -> Reply:
        return self.send("PUT", self.url(obj["kind"], ns, obj["metadata"]["name"], status), obj)

    def apply(self, obj: JsonDict, ns: str, status: bool = False) -> Reply:
        """Server-side apply, as `kubectl apply --server-side --force-conflicts` does."""
        url = self.url(obj["kind"], ns, obj["metadata"]["name"], status)
        params = {"fieldManager": MANAGER, "force": "true"}
        return self.send("PATCH", url, obj, "application/apply-patch+yaml", params)


@pytest.fixture(scope="module")
def api(cluster: ClusterHandle, crds: None) -> Iterator[Api]:
    client = Api(cluster.kubeconfig_path)
    yield client
    client.close()


@pytest.fixture(scope="module")
def space(api: Api) -> Iterator[str]:
    """One namespace for the module: each test makes its own uniquely named objects."""
    name = f"rules-{uuid.uuid4().hex[:8]}"
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    reply = api.send("POST", "/api/v1/namespaces", body)
    assert reply.ok, reply
    yield name
    api.send("DELETE", f"/api/v1/namespaces/{name}")
    # Pools are cluster-scoped: they do not go with the namespace.
    pools = api.send("GET", api.url("ReservationPool", name)).body.get("items", [])
    for pool in pools:
        if pool["metadata"]["name"].startswith(POOL_PREFIX):
            api.send("DELETE", api.url("ReservationPool", name, pool["metadata"]["name"]))


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def object_name(kind: str, prefix: str) -> str:
    """A unique name; a cluster-scoped object's marked for the clean-up."""
    return unique(f"{POOL_PREFIX if kind in CLUSTER_SCOPED else ''}{prefix}"[:50])


# --- paths into JSON objects -------------------------------------------------------------


class _Missing:
    def __repr__(self) -> str:
        return "<absent>"


MISSING: Any = _Missing()


def at(obj: Any, path: FieldPath) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return MISSING
        obj = obj[key]
    return obj


def nest(path: FieldPath, value: Any) -> JsonDict:
    """("spec", "usage") and None → {"spec": {"usage": None}}: a JSON merge patch."""
    patch: Any = value
    for key in reversed(path):
        patch = {key: patch}
    assert isinstance(patch, dict)
    return patch


def pointer(path: FieldPath) -> str:
    """A JSON Pointer (RFC 6901): map keys such as nvidia.com/gpu need escaping."""
    return "".join("/" + key.replace("~", "~0").replace("/", "~1") for key in path)


def leaves(patch: JsonDict, prefix: FieldPath = ()) -> dict[FieldPath, Any]:
    """The values a merge patch writes, by path; None means the field is removed."""
    found: dict[FieldPath, Any] = {}
    for key, value in patch.items():
        if isinstance(value, dict) and value:
            found.update(leaves(value, (*prefix, key)))
        else:
            found[(*prefix, key)] = value
    return found


def describe(patch: JsonDict) -> str:
    return ",".join(f"{dotted(path)}={value}" for path, value in leaves(patch).items())


def shows(obj: JsonDict, violation: JsonDict) -> bool:
    """Whether a stored object carries the violating change (every value it writes)."""
    return all(
        at(obj, path) is MISSING if value is None else at(obj, path) == value
        for path, value in leaves(violation).items()
    )


# --- the cases: one or more per transition rule ------------------------------------------

Invariant = Callable[[JsonDict, JsonDict], bool]  # (starting object, stored object) -> holds


def unchanged(*path: str) -> Invariant:
    return lambda start, now: at(now, path) == at(start, path)


def stays_true(*path: str) -> Invariant:
    return lambda start, now: at(now, path) is True


def only_grows(*path: str) -> Invariant:
    """Every quantity of the starting map is still there and no smaller."""

    def holds(start: JsonDict, now: JsonDict) -> bool:
        before, after = at(start, path), at(now, path)
        if not isinstance(after, dict):
            return False
        return all(
            key in after and parse_quantity(after[key]) >= parse_quantity(value)
            for key, value in before.items()
        )

    return holds


CLAIM_SPEC: JsonDict = {
    "envelope": "wf",
    "branch": "search",
    "attempt": 3,  # not the default (1): removing the field would have to change it
    "requests": {"tokens": "20k", "cost": "1"},
    # The lease a dispatch or report is made under (reservoir.lease_fence_rules): with no
    # operator here, no status.lease is written, so generation 0 is the current one.
    "lease": {"fence": {"generation": 0}},
}
ENVELOPE_SPEC: JsonDict = {"capacity": {"tokens": "100k", "cost": "12.50"}}
POOL_SPEC: JsonDict = {"capacity": {"tokens": "1M", "cost": "100"}, "namespaces": ["a", "b"]}
CHILD: JsonDict = {"parent": "planner"}
EXPIRING: JsonDict = {"lifetimeSeconds": 60}
EXPIRED: JsonDict = {"phase": "Expired"}  # as the operator records it once the lifetime passed


def keeps_all(*path: str) -> Invariant:
    """Every item of the starting list is still there."""
    return lambda start, now: set(at(start, path)) <= set(at(now, path) or [])


FINAL: JsonDict = {"usage": {"tokens": "5"}, "final": True, "outcome": "Succeeded"}
SENT_FINAL: JsonDict = {**FINAL, "dispatch": True}  # a report needs its commit point
UNCANCEL: tuple[JsonDict, ...] = ({"spec": {"cancel": False}},)
UNFINAL: tuple[JsonDict, ...] = ({"spec": {"final": False}},)
NEVER_RAN_READS: tuple[FieldPath, ...] = (
    ("spec", "cancel"),
    ("spec", "dispatch"),
    ("spec", "commitPoint"),
)
NEVER_RAN_DETOURS: tuple[JsonDict, ...] = (
    {"spec": {"commitPoint": "PodScheduled"}},
    {"spec": {"commitPoint": "PodRunning"}},
    {"spec": {"dispatch": True}},
    {"spec": {"cancel": False}},
)
# Issue 22: a contract per resource, fixed at creation; compensations are append-only.
REPLENISHING: JsonDict = {"tokens": {"type": "Replenishing", "windowSeconds": 60}}
TWO_CONTRACTS: JsonDict = {"contracts": {**REPLENISHING, "cost": {"type": "Consumable"}}}
REFUND: JsonDict = {
    "key": "refund-1",
    "refund": {"tokens": "5"},
    "reason": "the customer was refunded",
    "reference": "invoice-7",
}
SETTLEMENT: JsonDict = {
    "key": "uid-1/1/1",
    "phase": "Consumed",
    "reason": "FinalUsage",
    "outcome": "Succeeded",
    "at": "2026-01-01T00:00:00Z",
}

# The claim's line, settled: where a claim's settlement is recorded since status.ledger.
SETTLED_LINE: JsonDict = {"claim": "a", "phase": "Consumed", "settlement": SETTLEMENT}


@dataclass(frozen=True)
class Case:
    """A valid starting object and a change that only the rule at `rule_at` refuses."""

    name: str
    kind: str
    rule_at: FieldPath  # where the rule sits; () is the object root
    about: str  # a part of the rule's message that picks it out among the rules there
    violation: JsonDict  # a JSON merge patch; a "status" patch goes to the status subresource
    holds: Invariant  # what the rule protects, still true of the stored object
    spec: JsonDict = field(default_factory=dict)  # the starting spec, over the kind's base spec
    status: JsonDict | None = None  # the starting status, written through /status
    reads: tuple[FieldPath, ...] = ()  # more fields the rule reads: removed in turn too
    # Changes to fields the rule reads (not the one it protects), tried before the violation.
    detours: tuple[JsonDict, ...] = ()
    admission: bool = False  # the rule is a ValidatingAdmissionPolicy's, not the schema's
    deleting: bool = False  # start from an object being deleted (held by a finalizer)
    adds: bool = False  # the violation adds a field the start lacks: nothing there to remove

    def targets(self) -> list[FieldPath]:
        """Every field to try removing first: the rule's own field and all its parents, each
        field the violation writes and its parents, and each further field the rule reads."""
        found: list[FieldPath] = []
        written = [] if self.adds else list(leaves(self.violation))
        for path in (self.rule_at, *written, *self.reads):
            for end in range(1, len(path) + 1):
                if path[:end] not in found:
                    found.append(path[:end])
        return found


CASES = [
    Case("envelope-changed", "BranchClaim", ("spec", "envelope"), "envelope is immutable",
         {"spec": {"envelope": "other"}}, unchanged("spec", "envelope")),
    Case("branch-changed", "BranchClaim", ("spec", "branch"), "branch is immutable",
         {"spec": {"branch": "other"}}, unchanged("spec", "branch")),
    Case("attempt-changed", "BranchClaim", ("spec", "attempt"), "attempt is immutable",
         {"spec": {"attempt": 4}}, unchanged("spec", "attempt")),
    Case("requests-changed", "BranchClaim", ("spec", "requests"), "requests are immutable",
         {"spec": {"requests": {"tokens": "1"}}}, unchanged("spec", "requests")),
    Case("requests-lose-one", "BranchClaim", ("spec", "requests"), "requests are immutable",
         {"spec": {"requests": {"cost": None}}}, unchanged("spec", "requests")),
    Case("usage-decreases", "BranchClaim", ("spec", "usage"), "usage is cumulative",
         {"spec": {"usage": {"tokens": "4"}}}, only_grows("spec", "usage"),
         spec={"usage": {"tokens": "5", "cost": "1"}}),
    Case("usage-loses-one", "BranchClaim", ("spec", "usage"), "usage is cumulative",
         {"spec": {"usage": {"cost": None}}}, only_grows("spec", "usage"),
         spec={"usage": {"tokens": "5", "cost": "1"}}),
    Case("dispatch-undone", "BranchClaim", (), "dispatch is a fact",
         {"spec": {"dispatch": False}}, stays_true("spec", "dispatch"),
         spec={"dispatch": True}, admission=True),
    Case("cancel-undone", "BranchClaim", (), "cancel is a fact",
         {"spec": {"cancel": False}}, stays_true("spec", "cancel"),
         spec={"cancel": True}, admission=True),
    Case("dispatch-after-cancel", "BranchClaim", (), "cancelled branch cannot be dispatched",
         {"spec": {"dispatch": True}}, unchanged("spec", "dispatch"),
         spec={"cancel": True}, reads=(("spec", "cancel"),), detours=UNCANCEL,
         admission=True),
    Case("final-undone", "BranchClaim", (), "cannot be un-finalized",
         {"spec": {"final": False}}, stays_true("spec", "final"),
         spec=SENT_FINAL, reads=(("spec", "outcome"),), detours=({"spec": {"outcome": "Failed"}},),
         admission=True),
    Case("outcome-changed-once-final", "BranchClaim", (), "outcome cannot change",
         {"spec": {"outcome": "Failed"}}, unchanged("spec", "outcome"),
         spec=SENT_FINAL, reads=(("spec", "final"),), detours=UNFINAL, admission=True),
    Case("usage-changed-once-final", "BranchClaim", (), "usage cannot change",
         {"spec": {"usage": {"tokens": "6"}}}, unchanged("spec", "usage"),
         spec=SENT_FINAL, reads=(("spec", "final"),), detours=UNFINAL, admission=True),
    Case("dispatch-after-final", "BranchClaim", (), "made its final report is not sent",
         {"spec": {"dispatch": True}}, unchanged("spec", "dispatch"),
         spec=FINAL, reads=(("spec", "final"),), detours=UNFINAL, admission=True),
    Case("deadline-changed", "BranchClaim", (), "upstream.deadline is set once",
         {"spec": {"upstream": {"deadline": "2030-01-01T00:00:00Z"}}},
         unchanged("spec", "upstream", "deadline"),
         spec={"upstream": {"deadline": "2029-01-01T00:00:00Z"}}, admission=True),
    Case("deadline-removed", "BranchClaim", (), "upstream.deadline is set once",
         {"spec": {"upstream": {"deadline": None}}}, unchanged("spec", "upstream", "deadline"),
         spec={"upstream": {"deadline": "2029-01-01T00:00:00Z"}}, admission=True),
    Case("ref-changed", "BranchClaim", (), "upstream.ref is set once",
         {"spec": {"upstream": {"ref": {"name": "job-2"}}}}, unchanged("spec", "upstream", "ref"),
         spec={"upstream": {"ref": {"name": "job-1"}}}, admission=True),
    Case("ref-removed", "BranchClaim", (), "upstream.ref is set once",
         {"spec": {"upstream": {"ref": None}}}, unchanged("spec", "upstream", "ref"),
         spec={"upstream": {"ref": {"name": "job-1"}}}, admission=True),
    Case("request-id-changed", "BranchClaim", (), "requestId is set once",
         {"spec": {"upstream": {"requestId": "req-2"}}},
         unchanged("spec", "upstream", "requestId"), spec={"upstream": {"requestId": "req-1"}},
         admission=True),
    Case("request-id-removed", "BranchClaim", (), "requestId is set once",
         {"spec": {"upstream": {"requestId": None}}},
         unchanged("spec", "upstream", "requestId"), spec={"upstream": {"requestId": "req-1"}},
         admission=True),
    Case("operation-id-changed", "BranchClaim", (), "operationId is set once",
         {"spec": {"upstream": {"operationId": "op-2"}}},
         unchanged("spec", "upstream", "operationId"),
         spec={"upstream": {"operationId": "op-1"}}, admission=True),
    Case("result-changed", "BranchClaim", (), "result is set once",
         {"spec": {"result": "s3://b/other"}}, unchanged("spec", "result"),
         spec={"result": "s3://b/out", "dispatch": True}, admission=True),
    Case("result-removed", "BranchClaim", (), "result is set once",
         {"spec": {"result": None}}, unchanged("spec", "result"),
         spec={"result": "s3://b/out", "dispatch": True}, admission=True),
    Case("retry-window-changed", "BranchClaim", (), "retryWindowSeconds is fixed",
         {"spec": {"retryWindowSeconds": 30}}, unchanged("spec", "retryWindowSeconds"),
         spec={"retryWindowSeconds": 60}, admission=True),
    Case("retry-window-removed", "BranchClaim", (), "retryWindowSeconds is fixed",
         {"spec": {"retryWindowSeconds": None}}, unchanged("spec", "retryWindowSeconds"),
         spec={"retryWindowSeconds": 60}, admission=True),
    # The rule reads the spec as a whole: removing it first (refused: it is required) is
    # tried too, as when the rule sat on the spec's schema.
    Case("retry-window-added", "BranchClaim", (), "retryWindowSeconds is fixed",
         {"spec": {"retryWindowSeconds": 60}}, unchanged("spec", "retryWindowSeconds"),
         reads=(("spec",),), adds=True, admission=True),
    # A copy's speculation group is what it competes in: fixed at creation (issue 24).
    Case("speculation-group-changed", "BranchClaim", (), "speculationGroup is fixed",
         {"spec": {"speculationGroup": "other"}}, unchanged("spec", "speculationGroup"),
         spec={"speculationGroup": "search"}, admission=True),
    Case("speculation-group-removed", "BranchClaim", (), "speculationGroup is fixed",
         {"spec": {"speculationGroup": None}}, unchanged("spec", "speculationGroup"),
         spec={"speculationGroup": "search"}, admission=True),
    Case("speculation-group-added", "BranchClaim", (), "speculationGroup is fixed",
         {"spec": {"speculationGroup": "search"}}, unchanged("spec", "speculationGroup"),
         reads=(("spec",),), adds=True, admission=True),
    Case("settlement-changed", "BranchClaim", (), "status.settlement",
         {"status": {"settlement": {"reason": "Forged"}}}, unchanged("status", "settlement"),
         status={"settlement": SETTLEMENT}, reads=(("status", "settlement", "outcome"),),
         detours=({"status": {"settlement": {"key": "uid-2/1/1"}}},)),
    Case("settlement-removed", "BranchClaim", (), "status.settlement",
         {"status": {"settlement": None}}, unchanged("status", "settlement"),
         status={"settlement": SETTLEMENT}),
    Case("line-settlement-changed", "BranchClaim", (), "status.ledger.settlement",
         {"status": {"ledger": {"settlement": {"reason": "Forged"}}}},
         unchanged("status", "ledger", "settlement"), status={"ledger": SETTLED_LINE},
         reads=(("status", "ledger", "settlement", "outcome"),),
         detours=({"status": {"ledger": {"phase": "Released"}}},)),
    Case("line-settlement-removed", "BranchClaim", (), "status.ledger.settlement",
         {"status": {"ledger": {"settlement": None}}},
         unchanged("status", "ledger", "settlement"), status={"ledger": SETTLED_LINE}),
    Case("line-removed", "BranchClaim", (), "status.ledger.settlement",
         {"status": {"ledger": None}}, unchanged("status", "ledger", "settlement"),
         status={"ledger": SETTLED_LINE}),
    Case("capacity-shrinks", "ReservationEnvelope", ("spec", "capacity"), "never shrink",
         {"spec": {"capacity": {"tokens": "1"}}}, only_grows("spec", "capacity")),
    Case("capacity-loses-one", "ReservationEnvelope", ("spec", "capacity"), "never shrink",
         {"spec": {"capacity": {"cost": None}}}, only_grows("spec", "capacity")),
    Case("capacity-gains-one", "ReservationEnvelope", ("spec", "capacity"), "fixed at creation",
         {"spec": {"capacity": {"gpu": "1"}}}, unchanged("spec", "capacity"), adds=True),
    Case("parent-changed", "ReservationEnvelope", ("spec",), "parent is fixed",
         {"spec": {"parent": "other"}}, unchanged("spec", "parent"), spec=CHILD),
    Case("parent-removed", "ReservationEnvelope", ("spec",), "parent is fixed",
         {"spec": {"parent": None}}, unchanged("spec", "parent"), spec=CHILD),
    Case("parent-added", "ReservationEnvelope", ("spec",), "parent is fixed",
         {"spec": {"parent": "planner"}}, unchanged("spec", "parent"), adds=True),
    Case("child-capacity-grows", "ReservationEnvelope", ("spec",), "was reserved from",
         {"spec": {"capacity": {"tokens": "200k"}}}, unchanged("spec", "capacity"),
         spec=CHILD, reads=(("spec", "parent"),)),
    Case("pool-capacity-shrinks", "ReservationPool", ("spec", "capacity"), "never shrink",
         {"spec": {"capacity": {"tokens": "1"}}}, only_grows("spec", "capacity")),
    Case("pool-capacity-loses-one", "ReservationPool", ("spec", "capacity"), "never shrink",
         {"spec": {"capacity": {"cost": None}}}, only_grows("spec", "capacity")),
    Case("pool-capacity-gains-one", "ReservationPool", ("spec", "capacity"), "fixed at",
         {"spec": {"capacity": {"gpu": "1"}}}, unchanged("spec", "capacity"), adds=True),
    Case("pool-loses-namespace", "ReservationPool", ("spec", "namespaces"), "never lose",
         {"spec": {"namespaces": ["a"]}}, keeps_all("spec", "namespaces")),
    Case("commit-point-changed", "BranchClaim", ("spec", "commitPoint"), "commitPoint is",
         {"spec": {"commitPoint": "PodRunning"}}, unchanged("spec", "commitPoint")),
    Case("upstream-state-backwards", "BranchClaim", (), "upstream.state is a fact",
         {"spec": {"upstream": {"state": "Submitted"}}}, unchanged("spec", "upstream", "state"),
         spec={"upstream": {"state": "Running"}, "dispatch": True}, admission=True),
    Case("upstream-state-removed", "BranchClaim", (), "upstream.state is a fact",
         {"spec": {"upstream": {"state": None}}}, unchanged("spec", "upstream", "state"),
         spec={"upstream": {"state": "Accepted"}, "dispatch": True}, admission=True),
    # Issue 25: an envelope that expired (perhaps still closing: claims running) is never
    # reopened, by its lifetime raised or removed, or by its recorded phase going.
    Case("lifetime-raised-once-expired", "ReservationEnvelope", (), "can only be lowered",
         {"spec": {"lifetimeSeconds": 3600}}, unchanged("spec", "lifetimeSeconds"),
         spec=EXPIRING, status=EXPIRED, reads=(("status", "phase"),),
         detours=({"status": {"phase": "Closing"}},)),
    Case("lifetime-removed-once-expired", "ReservationEnvelope", (), "can only be lowered",
         {"spec": {"lifetimeSeconds": None}}, unchanged("spec", "lifetimeSeconds"),
         spec=EXPIRING, status=EXPIRED, reads=(("status", "phase"),),
         detours=({"status": {"phase": "Open"}},)),
    Case("expired-phase-changed", "ReservationEnvelope", (), "stays Expired",
         {"status": {"phase": "Open"}}, unchanged("status", "phase"),
         spec=EXPIRING, status=EXPIRED, reads=(("spec", "lifetimeSeconds"),),
         detours=({"spec": {"lifetimeSeconds": 3600}},)),
    Case("expired-phase-removed", "ReservationEnvelope", (), "stays Expired",
         {"status": {"phase": None}}, unchanged("status", "phase"),
         spec=EXPIRING, status=EXPIRED),
    Case("envelope-reopened", "ReservationEnvelope", ("spec", "state"), "cannot be reopened",
         {"spec": {"state": "Open"}}, unchanged("spec", "state"),
         spec={"state": "Closed"}),
    # A resource's contract is fixed at creation, on envelopes and pools alike; removing
    # `contracts` first gets nowhere: its schema default ({}) puts it back for the rule.
    Case("contract-window-changed", "ReservationEnvelope", ("spec", "contracts"),
         "contracts are fixed", {"spec": {"contracts": {"tokens": {"windowSeconds": 120}}}},
         unchanged("spec", "contracts"), spec={"contracts": REPLENISHING}),
    Case("contract-type-changed", "ReservationEnvelope", ("spec", "contracts"),
         "contracts are fixed",
         {"spec": {"contracts": {"tokens": {"type": "Consumable", "windowSeconds": None}}}},
         unchanged("spec", "contracts"), spec={"contracts": REPLENISHING}),
    Case("contracts-lose-one", "ReservationEnvelope", ("spec", "contracts"),
         "contracts are fixed", {"spec": {"contracts": {"tokens": None}}},
         unchanged("spec", "contracts"), spec=TWO_CONTRACTS),
    Case("contracts-added", "ReservationEnvelope", ("spec", "contracts"), "contracts are fixed",
         {"spec": {"contracts": REPLENISHING}}, unchanged("spec", "contracts"), adds=True),
    Case("pool-contract-window-changed", "ReservationPool", ("spec", "contracts"),
         "contracts are fixed", {"spec": {"contracts": {"tokens": {"windowSeconds": 120}}}},
         unchanged("spec", "contracts"), spec={"contracts": REPLENISHING}),
    Case("pool-contract-type-changed", "ReservationPool", ("spec", "contracts"),
         "contracts are fixed",
         {"spec": {"contracts": {"tokens": {"type": "Reusable", "windowSeconds": None}}}},
         unchanged("spec", "contracts"), spec={"contracts": REPLENISHING}),
    Case("pool-contracts-lose-one", "ReservationPool", ("spec", "contracts"),
         "contracts are fixed", {"spec": {"contracts": {"cost": None}}},
         unchanged("spec", "contracts"), spec=TWO_CONTRACTS),
    Case("pool-contracts-added", "ReservationPool", ("spec", "contracts"),
         "contracts are fixed", {"spec": {"contracts": REPLENISHING}},
         unchanged("spec", "contracts"), adds=True),
    # A compensation once sent is never changed or taken back (a new one has its own key).
    Case("compensation-removed", "BranchClaim", ("spec", "compensations"), "append-only",
         {"spec": {"compensations": []}}, unchanged("spec", "compensations"),
         spec={"compensations": [REFUND]}),
    Case("compensation-changed", "BranchClaim", ("spec", "compensations"), "append-only",
         {"spec": {"compensations": [{**REFUND, "refund": {"tokens": "50"}}]}},
         unchanged("spec", "compensations"), spec={"compensations": [REFUND]}),
    Case("compensation-replaced", "BranchClaim", ("spec", "compensations"), "append-only",
         {"spec": {"compensations": [{**REFUND, "key": "refund-2"}]}},
         unchanged("spec", "compensations"), spec={"compensations": [REFUND]}),
    # A branch that never reached its commit point never ran: no usage, no provider start,
    # cancelled, deleted or not (reservoir.lease_fence_rules).
    Case("usage-before-the-commit-point", "BranchClaim", (), "for work that never started",
         {"spec": {"usage": {"tokens": "5"}}}, unchanged("spec", "usage"),
         spec={"usage": {"tokens": "1"}}, reads=NEVER_RAN_READS[1:],
         detours=({"spec": {"commitPoint": "PodScheduled"}},), admission=True),
    Case("usage-after-cancel-before-dispatch", "BranchClaim", (), "for work that never started",
         {"spec": {"usage": {"tokens": "5"}}}, unchanged("spec", "usage"),
         spec={"cancel": True, "usage": {"tokens": "1"}}, reads=NEVER_RAN_READS,
         detours=NEVER_RAN_DETOURS, admission=True),
    Case("provider-start-after-cancel-before-dispatch", "BranchClaim", (),
         "for work that never started", {"spec": {"upstream": {"state": "Running"}}},
         unchanged("spec", "upstream", "state"),
         spec={"cancel": True, "upstream": {"state": "Submitted"}}, reads=NEVER_RAN_READS,
         detours=NEVER_RAN_DETOURS, admission=True),
    # The same for a claim deleted before dispatch, and a deleted claim cannot be dispatched:
    # rules of the ValidatingAdmissionPolicy in crds/.
    Case("dispatch-while-deleting", "BranchClaim", (), "being deleted cannot be dispatched",
         {"spec": {"dispatch": True}}, unchanged("spec", "dispatch"),
         admission=True, deleting=True, detours=({"spec": {"cancel": True}},)),
    Case("usage-after-delete-before-dispatch", "BranchClaim", (), "for work that never started",
         {"spec": {"usage": {"tokens": "5"}}}, unchanged("spec", "usage"),
         spec={"usage": {"tokens": "1"}}, reads=NEVER_RAN_READS[1:],
         detours=NEVER_RAN_DETOURS, admission=True, deleting=True),
    Case("provider-start-after-delete-before-dispatch", "BranchClaim", (),
         "for work that never started", {"spec": {"upstream": {"state": "Running"}}},
         unchanged("spec", "upstream", "state"),
         spec={"upstream": {"state": "Submitted"}}, reads=NEVER_RAN_READS[1:],
         detours=NEVER_RAN_DETOURS, admission=True, deleting=True),
    # Fencing (reservoir.lease_fence_rules): a dispatch or report carries the current lease,
    # and a settled claim is never dispatched.
    Case("dispatch-with-a-stale-fence", "BranchClaim", (), "must carry the current lease",
         {"spec": {"dispatch": True}}, unchanged("spec", "dispatch"),
         spec={"lease": {"holder": "w", "fence": {"holder": "w", "generation": 1}}},
         status={"lease": {"holder": "w", "generation": 2}},
         reads=(("spec", "lease", "fence"), ("spec", "lease", "holder"), ("status", "lease")),
         detours=({"spec": {"lease": {"holder": "w-2"}}},), admission=True),
    Case("dispatch-after-settlement", "BranchClaim", (), "nothing holds capacity for",
         {"spec": {"dispatch": True}}, unchanged("spec", "dispatch"),
         status={"phase": "Consumed", "ledger": SETTLED_LINE},
         reads=(("status", "ledger", "settlement"), ("status", "phase")), admission=True),
]  # fmt: skip

# Rules without oldSelf: a forbidden value, by kind and a part of the rule's message. The
# same message always means the same rule (checked below), so one place per kind suffices.
STATELESS_EXAMPLES = [
    ("BranchClaim", "resource names look like", {"usage": {"tok ens!": "1"}}),
    ("BranchClaim", "may not exceed 1E", {"usage": {"tokens": "2E"}}),
    ("BranchClaim", "a final report needs an outcome", {"final": True}),
    ("BranchClaim", "whole numbers of devices", {"requests": {"nvidia.com/gpu": "1.5"}}),
    ("BranchClaim", "whole numbers of devices", {"requests": {"nvidia.com/gpu": "33"}}),
    (
        "BranchClaim",
        "device attribute names are identifiers",
        {"placement": {"deviceAttributes": {"product-name": "x"}}},
    ),
    (
        "BranchClaim",
        "label keys look like",
        {"placement": {"nodeSelector": {"bad key!": "x"}}},
    ),
    ("ReservationEnvelope", "resource names look like", {"capacity": {"tok ens!": "1"}}),
    ("ReservationEnvelope", "may not exceed 1E", {"capacity": {"tokens": "2E"}}),
    (
        "BranchClaim",
        "apiVersion is required for kinds other than Job",
        {"upstream": {"ref": {"kind": "Training", "name": "t1"}}},
    ),
    (
        "ReservationEnvelope",
        "statusURL names {operationId}",
        {"policy": {"provider": {"statusURL": "https://provider.example/ops"}}},
    ),
    ("ReservationPool", "resource names look like", {"capacity": {"tok ens!": "1"}}),
    (
        "ReservationEnvelope",
        "contracts name resources of the capacity",
        {"contracts": {"gpu": {"type": "Reusable"}}},
    ),
    (
        "ReservationEnvelope",
        "a device resource (nvidia.com/gpu) is Reusable",
        {
            "capacity": {"nvidia.com/gpu": "8"},
            "contracts": {"nvidia.com/gpu": {"type": "Consumable"}},
        },
    ),
    (
        "ReservationEnvelope",
        "windowSeconds is set for a Replenishing resource",
        {"contracts": {"tokens": {"type": "Replenishing"}}},
    ),
    (
        "ReservationPool",
        "contracts name resources of the capacity",
        {"contracts": {"gpu": {"type": "Reusable"}}},
    ),
    (
        "ReservationPool",
        "a device resource (nvidia.com/gpu) is Reusable",
        {
            "capacity": {"nvidia.com/gpu": "8"},
            "contracts": {"nvidia.com/gpu": {"type": "Replenishing", "windowSeconds": 60}},
        },
    ),
    (
        "ReservationPool",
        "windowSeconds is set for a Replenishing resource",
        {"contracts": {"tokens": {"type": "Consumable", "windowSeconds": 60}}},
    ),
    (
        "BranchClaim",
        "each compensation has its own key",
        {"compensations": [REFUND, {**REFUND, "refund": {"tokens": "1"}}]},
    ),
    ("ReservationPool", "may not exceed 1E", {"capacity": {"tokens": "2E"}}),
    ("ReservationPool", "shares name only namespaces the pool lists", {"shares": {"c": {}}}),
    ("ReservationPool", "shares are keyed by namespace names", {"shares": {"Team_A": {}}}),
    (
        "ReservationPool",
        "a priority class's name is a label value",
        {"priorityClasses": {"../urgent": {"value": 1}}},
    ),
]


def matches_case(rule: Rule, case: Case) -> bool:
    return (
        rule.kind == case.kind
        and rule.version == VERSION
        and rule.path == case.rule_at
        and bool(rule.policy) == case.admission
        and case.about in rule.message
    )


def rule_for(case: Case, rules: list[Rule] | None = None) -> Rule:
    matches = [
        rule for rule in (crd_rules() if rules is None else rules) if matches_case(rule, case)
    ]
    assert len(matches) == 1, (
        f"case {case.name}: {len(matches)} rules of {case.kind} at {dotted(case.rule_at)} "
        f"mention {case.about!r}; the case table is out of date with crds/"
    )
    return matches[0]


def base_object(kind: str, name: str, spec: JsonDict) -> JsonDict:
    base = {"BranchClaim": CLAIM_SPEC, "ReservationPool": POOL_SPEC}.get(kind, ENVELOPE_SPEC)
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "metadata": {"name": name},
        "spec": {**copy.deepcopy(base), **copy.deepcopy(spec)},
    }


HOLD = "reservoir.dev/test-hold"  # a finalizer nothing but these tests acts on


@dataclass
class Started:
    name: str
    applied: JsonDict  # what server-side apply set: the main resource
    applied_status: JsonDict  # and the status subresource


@pytest.fixture
def held(api: Api, space: str) -> Iterator[list[tuple[str, str]]]:
    """Objects the test holds with a finalizer: released at the end, so they go away."""
    objects: list[tuple[str, str]] = []
    yield objects
    for kind, name in objects:
        api.json_patch(kind, space, name, [{"op": "remove", "path": "/metadata/finalizers"}])


def start(api: Api, ns: str, case: Case, held: list[tuple[str, str]]) -> Started:
    """Create the case's starting object by server-side apply (so that a later apply can
    remove the fields it set), its status through /status, and delete it if the case starts
    from an object being deleted."""
    name = object_name(case.kind, case.name[:40])
    obj = base_object(case.kind, name, case.spec)
    if case.deleting:
        obj["metadata"]["finalizers"] = [HOLD]
        held.append((case.kind, name))
    reply = api.apply(obj, ns)
    assert reply.ok, f"case {case.name}: the starting object is refused: {reply}"
    status_obj: JsonDict = {}
    if case.status is not None:
        status_obj = {
            "apiVersion": API_VERSION,
            "kind": case.kind,
            "metadata": {"name": name},
            "status": copy.deepcopy(case.status),
        }
        reply = api.apply(status_obj, ns, status=True)
        assert reply.ok, f"case {case.name}: the starting status is refused: {reply}"
    if case.deleting:
        reply = api.send("DELETE", api.url(case.kind, ns, name))
        assert reply.ok, reply
        assert api.get(case.kind, ns, name)["metadata"].get("deletionTimestamp")
    return Started(name, obj, status_obj)


def violate(api: Api, ns: str, case: Case, name: str) -> Reply:
    status = "status" in case.violation
    return api.merge(case.kind, ns, name, case.violation, status=status)


WARN_BINDING = "crd-rules-test-warn"  # see `policies`
BINDINGS = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"


@pytest.fixture(scope="module")
def policies(api: Api, space: str) -> Iterator[None]:
    """An admission policy takes a moment to be in force after it is created (the `crds`
    fixture only waits for the CRDs): wait until each policy case's violation is refused.

    A policy's Deny answer names only the first of its rules that fails, so it cannot show
    that a case breaks one rule alone (found by review). A second binding of each policy,
    with the Warn action, names every rule that fails in a Warning header: `refused_by`
    counts them."""
    names = {doc["metadata"]["name"] for doc in manifests() if is_policy(doc)}
    for name in names:
        body = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": f"{WARN_BINDING}-{name}"},
            "spec": {"policyName": name, "validationActions": ["Warn"]},
        }
        reply = api.send("POST", BINDINGS, body)
        assert reply.ok or reply.code == 409, reply
    try:
        wait_until_in_force(api, space)
        yield
    finally:
        for name in names:
            api.send("DELETE", f"{BINDINGS}/{WARN_BINDING}-{name}")


def wait_until_in_force(api: Api, space: str) -> None:
    """Until each policy case's violation is refused by its rule, and warned of by it alone."""
    for case in CASES:
        if not case.admission:
            continue
        rule = rule_for(case)
        holding: list[tuple[str, str]] = []
        deadline = time.monotonic() + 60
        try:
            while True:
                reply = violate(api, space, case, start(api, space, case, holding).name)
                if refused_by(reply, rule) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        finally:
            for kind, name in holding:
                api.json_patch(
                    kind, space, name, [{"op": "remove", "path": "/metadata/finalizers"}]
                )


# --- every rule is accounted for ---------------------------------------------------------


def test_every_rule_in_the_crds_is_classified() -> None:
    """No cluster needed: a transition rule without a case here fails this test."""
    rules = crd_rules()
    assert {rule.kind for rule in rules} == set(PLURALS), "every CRD declares rules"
    transition = [rule for rule in rules if rule.transition]
    stateless = [rule for rule in rules if not rule.transition]
    assert transition and stateless

    for rule in transition:
        assert any(matches_case(rule, case) for case in CASES), (
            f"{rule.where}: transition rule {rule.message!r} ({rule.rule}) has no case in "
            "CASES: add a starting object and a change only this rule refuses"
        )
        assert "*" not in rule.path and "[]" not in rule.path, (
            f"{rule.where}: a transition rule under a map or list; removing its entry skips "
            "it, and the cases here cannot express that: add a test for it"
        )

    by_message: dict[str, set[str]] = {}
    for rule in stateless:
        # Without oldSelf a rule judges only the new object; optionalOldSelf would not apply.
        assert not rule.optional_old_self, f"{rule.where}: optionalOldSelf without oldSelf"
        by_message.setdefault(rule.message, set()).add(rule.rule)
        assert any(
            kind == rule.kind and about in rule.message for kind, about, _ in STATELESS_EXAMPLES
        ), (
            f"{rule.where}: rule {rule.message!r} has no example in STATELESS_EXAMPLES "
            "(a forbidden value showing it is checked on create and on update)"
        )
    for message, texts in by_message.items():
        assert len(texts) == 1, f"one message, different rules: {message!r}: {texts}"

    for case in CASES:  # and no case is left over from a rule that is gone
        rule_for(case, rules)
    for kind, about, _ in STATELESS_EXAMPLES:
        assert any(r.kind == kind and about in r.message for r in stateless), (kind, about)

    # A policy only binds once bound: each one in crds/ comes with a Deny binding.
    docs = manifests()
    bound = {
        doc["spec"]["policyName"]
        for doc in docs
        if doc.get("kind") == "ValidatingAdmissionPolicyBinding"
        and "Deny" in doc["spec"].get("validationActions", [])
    }
    for doc in docs:
        if is_policy(doc):
            assert doc["metadata"]["name"] in bound, f"policy {doc['metadata']['name']} unbound"
            assert doc["spec"].get("failurePolicy", "Fail") == "Fail", doc["metadata"]["name"]


@pytest.mark.parametrize(
    ("kind", "about", "spec"),
    STATELESS_EXAMPLES,
    ids=[f"{k}-{a}" for k, a, _ in STATELESS_EXAMPLES],
)
def test_a_rule_without_old_self_is_checked_on_create_and_on_update(
    api: Api, space: str, policies: None, kind: str, about: str, spec: JsonDict
) -> None:
    refused = api.create(base_object(kind, object_name(kind, "stateless"), spec), space)
    assert refused.invalid and any(about in message for _, message in refused.causes), refused

    name = object_name(kind, "stateless")
    assert api.create(base_object(kind, name, {}), space).ok
    before = api.get(kind, space, name)
    refused = api.merge(kind, space, name, {"spec": spec})
    assert refused.invalid and any(about in message for _, message in refused.causes), refused
    after = api.get(kind, space, name)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


# --- (a) the forbidden change is refused, by this rule alone ------------------------------


def refused_by(reply: Reply, rule: Rule) -> bool:
    """Refused by this rule and by no other: each rule is shown to work on its own (for a
    policy's rule, the Warn binding of `policies` names each of its rules that failed)."""
    if not reply.invalid or len(reply.causes) != 1:
        return False
    if rule.policy:
        failed = [w for w in reply.warnings if f"ValidatingAdmissionPolicy '{rule.policy}'" in w]
        if len(failed) != 1 or rule.message not in failed[0]:
            return False
    where, message = reply.causes[0]
    # A schema rule names its field ("<nil>" for the root); a policy names none.
    expected = "" if rule.policy else (dotted(rule.path) if rule.path else "<nil>")
    return where == expected and message.endswith(f": {rule.message}")


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_transition_rule_refuses_its_violation(
    api: Api, space: str, policies: None, held: list[tuple[str, str]], case: Case
) -> None:
    rule = rule_for(case)
    name = start(api, space, case, held).name
    before = api.get(case.kind, space, name)
    assert case.holds(before, before) and not shows(before, case.violation), case.name

    reply = violate(api, space, case, name)

    assert refused_by(reply, rule), f"{case.name}: expected {rule.message!r}, got {reply}"
    after = api.get(case.kind, space, name)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


# --- (b), (c) removing the field, or a parent, first does not get around it -----------------

REMOVALS = (
    "merge-null",  # JSON merge patch {"spec": {"field": null}}
    "json-remove",  # JSON patch {"op": "remove"}
    "json-null",  # JSON patch {"op": "replace", "value": null}
    "put-without",  # GET, drop the field, PUT (kubectl replace, controllers' update)
    "put-null",  # GET, set the field to null, PUT
    "apply-without",  # server-side apply of what was applied, without the field
)


def remove(api: Api, ns: str, case: Case, obj: Started, target: FieldPath, how: str) -> Reply:
    status = target[0] == "status"
    if how == "merge-null":
        return api.merge(case.kind, ns, obj.name, nest(target, None), status)
    if how in ("json-remove", "json-null"):
        op: JsonDict = {"op": "remove", "path": pointer(target)}
        if how == "json-null":
            op = {"op": "replace", "path": pointer(target), "value": None}
        return api.json_patch(case.kind, ns, obj.name, [op], status)
    if how in ("put-without", "put-null"):
        stored = api.get(case.kind, ns, obj.name)
        parent = at(stored, target[:-1])
        if how == "put-without":
            del parent[target[-1]]
        else:
            parent[target[-1]] = None
        return api.put(stored, ns, status)
    assert how == "apply-without", how
    applied = copy.deepcopy(obj.applied_status if status else obj.applied)
    parent = at(applied, target[:-1])
    if parent is not MISSING:
        parent.pop(target[-1], None)  # a field the apply never set is not the applier's to drop
    return api.apply(applied, ns, status)


def attempt(
    api: Api, ns: str, case: Case, name: str, first: tuple[str, Callable[[], Reply]]
) -> None:
    """Run `first`, then the violation; after each write the stored object must still keep
    what the rule protects, and the sequence must end refused."""
    before = api.get(case.kind, ns, name)
    assert case.holds(before, before) and not shows(before, case.violation), case.name
    history: list[str] = []
    reply = Reply(0, {})
    for label, write in (first, (f"write {case.violation}", lambda: violate(api, ns, case, name))):
        reply = write()
        history.append(f"{label}: {reply}")
        now = api.get(case.kind, ns, name)
        bypassed = f"{case.name}: the rule {case.about!r} was bypassed: {history}"
        assert not shows(now, case.violation), bypassed
        assert case.holds(before, now), bypassed
    assert reply.invalid, f"{case.name}: the sequence did not end refused: {history}"


REMOVAL_SEQUENCES = [
    pytest.param(case, target, how, id=f"{case.name}-{dotted(target)}-{how}")
    for case in CASES
    for target in case.targets()
    for how in REMOVALS
]


@pytest.mark.parametrize(("case", "target", "how"), REMOVAL_SEQUENCES)
def test_removing_a_field_first_does_not_bypass_a_transition_rule(
    api: Api,
    space: str,
    policies: None,
    held: list[tuple[str, str]],
    case: Case,
    target: FieldPath,
    how: str,
) -> None:
    rule_for(case)  # the rule is still in crds/
    obj = start(api, space, case, held)
    stored = api.get(case.kind, space, obj.name)
    assert at(stored, target) is not MISSING, f"{case.name}: the start has no {dotted(target)}"
    removal = (
        f"remove {dotted(target)} ({how})",
        lambda: remove(api, space, case, obj, target, how),
    )
    attempt(api, space, case, obj.name, removal)


# --- detours: another value first for a field the rule reads --------------------------------

DETOUR_SEQUENCES = [
    pytest.param(case, detour, id=f"{case.name}-{describe(detour)}")
    for case in CASES
    for detour in case.detours
]


@pytest.mark.parametrize(("case", "detour"), DETOUR_SEQUENCES)
def test_changing_what_a_rule_reads_first_does_not_bypass_it(
    api: Api, space: str, policies: None, held: list[tuple[str, str]], case: Case, detour: JsonDict
) -> None:
    rule_for(case)
    name = start(api, space, case, held).name
    status = "status" in detour
    change = (f"write {detour}", lambda: api.merge(case.kind, space, name, detour, status))
    attempt(api, space, case, name, change)


# --- one definition of a quantity: the API server accepts what the operator parses --------

QUANTITY_CORPUS = [
    # the examples the operator documents, and their neighbours at every limit
    "8", "20k", "1.5Gi", "250m", "12.50", "1e3", "1E", "1E+3", ".5", "0.5m", "0.000001m",
    "1n", "3.000000001", "3.0000000001", "1e-3", "0.0000001m", "1.5n", "1.1234u", "1.123u",
    "1Ei", "1Pi", "1e18", "1e19", "0.1e19", "99e16", "1000000000000000000",
    "1000000000000000000.000000001", "999999999999999999.999999999", "1.000000001E",
    "0.000000001E", "0e99", "1e99", "-1", "+1", "1.5e2", "1.5E2", "1e+3", "1e", "e3", "1.",
    ".", "", "0", "00012", "1K", "1k", "1ki", "1Ki", "1mi", "1.5.5", "abc", "1 k", "0x10",
    "NaN", "Infinity", "1_000",
    # whitespace, and a value longer than the schema's maxLength (40)
    " 8", "8 ", "\t8", "8\n", "0" * 40 + "1", "0" * 39 + "1",
]  # fmt: skip

QUANTITY_MAPS = [
    ("BranchClaim", ("spec", "usage")),
    ("BranchClaim", ("spec", "requests")),
    ("ReservationEnvelope", ("spec", "capacity")),
]


def operator_parses(text: str) -> bool:
    try:
        parse_quantity(text)
    except QuantityError:
        return False
    return True


def server_accepts(api: Api, ns: str, kind: str, where: FieldPath, text: str) -> bool:
    obj = base_object(kind, unique("quantity"), {})
    at(obj, where[:-1])[where[-1]] = {"tokens": text}
    reply = api.create(obj, ns, dry_run=True)  # validated in full, never stored
    if reply.ok:
        return True
    assert reply.invalid, reply
    # Refused for the quantity, not for anything else ("<nil>" notes skipped rules).
    fields = {name for name, _ in reply.causes} - {"<nil>"}
    assert fields and all(name.startswith(dotted(where)) for name in fields), reply
    return False


@pytest.mark.parametrize(
    ("kind", "where"), QUANTITY_MAPS, ids=[dotted(w) for _, w in QUANTITY_MAPS]
)
def test_the_api_server_accepts_exactly_the_quantities_the_operator_parses(
    api: Api, space: str, kind: str, where: FieldPath
) -> None:
    verdicts = {text: server_accepts(api, space, kind, where, text) for text in QUANTITY_CORPUS}
    parses = {text: operator_parses(text) for text in QUANTITY_CORPUS}
    assert sum(verdicts.values()) > 10, "the corpus exercises accepted quantities too"
    mismatches = {
        text: f"API server {'accepts' if verdicts[text] else 'refuses'}, "
        f"parse_quantity {'accepts' if parses[text] else 'refuses'}"
        for text in QUANTITY_CORPUS
        if verdicts[text] != parses[text]
    }
    assert not mismatches, "\n".join(f"{text!r}: {verdict}" for text, verdict in mismatches.items())


_DIGITS = st.text("0123456789", min_size=1, max_size=20)
_SUFFIXES = ["", "n", "u", "m", "k", "K", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi"]
_SUFFIXES += ["Ei", "e", "E", "i", "e-", "e+"]
quantity_like = st.one_of(
    # arbitrary short strings over every character a quantity is made of
    st.text("0123456789.+-eEinumkKMGTP \n", max_size=12),
    # well-formed shapes near the limits: integer part, fraction, suffix or exponent
    st.builds(
        lambda whole, fraction, suffix, exponent: (
            whole + (f".{fraction}" if fraction is not None else "") + suffix + exponent
        ),
        st.one_of(st.just(""), _DIGITS),
        st.one_of(st.none(), st.text("0123456789", max_size=11)),
        st.sampled_from(_SUFFIXES),
        st.one_of(st.just(""), st.text("0123456789", min_size=1, max_size=3)),
    ),
)


@settings(max_examples=400, deadline=None)
@given(text=quantity_like)
def test_random_quantities_are_judged_alike_by_the_api_server_and_the_operator(
    api: Api, space: str, text: str
) -> None:
    accepted = server_accepts(api, space, "BranchClaim", ("spec", "usage"), text)
    parses = operator_parses(text)
    assert accepted == parses, (
        f"{text!r}: API server {'accepts' if accepted else 'refuses'} it in spec.usage, "
        f"parse_quantity {'accepts' if parses else 'refuses'} it"
    )


# --- an envelope always has a capacity -----------------------------------------------------

EMPTY_CAPACITY_ON_CREATE = [
    ("null", {"capacity": None}),
    ("empty", {"capacity": {}}),
    ("only-null-values", {"capacity": {"tokens": None}}),
    ("missing", None),
]


@pytest.mark.parametrize(
    ("case", "spec"), EMPTY_CAPACITY_ON_CREATE, ids=[c for c, _ in EMPTY_CAPACITY_ON_CREATE]
)
def test_an_envelope_without_capacity_cannot_be_created(
    api: Api, space: str, case: str, spec: JsonDict | None
) -> None:
    name = unique("nocap")
    obj = base_object("ReservationEnvelope", name, {})
    if spec is None:
        del obj["spec"]["capacity"]
    else:
        obj["spec"].update(spec)
    writes: list[Callable[[], Reply]] = [
        lambda: api.create(obj, space),
        lambda: api.apply(obj, space),  # server-side apply creates too
    ]
    for write in writes:
        reply = write()
        assert reply.invalid, f"capacity {case}: {reply}"
        assert any(where.startswith("spec.capacity") for where, _ in reply.causes), reply.causes
        assert not api.exists("ReservationEnvelope", space, name)


def _with_capacity(obj: JsonDict, capacity: Any) -> JsonDict:
    """`obj` with its spec's capacity set to `capacity`, or without one for MISSING."""
    if capacity is MISSING:
        del obj["spec"]["capacity"]
    else:
        obj["spec"]["capacity"] = capacity
    return obj


def _put(capacity: Any) -> Callable[[Api, str, str], Reply]:
    return lambda api, ns, name: api.put(
        _with_capacity(api.get("ReservationEnvelope", ns, name), capacity), ns
    )


def _json(*ops: JsonDict) -> Callable[[Api, str, str], Reply]:
    return lambda api, ns, name: api.json_patch("ReservationEnvelope", ns, name, list(ops))


def _merge(patch: JsonDict) -> Callable[[Api, str, str], Reply]:
    return lambda api, ns, name: api.merge("ReservationEnvelope", ns, name, patch)


def _apply(capacity: Any) -> Callable[[Api, str, str], Reply]:
    return lambda api, ns, name: api.apply(
        _with_capacity(base_object("ReservationEnvelope", name, {}), capacity), ns
    )


EMPTY_CAPACITY_ON_UPDATE = [
    ("merge-null", _merge({"spec": {"capacity": None}})),
    ("merge-every-key-null", _merge({"spec": {"capacity": {"tokens": None, "cost": None}}})),
    ("json-remove", _json({"op": "remove", "path": "/spec/capacity"})),
    ("json-replace-null", _json({"op": "replace", "path": "/spec/capacity", "value": None})),
    ("json-replace-empty", _json({"op": "replace", "path": "/spec/capacity", "value": {}})),
    ("json-remove-every-key", _json({"op": "remove", "path": "/spec/capacity/tokens"},
                                    {"op": "remove", "path": "/spec/capacity/cost"})),
    ("put-null", _put(None)),
    ("put-empty", _put({})),
    ("put-without", _put(MISSING)),
    ("apply-empty", _apply({})),
    ("apply-without", _apply(MISSING)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "write"), EMPTY_CAPACITY_ON_UPDATE, ids=[c for c, _ in EMPTY_CAPACITY_ON_UPDATE]
)
def test_an_envelopes_capacity_cannot_be_nulled_or_emptied(
    api: Api, space: str, case: str, write: Callable[[Api, str, str], Reply]
) -> None:
    name = unique("cap")
    assert api.apply(base_object("ReservationEnvelope", name, {}), space).ok
    before = api.get("ReservationEnvelope", space, name)

    reply = write(api, space, name)

    assert reply.invalid, f"capacity {case}: {reply}"
    assert any(where.startswith("spec.capacity") for where, _ in reply.causes), reply.causes
    after = api.get("ReservationEnvelope", space, name)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["spec"]["capacity"] == ENVELOPE_SPEC["capacity"]
