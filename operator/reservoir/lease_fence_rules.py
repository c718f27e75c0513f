"""The API server's half of fencing: the claim admission policy's rules on the lease.

lease-renewal.txt: writes are "conditional on the current job state, attempt ID, lease
version, and ownership token", and "the old owner should be fenced from further dispatch";
child-settlement.txt: workers "present the current lease generation when reporting usage",
and "Released or superseded attempts cannot start new work". The SDK checks all of it, but
anyone with the worker role can write a claim's spec with `kubectl patch`, so these rules
run in the API server (reservoir.crdgen puts them in the claim's ValidatingAdmissionPolicy),
on every update that changes the spec:

- a write that dispatches, or reports usage, a final report, an outcome, a result or a
  provider state must carry `spec.lease.fence`, equal to the claim's `status.lease` (holder
  and generation) as stored, and naming `spec.lease.holder` when the claim names one: a
  worker whose lease was renewed by another, handed to another, or never granted is refused;
- a settled claim (Expired, Released, Consumed) is never dispatched;
- a claim that never reached its commit point reports nothing: usage, an outcome or a
  provider state on it would charge work that never started.

Each reads absent fields as their defaults through has(): removing a field skips no rule.
The lease's holder and generation in `status.lease` are the operator's, written with the
claim's line (reservoir.core.claimstatus.current_lease). The rules share the policy's
`variables` (each named here), so each fact is spelled once."""

from __future__ import annotations

from reservoir.core.model import ClaimPhase

PAST_COMMIT_PHASES = [
    ClaimPhase.COMMITTED.value,
    ClaimPhase.RUNNING.value,
    ClaimPhase.DETACHED.value,
    ClaimPhase.CONSUMED.value,
]


def _either(path: str, default: str) -> str:
    """`object.spec.<path>` and `oldObject.spec.<path>` differ (absent read as `default`)."""
    head, _, _ = path.rpartition(".")
    new_has = f"has(object.spec.{head}) && " if head else ""
    old_has = f"has(oldObject.spec.{head}) && " if head else ""
    new = f"({new_has}has(object.spec.{path}) ? object.spec.{path} : {default})"
    old = f"({old_has}has(oldObject.spec.{path}) ? oldObject.spec.{path} : {default})"
    return f"{new} != {old}"


_NONE = "''"
_HAS_FENCE = "has(object.spec.lease) && has(object.spec.lease.fence)"
_OLD_LEASE = "has(oldObject.status) && has(oldObject.status.lease)"

# name -> CEL expression, in the order they may refer to each other (variables.<name>).
VARIABLES: dict[str, str] = {
    "dispatched": "has(object.spec.dispatch) && object.spec.dispatch",
    "dispatches": "variables.dispatched && "
    "!(has(oldObject.spec.dispatch) && oldObject.spec.dispatch)",
    # Usage, a final report, an outcome, a result or a provider state, new in this write.
    "reports": " || ".join(
        [
            _either("usage", "{}"),
            _either("final", "false"),
            _either("outcome", _NONE),
            _either("result", _NONE),
            _either("upstream.state", _NONE),
        ]
    ),
    "namedHolder": "has(object.spec.lease) && has(object.spec.lease.holder) ? "
    "object.spec.lease.holder : ''",
    # Granted to, or before any grant the holder the claim names.
    "leaseHolder": f"{_OLD_LEASE} && has(oldObject.status.lease.holder) ? "
    "oldObject.status.lease.holder : variables.namedHolder",
    # status.lease, else (a claim whose line was written before status.lease existed) the
    # generation its line implies, as the operator counts it.
    "leaseGeneration": f"{_OLD_LEASE} && has(oldObject.status.lease.generation) ? "
    "oldObject.status.lease.generation : (has(oldObject.status) && "
    "has(oldObject.status.ledger) && has(oldObject.status.ledger.firstReservedAt) ? "
    "(has(oldObject.status.ledger.renewals) ? oldObject.status.ledger.renewals : 0) + "
    "(has(oldObject.status.ledger.handovers) ? oldObject.status.ledger.handovers : 0) + 1 "
    ": 0)",
    "fenceHolder": f"{_HAS_FENCE} && has(object.spec.lease.fence.holder) ? "
    "object.spec.lease.fence.holder : ''",
    "fenceGeneration": f"{_HAS_FENCE} ? object.spec.lease.fence.generation : -1",
    "fenceIsCurrent": f"{_HAS_FENCE} && variables.fenceGeneration == variables.leaseGeneration "
    "&& variables.fenceHolder == variables.leaseHolder && "
    "(variables.namedHolder == '' || variables.fenceHolder == variables.namedHolder)",
    "settled": "has(oldObject.status) && ((has(oldObject.status.ledger) && "
    "has(oldObject.status.ledger.settlement)) || has(oldObject.status.settlement))",
    "oldPhase": "has(oldObject.status) && has(oldObject.status.phase) ? "
    "oldObject.status.phase : 'Pending'",
    # Dispatched (before or in this write) when that is its commit point, or recorded by
    # the operator as committed (its pod's binding or start).
    "reachedCommit": "((has(object.spec.commitPoint) ? object.spec.commitPoint : 'Dispatch') "
    "== 'Dispatch' && variables.dispatched) || (has(oldObject.status) && "
    "has(oldObject.status.ledger) && has(oldObject.status.ledger.committedAt)) || "
    f"variables.oldPhase in {PAST_COMMIT_PHASES}",
}

