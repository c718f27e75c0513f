"""What every kind's model shares: the API group and version, the bounds that keep each
object small (for etcd and the API server's CEL cost budget), the `Quantity` type and the
resource-map field helpers with their CEL rules, the `Model` base, the enums several kinds
use (claim phases, outcomes, triggers, envelope phases, ...) and `Condition`."""

from __future__ import annotations

import copy
from datetime import date, datetime, timedelta
from decimal import Decimal
from enum import Enum, StrEnum
from typing import Annotated, Any, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
)
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

from reservoir.core.quantity import (
    MAX_QUANTITY_LENGTH,
    QUANTITY_PATTERN,
    format_quantity,
    parse_quantity,
)

API_GROUP = "reservoir.dev"
API_VERSION = "v1alpha1"

# Bounds keep every object small enough for etcd and cheap for the API server's CEL cost
# budget. An envelope's record of lines in flight at MAX_LEDGER_ENTRIES stays far below
# etcd's ~1.5 MiB object cap (measured by tests/unit/test_ledger_size.py); each claim holds
# its own line, so no object grows with the number of claims. Every list, map and string
# of every spec and status is bounded (no schemaless field): a spec at every bound is at most
# SPEC_WORST_CASE_BYTES, 240,000 (a claim's, with placement hints and compensations:
# 229,143), computed from the generated schema by tests/unit/test_crds.py.
MAX_RESOURCES = 16
MAX_LEDGER_ENTRIES = 512
MAX_ACTIVE_CLAIMS_LIMIT = 100_000
MAX_NAME_LENGTH = 253
MAX_CONDITIONS = 16
MAX_SECONDS = 366 * 24 * 3600
SUMMARY_LENGTH = 1024  # one printer-column rendering of the totals
# Texts the operator generates (reservoir.core.text bounds them where they are made).
MESSAGE_LENGTH = 1024  # a condition's message, a queue reason
REASON_LENGTH = 64  # a condition's reason, a settlement's: one CamelCase word
# Resources held on real devices through Dynamic Resource Allocation (DESIGN.md §7), and
# the DeviceClass their devices come from. A claim's request for one is a device count.
DEVICE_CLASSES = {"nvidia.com/gpu": "gpu.reservoir.dev"}
MAX_DEVICES_PER_CLAIM = 32  # DRA allocates node-local devices: no node has more
MAX_DEVICE_NAME_LENGTH = 63
# Budgets nest (DESIGN.md §4): pool → envelope → child envelope → ...; a root envelope is at
# depth 1. Deeper trees are refused: every level is one more settlement to wait for.
MAX_DEPTH = 4
# Lines a ledger holds at once, settled ones included: child envelopes in an envelope's
# (their worst-case bytes are reserved in its byte budget, see reservoir.core.ledgersize),
# root envelopes in a pool's (fewer when its resources' names are long: see pool_lines).
MAX_ENVELOPE_CHILDREN = 64
MAX_CHILDREN = 256
MAX_POOL_NAMESPACES = 64
MAX_LOANS = 8  # loans an envelope has out (or in) at once
MAX_RESULT_LENGTH = 256  # a result reference: a URI or an object's name, not the result
# A lease's generation counts its grants: one a second for a year is far below it.
MAX_LEASE_GENERATION = 2**31 - 1
MAX_TRANSITIONS = 6  # the phase graph is acyclic: at most 5 moves, plus an adjustment
MAX_ERROR_LENGTH = 96

Quantity = Annotated[
    Decimal,
    BeforeValidator(parse_quantity),
    PlainSerializer(format_quantity, return_type=str),
    WithJsonSchema(
        {"type": "string", "pattern": QUANTITY_PATTERN, "maxLength": MAX_QUANTITY_LENGTH}
    ),
]

RESOURCE_NAME = "^([a-z0-9.-]{1,253}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
RESOURCE_NAME_RULE: JsonDict = {
    "rule": f"self.all(k, size(k) <= 63 && k.matches('{RESOURCE_NAME}'))",
    "message": "resource names look like 'tokens', 'cost' or 'nvidia.com/gpu' "
    "(an optional DNS prefix and a name of at most 63 characters)",
}


