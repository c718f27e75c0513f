"""The server-side label selectors of the watched kinds the operator does not own
(issue 21): other tenants' pods, Jobs, Leases and ResourceClaims are not sent to it. A
selector must never hide an object a handler asks for: every handler and index of such
a kind requires (at least) the selector's labels."""

from __future__ import annotations

import re
from typing import Any

import kopf
from hypothesis import example, given
from hypothesis import strategies as st
from kopf._core.intents import registries

import reservoir.handlers  # noqa: F401  (registers the handlers)
from reservoir.handlers.startup import WATCH_LABEL_SELECTORS
from reservoir.k8s.devices import PLACEHOLDER_LABEL, placeholder_spec
from reservoir.k8s.resources import (
    CLAIM_LABEL,
    CLAIM_NAME_ANNOTATION,
    ENVELOPE_LABEL,
    ENVELOPE_NAME_ANNOTATION,
    claim_of_label,
    envelope_label,
    labelled_envelope,
    labelled_for,
)
from reservoir.sdk import ClaimView, workload_pod


def handlers_of(group: str, version: str, plural: str) -> list[Any]:
    registry = registries.get_default_registry()
    found = []
    for part in (registry._indexing, registry._watching, registry._spawning, registry._changing):
        for handler in part.get_all_handlers():
            selector = handler.selector
            if (
                selector is not None
                and (selector.group, selector.version) == (group, version)
                and plural in (selector.plural, selector.any_name)
            ):
                found.append(handler)
    return found


def test_every_watched_foreign_kind_has_a_selector_its_handlers_all_require() -> None:
    assert set(WATCH_LABEL_SELECTORS) == {
        ("", "v1", "pods"),
        ("batch", "v1", "jobs"),
        ("coordination.k8s.io", "v1", "leases"),
        ("resource.k8s.io", "v1", "resourceclaims"),
    }
    for (group, version, plural), selector in WATCH_LABEL_SELECTORS.items():
        handlers = handlers_of(group, version, plural)
        assert handlers, plural
        for handler in handlers:
            labels = handler.labels or {}
            for key in selector.split(","):
                assert key in labels, (plural, handler.id, key)
                assert labels[key] is not kopf.ABSENT, (plural, handler.id, key)


def test_a_placeholder_pod_carries_the_label_the_pods_watch_selects() -> None:
    claim = {
        "metadata": {"name": "c1", "namespace": "t", "uid": "u-1"},
        "spec": {"envelope": "wf", "requests": {"nvidia.com/gpu": "1"}},
    }
    pod = placeholder_spec(claim, None)
    assert pod["metadata"]["labels"][CLAIM_LABEL] == "u-1"  # the UID: a name may not fit
    assert WATCH_LABEL_SELECTORS["", "v1", "pods"] == CLAIM_LABEL


def test_labels_hold_a_claims_uid_and_annotations_its_name_whatever_its_length() -> None:
    """Issue 25: a claim's name may be 253 characters, a label value at most 63. The
    placeholder and the SDK's workload pod carry the claim's UID as the label, its name in
    an annotation; either label value names the claim for the operator."""
    name = "n" * 200
    claim: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "t", "uid": "u-1", "resourceVersion": "1"},
        "spec": {"envelope": "wf", "requests": {"nvidia.com/gpu": "1"}},
    }
    placeholder = placeholder_spec(claim, None)["metadata"]
    assert placeholder["labels"][CLAIM_LABEL] == placeholder["labels"][PLACEHOLDER_LABEL] == "u-1"
    assert placeholder["annotations"][CLAIM_NAME_ANNOTATION] == name
    view = ClaimView.from_api({**claim, "spec": {**claim["spec"], "branch": "b"}})
    pod = workload_pod(view, {"metadata": {"name": "w"}, "spec": {"containers": []}})
    assert pod["metadata"]["labels"][CLAIM_LABEL] == "u-1"
    assert pod["metadata"]["annotations"][CLAIM_NAME_ANNOTATION] == name
    for value in ("u-1", name):
        assert labelled_for(value, "u-1", name)
    for value in ("", None, "u-2", name[:63]):
        assert not labelled_for(value, "u-1", name)


UID_A = "0b6f4a62-1c2d-4e5f-8a9b-0c1d2e3f4a5b"
UID_B = "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d"


def test_a_claim_named_like_another_claims_uid_never_takes_its_pods() -> None:
    """Found by review: claim B named A's UID (a UID is a valid name) matched A's pods,
    labelled with A's UID, by name: cancelling B deleted A's pod, and B's envelope handed
    A's pod B's capacity. A value shaped like a UID names a claim by UID only."""
    assert labelled_for(UID_A, UID_A, "a")
    assert not labelled_for(UID_A, UID_B, UID_A)  # B, named A's UID
    assert labelled_for("job-b", UID_B, "job-b")  # a plain name still works
    # An envelope holding only B (named A's UID) finds no claim for A's pod ...
    assert claim_of_label(UID_A, {UID_B}, {UID_A: UID_B}) is None
    # ... and one holding A finds A, whatever another claim is named.
    assert claim_of_label(UID_A, {UID_A, UID_B}, {"a": UID_A, UID_A: UID_B}) == UID_A
    assert claim_of_label("a", {UID_A}, {"a": UID_A}) == UID_A


def test_a_placeholder_pod_opts_out_of_mesh_sidecars() -> None:
    """An injected sidecar would make the chart's placeholder policy refuse the pod (found
    by review: no GPU claim could be held in a mesh-injected namespace)."""
    claim = {
        "metadata": {"name": "c1", "namespace": "t", "uid": "u-1"},
        "spec": {"envelope": "wf", "requests": {"nvidia.com/gpu": "1"}},
    }
    annotations = placeholder_spec(claim, None)["metadata"]["annotations"]
    assert annotations["sidecar.istio.io/inject"] == "false"
    assert annotations["linkerd.io/inject"] == "disabled"


LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
OBJECT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
names = st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", fullmatch=True).filter(
    lambda n: OBJECT_NAME.match(n) is not None
)


@example(name="a" * 200, other="a" * 199)
@example(name="a" * 64, other="a" * 63)
@given(name=names, other=names)
def test_an_envelope_label_fits_and_never_names_another_envelope(name: str, other: str) -> None:
    """Issue 25: an envelope's label value is its name when it fits (as before), else a
    digest that is a valid label value and no object name can be; the annotation carries
    the name back, and only for the label it belongs to."""
    label = envelope_label(name)
    assert LABEL_VALUE.match(label) and len(label) <= 63
    assert (label == name) == (len(name) <= 63)
    assert OBJECT_NAME.match(label) is None or label == name  # a digest is no name
    if other != name:
        assert envelope_label(other) != label
    annotated = {ENVELOPE_NAME_ANNOTATION: name}
    assert labelled_envelope({ENVELOPE_LABEL: label}, annotated) == name
    assert labelled_envelope({ENVELOPE_LABEL: label}, None) == label
    assert labelled_envelope(None, annotated) is None
    # An annotation naming another envelope than the label's is not believed.
    if other != name:
        forged = labelled_envelope({ENVELOPE_LABEL: label}, {ENVELOPE_NAME_ANNOTATION: other})
        assert forged == label
