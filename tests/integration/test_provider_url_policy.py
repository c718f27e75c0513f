"""The administrator's allow-list of HTTP provider URLs on the real control plane (issue
21 §2, SSRF): the chart's ValidatingAdmissionPolicy refuses, at `kubectl apply`, an
envelope whose provider URL is loopback, link-local/metadata or off the list, and admits an
allow-listed one; and an operator whose own allow-list names loopback (as a careless
administrator's might) still never sends a request to a loopback listener an envelope
names: the claim records only "refused by policy"."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle
from tests.integration.chart import CHART, KUBE_VERSION, helm, set_args
from tests.integration.conftest import StartOperator
from tests.integration.helpers import create_envelope, eventually
from tests.integration.provider_server import answer, host_address, provider_server

POLICY_TEMPLATE = "templates/provider-url-policy.yaml"


def envelope(ns: str, name: str, status_url: str, cancel_url: str | None = None) -> str:
    provider: dict[str, Any] = {"statusURL": status_url}
    if cancel_url is not None:
        provider["cancelURL"] = cancel_url
    return json.dumps(
        {
            "apiVersion": "reservoir.dev/v1alpha1",
            "kind": "ReservationEnvelope",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"capacity": {"tokens": "20"}, "policy": {"provider": provider}},
        }
    )


def apply_error(cluster: ClusterHandle, body: str, *flags: str) -> str | None:
    """None if the API server admitted the object, else kubectl's error."""
    try:
        cluster.kubectl("apply", *flags, "-f", "-", input=body)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.fixture
def url_policy(cluster: ClusterHandle, crds: None) -> Iterator[Any]:
    """Installs the chart's provider URL policy rendered with the given allow-list
    (calling the fixture again replaces it); removed after the test."""
    name = f"p{uuid.uuid4().hex[:6]}"
    installed: list[str] = []

    def install(allowed: list[str]) -> None:
        out = helm(
            None,
            "template",
            name,
            str(CHART),
            "--kube-version",
            KUBE_VERSION,
            "--show-only",
            POLICY_TEMPLATE,
            *set_args({"providers.allowedHosts": allowed}),
        )
        cluster.kubectl("apply", "-f", "-", input=out)
        installed.append(out)

    yield install
    for out in installed[-1:]:
        cluster.kubectl("delete", "--ignore-not-found", "-f", "-", input=out)
        wait_unenforced(cluster)


def wait_unenforced(cluster: ClusterHandle) -> None:
    """Until no provider URL policy refuses a loopback URL: the API server stops enforcing
    a deleted policy a moment after the deletion (a later test may count on none: found
    when the next test's loopback envelope was refused by the policy just deleted)."""
    probe = envelope("default", "probe", "http://127.0.0.1:9/{operationId}")
    eventually(
        "no provider URL policy enforced",
        lambda: apply_error(cluster, probe, "--dry-run=server") is None,
        timeout=60,
    )


def wait_enforced(cluster: ClusterHandle, ns: str, url: str, expected: str) -> None:
    """A new policy takes a moment to be enforced: until an envelope naming `url` is
    refused with `expected` (a new name each try: one admitted meanwhile would make the
    next try an update that changes nothing)."""
    eventually(
        "the policy enforced",
        lambda: (
            expected
            in (apply_error(cluster, envelope(ns, f"probe-{uuid.uuid4().hex[:6]}", url)) or "")
        ),
        timeout=30,
    )