DEVICE_COUNT_RULE: JsonDict = {
    "rule": " && ".join(
        f"(!('{name}' in self) || (quantity(self['{name}']).isInteger() && "
        f"quantity(self['{name}']).compareTo(quantity('{MAX_DEVICES_PER_CLAIM}')) <= 0))"
        for name in DEVICE_CLASSES
    ),
    "message": f"device resources ({', '.join(DEVICE_CLASSES)}) are whole numbers of devices, "
    f"at most {MAX_DEVICES_PER_CLAIM} per claim (devices are held on one node)",
}

QUANTITY_BOUND_RULE: JsonDict = {
    "rule": "self.all(k, quantity(self[k]).compareTo(quantity('1E')) <= 0)",
    "message": "quantities may not exceed 1E (10^18)",
}


def resource_map(description: str, *rules: JsonDict, required: bool = False) -> Any:
    """A bounded map of resource name to quantity, e.g. {"tokens": "20k"}.

    A map with a transition rule (one that reads oldSelf) is either required or defaults
    to `{}` in the schema: the API server fills a removed map back in before validation,
    so the rule cannot be skipped by deleting the field (a transition rule only runs when
    both the old and the new value exist)."""
    extra: JsonDict = {
        "maxProperties": MAX_RESOURCES,
        "x-kubernetes-validations": [RESOURCE_NAME_RULE, QUANTITY_BOUND_RULE, *rules],
    }
    if not required and any("oldSelf" in str(rule.get("rule")) for rule in rules):
        extra["default"] = {}
    if required:
        return Field(description=description, json_schema_extra={**extra, "minProperties": 1})
    return Field(default_factory=dict, description=description, json_schema_extra=extra)


def recorded_map(description: str) -> Any:
    """A bounded map of resource name to quantity that the operator records (a ledger
    line, a total, a claim's status): no CEL rules. Its names and amounts come from specs
    the rules of `resource_map` already checked, and a rule here would run again on every
    map of every ledger entry on each ledger write (about a tenth of the API server's CPU
    for writing a 40-entry ledger, measured on this project's control plane). A status
    write is the operator's, never a user's input."""
    return Field(
        default_factory=dict,
        description=description,
        json_schema_extra={"maxProperties": MAX_RESOURCES},
    )


ResourceMap = dict[str, Quantity]


class Model(BaseModel):
    """Base: camelCase on the wire, snake_case in Python, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
    )

    def to_api(self) -> dict[str, Any]:
        """The object as the Kubernetes API wants it: camelCase, no nulls."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def copied(self) -> Self:
        """A deep copy, made field by field. `model_copy(deep=True)` goes through
        `copy.deepcopy` (a memo of every object, datetimes copied by pickling them): about
        25 µs for a one-transition ledger line, and a pass copies each line it may move,
        so at 100 live claims an envelope those copies were a quarter of the operator's
        CPU (the scale benchmark under pyinstrument). Immutable values are shared, as
        `deepcopy` shares them too."""
        if self.__pydantic_private__ or self.__pydantic_extra__:
            return self.model_copy(deep=True)  # state beyond the fields: pydantic's own way
        cls = type(self)
        twin = cls.__new__(cls)
        object.__setattr__(twin, "__dict__", _copied(self.__dict__))
        object.__setattr__(twin, "__pydantic_extra__", None)
        object.__setattr__(twin, "__pydantic_fields_set__", set(self.__pydantic_fields_set__))
        object.__setattr__(twin, "__pydantic_private__", None)
        return twin


# Values a copy shares with its original: nothing can change them in place. `_SHARED` holds
# their exact types (a set lookup, where isinstance over a tuple costs several), and learns
# each subclass (an enum, a StrEnum) the first time it meets one.
_IMMUTABLE = (str, int, Decimal, datetime, date, timedelta, Enum, type(None))
_SHARED: set[type] = {*_IMMUTABLE, bool}


def _copied(value: Any) -> Any:
    kind = type(value)
    if kind in _SHARED:
        return value
    if kind is dict:
        return {k: v if type(v) in _SHARED else _copied(v) for k, v in value.items()}
    if kind is list:
        return [_copied(v) for v in value]
    if isinstance(value, Model):
        return value.copied()
    if isinstance(value, _IMMUTABLE):  # an enum, a subclass of str or int
        _SHARED.add(kind)
        return value
    return copy.deepcopy(value)  # anything else: the slow way, never wrong