_SHOWN_FENCE = (
    f"({_HAS_FENCE} ? 'spec.lease.fence {{holder: \"' + variables.fenceHolder + "
    "'\", generation: ' + string(variables.fenceGeneration) + '}' : 'no spec.lease.fence')"
)
_SHOWN_LEASE = (
    "(variables.namedHolder != '' && variables.leaseHolder != variables.namedHolder ? "
    "'being handed to \"' + variables.namedHolder + '\" (spec.lease.holder), not granted yet' "
    ": '{holder: \"' + variables.leaseHolder + '\", generation: ' + "
    "string(variables.leaseGeneration) + '} (status.lease)')"
)


def lease_fence_variables() -> list[dict[str, str]]:
    """The policy's variables the validations below read. A create has no old object: the
    variables are evaluated only when read, and every validation that reads one reading
    `oldObject` is `oldObject == null || ...` (CEL's || is true once either side is)."""
    return [{"name": name, "expression": expression} for name, expression in VARIABLES.items()]


# Each refusal's message: what the stored claim shows (messageExpression), then the rule's
# fixed words (`message`, also what a client without the expression's result gets).
FENCE_RULE = (
    "a dispatch or report must carry the current lease; a worker whose lease moved on must "
    "stop (read the claim again)"
)
SETTLED_RULE = (
    "a dispatch now would start work nothing holds capacity for; create a new claim (new attempt)"
)
COMMIT_RULE = (
    "it cannot report usage, an outcome, a result or a provider state for work that never "
    "started (dispatch first, or wait until its pod's binding or hand-off is recorded)"
)


def _cel_text(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def lease_fence_validations() -> list[dict[str, str]]:
    """The policy's validations (over `object` and `oldObject`; a create is not fenced)."""
    return [
        {
            "expression": "oldObject == null || !(variables.dispatches || variables.reports) "
            "|| variables.fenceIsCurrent",
            "messageExpression": f"{_SHOWN_FENCE} + ', but the lease is ' + {_SHOWN_LEASE} + "
            f"': ' + {_cel_text(FENCE_RULE)}",
            "message": FENCE_RULE,
        },
        {
            "expression": "oldObject == null || !variables.dispatches || !variables.settled",
            "messageExpression": "'the claim already settled (' + variables.oldPhase + '): ' + "
            f"{_cel_text(SETTLED_RULE)}",
            "message": SETTLED_RULE,
        },
        {
            "expression": "oldObject == null || !variables.reports || variables.reachedCommit",
            "messageExpression": "'the claim has not reached its commit point (phase ' + "
            f"variables.oldPhase + '): ' + {_cel_text(COMMIT_RULE)}",
            "message": COMMIT_RULE,
        },
    ]
