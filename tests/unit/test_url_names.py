"""Names a tenant writes never steer a request of the operator or the SDK (issue 21 §2).

Found by review: lightkube joins a name into the URL as it is, and a LIST refused with
403/429 fell back to a GET, so a claim whose spec.envelope was `../../tenant-b/...` read
an envelope of another namespace. The requests below are the real ones lightkube builds
(httpx's mock transport answers them): every one stays in the tenant's namespace and
kind, names are escaped, field-selector values too."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import unquote

import httpx2 as httpx
import pytest
from lightkube import AsyncClient, KubeConfig

from reservoir.k8s.resources import ReservationEnvelope, get_object, path_segment
from reservoir.sdk.client import AsyncReservoir

NAMESPACE = "tenant-a"
ENVELOPES = (
    f"http://api.test/apis/reservoir.dev/v1alpha1/namespaces/{NAMESPACE}/reservationenvelopes"
)
HOSTILE = [
    "../../tenant-b/reservationenvelopes/wf",
    "..",
    ".",
    "wf/../../../tenant-b/reservationenvelopes/wf",
    "..%2F..%2Ftenant-b",
    "wf?fieldSelector=x",
    "wf#x",
]


def refusing(code: int, seen: list[httpx.URL]) -> httpx.MockTransport:
    """An API server that refuses every LIST with `code` and answers every GET 404."""

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url)
        status = code if "fieldSelector" in request.url.params else 404
        body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": status}
        return httpx.Response(status, json={**body, "message": "refused"})

    return httpx.MockTransport(answer)


def client(transport: httpx.MockTransport) -> AsyncClient:
    config = KubeConfig.from_dict(
        {
            "clusters": [{"name": "c", "cluster": {"server": "http://api.test"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "x",
        }
    )
    made = AsyncClient(config=config, namespace=NAMESPACE)
    made._client._client._transport = transport  # type: ignore[attr-defined]
    return made


def run(call: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(call())


@pytest.mark.parametrize("code", [403, 429])
@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_name_never_leaves_the_namespace_on_the_get_fallback(
    code: int, name: str
) -> None:
    seen: list[httpx.URL] = []
    api = client(refusing(code, seen))
    assert run(lambda: get_object(api, ReservationEnvelope, name, NAMESPACE)) is None
    for url in seen:
        path = str(url).split("?")[0]
        assert path.startswith(ENVELOPES), url
        rest = path[len(ENVELOPES) :]
        assert rest == "" or (rest.startswith("/") and "/" not in rest[1:]), url
        assert rest in ("", f"/{path_segment(name)}"), url
        assert unquote(rest[1:]) in ("", name), url


def test_a_possible_name_is_escaped_whole_and_read_as_itself() -> None:
    seen: list[httpx.URL] = []
    api = client(refusing(403, seen))
    run(lambda: get_object(api, ReservationEnvelope, "wf%2F..", NAMESPACE))
    assert [str(url).split("?")[0] for url in seen] == [ENVELOPES, f"{ENVELOPES}/wf%252F.."]


def test_path_segment_refuses_what_no_object_can_be_called() -> None:
    for name in ("", ".", "..", "a/b"):
        with pytest.raises(ValueError, match="not an object name"):
            path_segment(name)
    assert path_segment("wf-1.a") == "wf-1.a"
    assert path_segment("a b?#%") == "a%20b%3F%23%25"


def test_the_sdk_refuses_a_hostile_envelope_name_and_escapes_field_selectors() -> None:
    seen: list[httpx.URL] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url)
        if "fieldSelector" in request.url.params:
            return httpx.Response(200, json={"kind": "List", "apiVersion": "v1", "items": []})
        return httpx.Response(404, json={"kind": "Status", "apiVersion": "v1", "code": 404})

    sdk = AsyncReservoir(client=client(httpx.MockTransport(answer)))
    with pytest.raises(ValueError, match="not an object name"):
        run(lambda: sdk.ledger("../../tenant-b/reservationenvelopes/wf"))
    assert seen == []
    run(lambda: sdk.claims("a,metadata.name=b"))
    selectors = [url.params["fieldSelector"] for url in seen if "fieldSelector" in url.params]
    assert "spec.envelope=a\\,metadata.name\\=b" in selectors, selectors