# Models kept for long (each live claim's parsed spec and ledger line, from pass to pass)
# share their set of the fields given: pydantic keeps one per model instance, 728 bytes
# from five names up, as much as the values (measured: 2.6 of a claim's 6 KB of parsed
# facts). Nothing here reads those sets (no `exclude_unset`) or changes one in place:
# models are never assigned to, and every copy makes its own (`copied`, `model_copy`).
# Bounded: past it the table starts again. A tenant choosing which optional fields its
# claims give can make many distinct sets (names come from the schema, never from the
# tenant, so each is small): 512 of them hold about a MiB, and the usual handful of
# shapes are all that a cluster keeps in it.
SHARED_FIELD_SETS = 512
_field_sets: dict[frozenset[str], set[str]] = {}


def share_field_sets(value: Any) -> None:
    """In place: each model within `value` (a model, or lists and dicts of them) given the
    one shared set of its given fields' names, of every model given the same names."""
    kind = type(value)
    if kind in _SHARED:
        return
    if isinstance(value, BaseModel):
        key = frozenset(value.__pydantic_fields_set__)
        shared = _field_sets.get(key)
        if shared is None:
            if len(_field_sets) >= SHARED_FIELD_SETS:
                _field_sets.clear()
            shared = _field_sets[key] = set(key)
        object.__setattr__(value, "__pydantic_fields_set__", shared)
        for field in value.__dict__.values():
            if type(field) not in _SHARED:
                share_field_sets(field)
    elif kind is list:
        for item in value:
            share_field_sets(item)
    elif kind is dict:
        for item in value.values():
            share_field_sets(item)
    elif isinstance(value, _IMMUTABLE):  # an enum, a subclass of str or int
        _SHARED.add(kind)


class CommitPoint(StrEnum):
    """The event that makes a claim chargeable: no longer freely releasable."""

    DISPATCH = "Dispatch"
    POD_SCHEDULED = "PodScheduled"
    POD_RUNNING = "PodRunning"


class Outcome(StrEnum):
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"


class UpstreamState(StrEnum):
    """How far the provider has confirmed the work: accepted is not running."""

    SUBMITTED = "Submitted"
    ACCEPTED = "Accepted"
    RUNNING = "Running"

    @property
    def rank(self) -> int:
        """How far it has got: the state only moves up (CEL rule UPSTREAM_RANK)."""
        return list(UpstreamState).index(self)


class ProviderState(StrEnum):
    """What the provider says about the upstream operation, in the response contract's words.
    Succeeded, Failed, Cancelled and NeverStarted are terminal answers: authoritative, the
    claim settles on them (the first three only with the usage: a completion that does not
    say what was used is not proof of zero usage). Unknown (or a lookup that failed) keeps
    the claim as it is."""

    PENDING = "Pending"  # accepted or queued, not started
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"
    NEVER_STARTED = "NeverStarted"  # never started and never will: nothing ran
    UNKNOWN = "Unknown"

    @property
    def terminal(self) -> bool:
        return self in (
            ProviderState.SUCCEEDED,
            ProviderState.FAILED,
            ProviderState.CANCELLED,
            ProviderState.NEVER_STARTED,
        )


class UpstreamCancel(StrEnum):
    """What a cancel after the commit point does upstream, when the provider supports it."""

    NEVER = "Never"  # record the request only
    SUSPEND = "Suspend"  # HTTP: the cancel call; a Job: spec.suspend=true
    DELETE = "Delete"  # HTTP: the cancel call; a Job, Pod or other object: deleted


class LateCompletion(StrEnum):
    """What a final report (or provider answer) after a deadline decision does."""

    ADJUST = "Adjust"  # one recorded adjustment while the envelope is open
    RECORD = "Record"  # recorded only


class Trigger(StrEnum):
    """Who or what moved a claim: the source of the fact a transition was decided on."""

    ADMISSION = "Admission"  # the operator's queue
    WORKER = "Worker"  # the claim's spec: dispatch, cancel, usage, a final report
    POD = "Pod"  # a workload pod bound, started, or went away
    PROVIDER = "Provider"  # a provider lookup
    CLOCK = "Clock"  # a lease end, a deadline, a retry window
    PERSON = "Person"  # a force-settle annotation
    DELETION = "Deletion"  # the claim or its envelope was deleted
    SPECULATION = "Speculation"  # another copy of its speculation group won
    PREEMPTION = "Preemption"  # its envelope gave its room to a higher class (a pool's)


