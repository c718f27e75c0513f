"""Serving classes: named presets of envelope policy (client-disconnect.txt: interactive chat,
batch enrichment and agentic workflows "are different policy problems").

An envelope names its class (`spec.servingClass`); the class gives every policy field it
sets (lease length, queue bounds, the ambiguity deadline and what happens at it, the
cancellation mode) and the envelope's priority, and the envelope's own policy overrides any
field it sets itself. The CRD carries no defaults for these fields (reservoir.crdgen), so
what the envelope set is what its stored spec holds; a field neither sets keeps the
model's default. Three classes are built in; an administrator adds or replaces classes in
the chart (`servingClasses`, the operator's `--serving-classes FILE`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, ValidationError

from reservoir.core.model import (
    MAX_SECONDS,
    DeadlineAction,
    EnvelopePolicy,
    Model,
    QueueBoundAction,
    ReservationEnvelopeSpec,
    UpstreamCancel,
)

# The policy fields a class sets (snake_case), and the spec's priority.
CLASS_POLICY_FIELDS = (
    "default_lease_seconds",
    "max_claim_lifetime_seconds",
    "max_queue_seconds",
    "ambiguity_deadline_seconds",
    "at_ambiguity_deadline",
    "queue_bound_seconds",
    "at_queue_bound",
    "upstream_cancel",
)


class ClassPolicy(Model):
    """The part of an envelope's policy a serving class presets (each field optional)."""

    default_lease_seconds: int | None = Field(default=None, ge=1, le=MAX_SECONDS)
    max_claim_lifetime_seconds: int | None = Field(default=None, ge=1, le=MAX_SECONDS)
    max_queue_seconds: int | None = Field(default=None, ge=1, le=MAX_SECONDS)
    ambiguity_deadline_seconds: int | None = Field(default=None, ge=1, le=MAX_SECONDS)
    at_ambiguity_deadline: DeadlineAction | None = None
    queue_bound_seconds: int | None = Field(default=None, ge=1, le=MAX_SECONDS)
    at_queue_bound: QueueBoundAction | None = None
    upstream_cancel: UpstreamCancel | None = None


class ServingClass(Model):
    """A serving class: policy presets and the envelope's priority among its siblings."""

    description: str = Field(default="", max_length=512)
    policy: ClassPolicy = Field(default_factory=ClassPolicy)
    priority: int | None = Field(default=None, ge=-1_000_000, le=1_000_000)

    def presets(self) -> dict[str, Any]:
        return self.policy.model_dump(exclude_none=True)


BUILT_IN: dict[str, ServingClass] = {
    # A person waits on the answer: short leases, a short queue, disconnects release fast.
    "Interactive": ServingClass(
        description="a person waits: short leases, little queueing, quick release",
        policy=ClassPolicy(
            default_lease_seconds=30,
            max_claim_lifetime_seconds=900,
            max_queue_seconds=30,
            ambiguity_deadline_seconds=60,
            at_ambiguity_deadline=DeadlineAction.RELEASE,
            queue_bound_seconds=30,
            at_queue_bound=QueueBoundAction.CANCEL,
            upstream_cancel=UpstreamCancel.DELETE,
        ),
        priority=100,
    ),
    # Nobody waits: long leases, long queues, scarce capacity charged when in doubt.
    "Batch": ServingClass(
        description="nobody waits: long leases and queues, charged in full when in doubt",
        policy=ClassPolicy(
            default_lease_seconds=600,
            max_claim_lifetime_seconds=86_400,
            max_queue_seconds=86_400,
            ambiguity_deadline_seconds=3_600,
            at_ambiguity_deadline=DeadlineAction.QUARANTINE,
            at_queue_bound=QueueBoundAction.HOLD,
            upstream_cancel=UpstreamCancel.SUSPEND,
        ),
        priority=-100,
    ),
    # Many short branches, pruned often: leases of minutes, bounded provider queues.
    "Agentic": ServingClass(
        description="many short branches pruned often: minutes-long leases, bounded queues",
        policy=ClassPolicy(
            default_lease_seconds=120,
            max_claim_lifetime_seconds=7_200,
            max_queue_seconds=600,
            ambiguity_deadline_seconds=600,
            at_ambiguity_deadline=DeadlineAction.QUARANTINE,
            queue_bound_seconds=300,
            at_queue_bound=QueueBoundAction.CANCEL,
            upstream_cancel=UpstreamCancel.SUSPEND,
        ),
        priority=0,
    ),
}


class UnknownServingClassError(ValueError):
    """The envelope names a class the operator does not know."""


def parse_classes(raw: Mapping[str, Any]) -> dict[str, ServingClass]:
    """An administrator's classes (name -> {description, policy, priority}) over the built-in
    ones; ValueError naming the class and the field when one is malformed, or when its
    presets cannot make a policy (a lifetime shorter than the lease, say)."""
    classes = dict(BUILT_IN)
    for name, body in raw.items():
        try:
            made = ServingClass.model_validate(body)
            EnvelopePolicy.model_validate(made.presets())
        except ValidationError as error:
            problem = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
            )
            raise ValueError(f"serving class {name!r}: {problem}") from None
        classes[str(name)] = made
    return classes


def effective_spec(
    spec: ReservationEnvelopeSpec, classes: Mapping[str, ServingClass]
) -> ReservationEnvelopeSpec:
    """The envelope's spec with its class applied: each policy field the envelope did not
    set takes the class's preset, and so does its priority. Unchanged without a class."""
    name = spec.serving_class
    if name is None:
        return spec
    found = classes.get(name)
    if found is None:
        known = ", ".join(sorted(classes))
        raise UnknownServingClassError(f"spec.servingClass: no class {name!r} (known: {known})")
    explicit = {field: getattr(spec.policy, field) for field in spec.policy.model_fields_set}
    policy = EnvelopePolicy.model_validate({**found.presets(), **explicit})
    update: dict[str, Any] = {"policy": policy}
    if "priority" not in spec.model_fields_set and found.priority is not None:
        update["priority"] = found.priority
    return spec.model_copy(update=update)
