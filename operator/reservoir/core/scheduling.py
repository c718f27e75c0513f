"""The core/v1 scheduling types a claim's placement hints carry (Toleration, Affinity and
their parts), field for field, with every list, map and string bounded.

These hints are copied onto the claim's placeholder pod. They were schemaless
(x-kubernetes-preserve-unknown-fields): a claim whose affinity nested 2,000 levels deep
was stored, and the operator's cluster-wide watch of claims died decoding it (issue 21).
Typed, the API server refuses any field core/v1 does not have, any nesting it does not
have, and any list, map or string beyond the bounds below, as Kueue's ResourceFlavor types
its tolerations and node selectors.

The bounds are far above what a placement hint needs (a handful of terms) and keep the
worst case small: a Placement at every bound serializes to at most 170,000 bytes
(SCHEDULING_WORST_CASE_BYTES, computed from the generated schema by tests/unit/test_crds.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

# A label key (an optional DNS-subdomain prefix of at most 253 characters, '/', and a
# name of at most 63) and a label value, as k8s.io/apimachinery validates them.
LABEL_KEY = (
    "^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
MAX_LABEL_KEY_LENGTH = 317
LABEL_VALUE = "^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
MAX_LABEL_VALUE_LENGTH = 63
NAMESPACE_NAME = "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
NODE_NAME = "^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"

MAX_TOLERATIONS = 16
MAX_NODE_SELECTOR_LABELS = 16
MAX_TERMS = 4  # node selector terms, preferred node terms: per list
MAX_POD_TERMS = 2  # pod (anti-)affinity terms, required and preferred: per list
MAX_REQUIREMENTS = 4  # match expressions (or fields) per term
MAX_VALUES = 8  # values per requirement
MAX_SELECTOR_LABELS = 4  # matchLabels per label selector
MAX_NAMESPACES = 8
MAX_LABEL_KEYS = 4  # matchLabelKeys / mismatchLabelKeys

# Map keys have no maxLength in a structural schema: a CEL rule bounds them.
LABEL_KEYS_RULE: JsonDict = {
    "rule": f"self.all(k, size(k) <= {MAX_LABEL_KEY_LENGTH} && k.matches('{LABEL_KEY}'))",
    "message": "label keys look like 'example.com/name' (an optional DNS prefix and a name "
    "of at most 63 characters)",
}


class CoreModel(BaseModel):
    """camelCase on the wire (the core/v1 names), unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


LabelKey = str
LabelValue = str


def label_key(description: str) -> Any:
    return Field(
        min_length=1, max_length=MAX_LABEL_KEY_LENGTH, pattern=LABEL_KEY, description=description
    )


def label_values(description: str) -> Any:
    return Field(
        default_factory=list,
        max_length=MAX_VALUES,
        description=description,
        json_schema_extra={
            "items": {"type": "string", "maxLength": MAX_LABEL_VALUE_LENGTH, "pattern": LABEL_VALUE}
        },
    )


def labels(description: str, bound: int) -> Any:
    """A map of label key to label value (nodeSelector, matchLabels)."""
    return Field(
        default_factory=dict,
        description=description,
        json_schema_extra={
            "maxProperties": bound,
            "additionalProperties": {
                "type": "string",
                "maxLength": MAX_LABEL_VALUE_LENGTH,
                "pattern": LABEL_VALUE,
            },
            "x-kubernetes-validations": [LABEL_KEYS_RULE],
        },
    )


class Toleration(CoreModel):
    """A core/v1 Toleration."""

    key: LabelKey | None = Field(
        default=None,
        max_length=MAX_LABEL_KEY_LENGTH,
        pattern=LABEL_KEY,
        description="The taint key it tolerates; unset with operator Exists: every taint.",
    )
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (the default)."
    )
    value: LabelValue | None = Field(
        default=None,
        max_length=MAX_LABEL_VALUE_LENGTH,
        pattern=LABEL_VALUE,
        description="The taint value it matches (operator Equal).",
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="The taint effect it matches; unset: every effect."
    )
    toleration_seconds: int | None = Field(
        default=None,
        description="For NoExecute: how long the pod stays bound after the taint appears.",
    )


class NodeSelectorRequirement(CoreModel):
    key: LabelKey = label_key("The node label the requirement applies to.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(
        description="In, NotIn, Exists, DoesNotExist, Gt or Lt."
    )
    values: list[LabelValue] = label_values("The values (In, NotIn: any; Gt, Lt: one integer).")


class NodeFieldSelectorRequirement(CoreModel):
    """A requirement on a node field: Kubernetes supports only metadata.name, one value."""

    key: Literal["metadata.name"] = Field(description="The node field: metadata.name.")
    operator: Literal["In", "NotIn"] = Field(description="In or NotIn.")
    values: list[str] = Field(
        min_length=1,
        max_length=1,
        description="The node's name.",
        json_schema_extra={
            "items": {"type": "string", "maxLength": 253, "pattern": NODE_NAME},
        },
    )