class ClaimPhase(StrEnum):
    PENDING = "Pending"
    TENTATIVE = "Tentative"
    COMMITTED = "Committed"
    RUNNING = "Running"
    DETACHED = "Detached"
    CONSUMED = "Consumed"
    RELEASED = "Released"
    EXPIRED = "Expired"
    REJECTED = "Rejected"

    @property
    def holds_capacity(self) -> bool:
        return self in HOLDING_PHASES

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_PHASES

    @property
    def committed(self) -> bool:
        """Past the commit point: a release can no longer return it without usage."""
        return self in (ClaimPhase.COMMITTED, ClaimPhase.RUNNING, ClaimPhase.DETACHED)


HOLDING_PHASES = frozenset(
    {ClaimPhase.TENTATIVE, ClaimPhase.COMMITTED, ClaimPhase.RUNNING, ClaimPhase.DETACHED}
)
TERMINAL_PHASES = frozenset(
    {ClaimPhase.CONSUMED, ClaimPhase.RELEASED, ClaimPhase.EXPIRED, ClaimPhase.REJECTED}
)


class EnvelopeState(StrEnum):
    OPEN = "Open"
    CLOSED = "Closed"


class EnvelopePhase(StrEnum):
    PENDING = "Pending"
    OPEN = "Open"
    CLOSING = "Closing"
    CLOSED = "Closed"
    EXPIRED = "Expired"


class ChildPhase(StrEnum):
    """A child envelope's line in its parent's ledger: its capacity held, or settled."""

    RESERVED = "Reserved"
    SETTLED = "Settled"


class ParentKind(StrEnum):
    """Where an envelope's capacity comes from."""

    ROOT = "Root"  # its own capacity: no parent, no pool covers its namespace
    ENVELOPE = "ReservationEnvelope"
    POOL = "ReservationPool"


class QueueBoundAction(StrEnum):
    """What happens to an operation the provider accepted but has not started, once the
    envelope's queue bound (or the provider's own deadline for the request) passes."""

    HOLD = "Hold"  # recorded; the capacity stays held until its facts settle it
    CANCEL = "Cancel"  # a cancel is requested (and forwarded): settled by its facts


class SpeculationWinner(StrEnum):
    """Which copy of a speculation group wins (child-settlement.txt: "When one attempt wins,
    cancel the others")."""

    FIRST_COMMIT = "FirstCommit"  # the first copy recorded at its commit point
    FIRST_SUCCESS = "FirstSuccess"  # the first copy recorded settled with outcome Succeeded


# A speculation group's name: a label value (63 characters), so that it can be selected on.
SPECULATION_GROUP = r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"


class DeadlineAction(StrEnum):
    """What happens to a Detached claim whose outcome is still unknown at its deadline."""

    HOLD = "Hold"
    QUARANTINE = "Quarantine"
    RELEASE = "Release"


class Fallback(StrEnum):
    """What a claim that cannot be admitted now does: wait in the queue, or fail at once."""

    WAIT = "Wait"
    FAIL = "Fail"


class PhysicalHold(StrEnum):
    """When a claim's devices are held: from admission, or only once its branch is chosen."""

    TENTATIVE = "Tentative"
    COMMIT = "Commit"


# Object names as Kubernetes makes them (RFC 1123 subdomains): a name is a path segment
# in the API's URLs, so nothing else may reach the operator's requests (found by review:
# "../../other-namespace/..." read and deleted other namespaces' objects).
OBJECT_NAME = "^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"


class Condition(Model):
    """A Kubernetes-style condition (metav1.Condition)."""

    type: str = Field(max_length=64, description="The condition's type, e.g. Committed.")
    status: str = Field(
        max_length=8,
        description="True, False or Unknown.",
        json_schema_extra={"enum": ["True", "False", "Unknown"]},
    )
    reason: str = Field(max_length=REASON_LENGTH, description="One CamelCase word: why.")
    message: str = Field(
        default="", max_length=MESSAGE_LENGTH, description="Human-readable detail."
    )
    last_transition_time: datetime = Field(description="When the status last changed.")
    observed_generation: int | None = Field(
        default=None, description="The spec generation this condition was computed from."
    )


DeviceNames = list[Annotated[str, Field(max_length=MAX_DEVICE_NAME_LENGTH)]]


def device_names(description: str) -> Any:
    """A claim's device names, bounded like its device count."""
    return Field(default_factory=list, max_length=MAX_DEVICES_PER_CLAIM, description=description)


def immutable(what: str) -> JsonDict:
    return {"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": f"{what}"}]}