def test_admission_refuses_loopback_and_metadata_urls_and_admits_allowed_ones(
    cluster: ClusterHandle, ns: str, url_policy: Any
) -> None:
    allowed_host = host_address()
    url_policy([allowed_host, "*.allowed.example"])
    wait_enforced(cluster, ns, "http://127.0.0.1:9/{operationId}", "is a loopback")

    never = "is a loopback, link-local or metadata address: the operator never calls it"
    for n, url in enumerate(
        [
            "http://127.0.0.1:8080/operations/{operationId}",
            "http://169.254.169.254/latest/meta-data/{operationId}",
            "http://[::1]:8080/{operationId}",
            "http://localhost:8080/{operationId}",
            "http://[fe80::1]/{operationId}",
        ]
    ):
        error = apply_error(cluster, envelope(ns, f"bad-{n}", url))
        assert error is not None and never in error, (url, error)
        assert "ValidatingAdmissionPolicy" in error, error
    # A loopback cancelURL behind an allowed statusURL is refused too.
    ok = f"http://{allowed_host}:8080/operations/{{operationId}}"
    error = apply_error(cluster, envelope(ns, "bad-cancel", ok, "http://127.0.0.1:1/{operationId}"))
    assert error is not None and "127.0.0.1 is a loopback" in error, error

    off = "is not on the administrator's allow-list of provider hosts"
    for n, url in enumerate(
        [
            "http://evil.example/{operationId}",
            "http://allowed.example/{operationId}",  # "*." is for names under it
            "http://10.96.0.1/api/{operationId}",  # the API server's Service
        ]
    ):
        error = apply_error(cluster, envelope(ns, f"off-{n}", url))
        assert error is not None and off in error, (url, error)
    error = apply_error(cluster, envelope(ns, "templated", "http://{operationId}.allowed.example/"))
    assert error is not None and "may not hold {operationId}" in error, error

    # Allowed: the listed address, and a name under the listed domain.
    named = "https://api.allowed.example/{operationId}"
    assert apply_error(cluster, envelope(ns, "good-1", ok, ok + "/cancel")) is None
    assert apply_error(cluster, envelope(ns, "good-2", named)) is None
    # Nothing else about an admitted envelope is checked again: closing it is allowed after
    # the list changes.
    url_policy(["only.other.example"])
    wait_enforced(cluster, ns, named, off)
    closed = json.dumps({"spec": {"state": "Closed"}})
    cluster.kubectl("patch", "renv", "good-2", "-n", ns, "--type=merge", "-p", closed)
    error = apply_error(cluster, envelope(ns, "good-3", named))
    assert error is not None and off in error, error

    # An empty list (the chart's default): no HTTP provider at all.
    url_policy([])
    wait_enforced(cluster, ns, named, "HTTP providers are not allowed on this cluster")


def test_an_operator_never_calls_a_loopback_listener_even_when_allow_listed(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    """No admission policy here (as with admissionPolicy.enabled false), and an operator
    allowed 127.0.0.0/8 and localhost: the operator itself refuses loopback. Another
    envelope's allowed provider is called and settles its claim."""
    wait_unenforced(cluster)  # a policy an earlier test (or chart) installed has gone
    with (
        provider_server(host="127.0.0.1") as loopback,
        provider_server() as allowed,
    ):
        start_operator(
            "--provider-allow",
            "127.0.0.0/8,localhost",
            "--provider-allow",
            host_address(),
        )
        loopback.script("op-1", answer("op-1", "Succeeded", usage={"tokens": "1"}))
        allowed.script("op-2", answer("op-2", "Succeeded", usage={"tokens": "3"}))
        loopback_port = loopback.url.rsplit(":", 1)[1]
        by_name = f"http://localhost:{loopback_port}/operations/{{operationId}}"
        for name, status, cancel, lease in (
            ("hostile", loopback.status_url, loopback.cancel_url, 120),
            ("named", by_name, f"{by_name}/cancel", 120),
            ("fine", allowed.status_url, None, 2),
        ):
            provider = {"statusURL": status, **({"cancelURL": cancel} if cancel else {})}
            create_envelope(
                cluster,
                ns,
                name,
                {"tokens": "20"},
                defaultLeaseSeconds=lease,
                atAmbiguityDeadline="Hold",
                provider=provider,
                providerLookupMaxSeconds=2,
            )
        up = {"operationId": "op-1", "supportsStatus": True, "supportsCancel": True}
        for envelope_name, claim in (("hostile", "a"), ("named", "n")):
            sdk.hold(envelope_name, "b", {"tokens": "5"}, name=claim, dispatch=True, upstream=up)
        fine = {"operationId": "op-2", "supportsStatus": True}
        sdk.hold("fine", "b", {"tokens": "5"}, name="b", dispatch=True, upstream=fine)
        # A cancel after dispatch: the operator forwards it (a POST) and looks the
        # operation up (GETs), both to loopback, both refused.
        for claim in ("a", "n"):
            eventually(f"{claim} committed", lambda c=claim: sdk.get(c).phase.value == "Committed")
            sdk.cancel(sdk.get(claim))

        def refused(claim: str) -> bool:
            record = sdk.get(claim).status.provider
            return (
                record is not None
                and record.failures >= 2
                and record.last_error == "refused by policy"
                and record.cancel == "not forwarded: refused by policy"
            )

        for claim in ("a", "n"):
            eventually(f"{claim}'s calls refused", lambda c=claim: refused(c), timeout=60)
        eventually(
            "b settled by its allowed provider",
            lambda: sdk.get("b").status.settlement is not None,
            timeout=60,
        )
        time.sleep(3)  # a few more passes
        assert loopback.requests == [], loopback.requests
        assert allowed.lookups("op-2") >= 1