class NodeSelectorTerm(CoreModel):
    match_expressions: list[NodeSelectorRequirement] = Field(
        default_factory=list,
        max_length=MAX_REQUIREMENTS,
        description="Requirements on node labels, all of which must hold.",
    )
    match_fields: list[NodeFieldSelectorRequirement] = Field(
        default_factory=list,
        max_length=MAX_REQUIREMENTS,
        description="Requirements on node fields, all of which must hold.",
    )


class NodeSelector(CoreModel):
    node_selector_terms: list[NodeSelectorTerm] = Field(
        min_length=1,
        max_length=MAX_TERMS,
        description="Terms of which at least one must hold.",
    )


class PreferredSchedulingTerm(CoreModel):
    weight: int = Field(ge=1, le=100, description="Weight, 1 to 100.")
    preference: NodeSelectorTerm = Field(description="The preferred node selector term.")


class NodeAffinity(CoreModel):
    required_during_scheduling_ignored_during_execution: NodeSelector | None = Field(
        default=None, description="Nodes the pod must land on."
    )
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, max_length=MAX_TERMS, description="Nodes the pod prefers."
    )


class LabelSelectorRequirement(CoreModel):
    key: LabelKey = label_key("The label key the requirement applies to.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="In, NotIn, Exists or DoesNotExist."
    )
    values: list[LabelValue] = label_values("The values (In, NotIn).")


class LabelSelector(CoreModel):
    """A meta/v1 LabelSelector."""

    match_labels: dict[LabelKey, LabelValue] = labels(
        "Labels that must all match.", MAX_SELECTOR_LABELS
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list,
        max_length=MAX_REQUIREMENTS,
        description="Requirements that must all hold.",
    )


class PodAffinityTerm(CoreModel):
    label_selector: LabelSelector | None = Field(default=None, description="The pods it is about.")
    namespace_selector: LabelSelector | None = Field(
        default=None, description="The namespaces it looks in, by label."
    )
    namespaces: list[str] = Field(
        default_factory=list,
        max_length=MAX_NAMESPACES,
        description="The namespaces it looks in, by name.",
        json_schema_extra={"items": {"type": "string", "maxLength": 63, "pattern": NAMESPACE_NAME}},
    )
    topology_key: LabelKey = label_key("The node label that defines co-location.")
    match_label_keys: list[LabelKey] = Field(
        default_factory=list,
        max_length=MAX_LABEL_KEYS,
        description="Pod label keys whose values must match the incoming pod's.",
        json_schema_extra={
            "items": {"type": "string", "maxLength": MAX_LABEL_KEY_LENGTH, "pattern": LABEL_KEY}
        },
    )
    mismatch_label_keys: list[LabelKey] = Field(
        default_factory=list,
        max_length=MAX_LABEL_KEYS,
        description="Pod label keys whose values must differ from the incoming pod's.",
        json_schema_extra={
            "items": {"type": "string", "maxLength": MAX_LABEL_KEY_LENGTH, "pattern": LABEL_KEY}
        },
    )


class WeightedPodAffinityTerm(CoreModel):
    weight: int = Field(ge=1, le=100, description="Weight, 1 to 100.")
    pod_affinity_term: PodAffinityTerm = Field(description="The preferred term.")


class PodAffinity(CoreModel):
    """core/v1 PodAffinity, and PodAntiAffinity (the same shape)."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = Field(
        default_factory=list, max_length=MAX_POD_TERMS, description="Terms that must hold."
    )
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, max_length=MAX_POD_TERMS, description="Terms preferred, by weight."
    )


class Affinity(CoreModel):
    """A core/v1 Affinity."""

    node_affinity: NodeAffinity | None = Field(default=None, description="Node affinity.")
    pod_affinity: PodAffinity | None = Field(default=None, description="Pod affinity.")
    pod_anti_affinity: PodAffinity | None = Field(default=None, description="Pod anti-affinity.")


# The most bytes the JSON of a claim's spec.placement, and of any spec of the three kinds,
# can take at every bound, computed from the generated schema by tests/unit/test_crds.py
# (at this commit: placement 165,487, a claim's spec 229,143 with its compensations, an
# envelope's 11,158, a pool's 8,063). A megabyte spec is refused by the API server;
# metadata is bounded by it too (annotations 256 KiB). Statuses are the operator's, kept
# small by its ledger byte budget (reservoir.core.ledgersize) below etcd's 1.5 MiB: their
# schema bound is far larger (an envelope's, 512 entries at every bound, about 27 MB; a
# claim's about 175 KB).
SCHEDULING_WORST_CASE_BYTES = 170_000
SPEC_WORST_CASE_BYTES = 240_000
