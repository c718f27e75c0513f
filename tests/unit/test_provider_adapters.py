"""Provider adapters: a Job, a Pod, an object with conditions or an HTTP answer read into a
ProviderAnswer (pure), and ProviderClient's I/O against a fake API and the test provider
server (never raising, errors bounded)."""

from __future__ import annotations

import base64
import json
from decimal import Decimal
from typing import Any

import pytest
from lightkube import ApiError
from lightkube.models.meta_v1 import Status
from lightkube.resources.core_v1 import Secret
from pydantic import ValidationError

from reservoir.core.model import (
    MAX_ERROR_LENGTH,
    MAX_RESULT_LENGTH,
    BranchClaimSpec,
    EnvelopePolicy,
    ObjectRef,
    ProviderState,
    UpstreamCancel,
)
from reservoir.k8s.provider_http import ProviderHttp, ProviderSettings
from reservoir.k8s.provider_policy import AllowList
from reservoir.k8s.providers import (
    RESULT_ANNOTATION,
    USAGE_ANNOTATION,
    ProviderClient,
    conditions_answer,
    http_answer,
    job_answer,
    object_answer,
    operation_url,
    plural_of,
    pod_answer,
    resource_for,
)
from tests.integration.provider_server import Answer, answer, host_address, provider_server

S = ProviderState


def obj(
    kind: str = "Job",
    name: str = "train-7",
    status: dict[str, Any] | None = None,
    spec: dict[str, Any] | None = None,
    annotations: dict[str, str] | None = None,
    **meta: Any,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": "ns", **meta}
    if annotations is not None:
        metadata["annotations"] = annotations
    return {"kind": kind, "metadata": metadata, "spec": spec or {}, "status": status or {}}


def cond(kind: str, status: str = "True") -> dict[str, str]:
    return {"type": kind, "status": status}


# --- Jobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "spec", "state"),
    [
        ({"conditions": [cond("Complete")]}, {}, S.SUCCEEDED),
        ({"conditions": [cond("SuccessCriteriaMet")], "active": 1}, {}, S.SUCCEEDED),
        ({"conditions": [cond("Failed")]}, {}, S.FAILED),
        ({"conditions": [cond("FailureTarget")], "active": 1}, {}, S.FAILED),
        ({"conditions": [cond("Complete", "False")], "active": 2}, {}, S.RUNNING),
        ({"startTime": "2026-01-01T00:00:00Z"}, {}, S.RUNNING),
        ({"active": 1}, {}, S.RUNNING),
        ({"terminating": 1, "conditions": [cond("Suspended")]}, {"suspend": True}, S.RUNNING),
        ({}, {"suspend": True}, S.PENDING),
        ({"conditions": [cond("Suspended")]}, {"suspend": True}, S.PENDING),
        ({}, {}, S.PENDING),
        ({"conditions": [cond("Failed", "False")]}, {}, S.PENDING),
    ],
)
def test_a_job_by_its_conditions_and_counts(
    status: dict[str, Any], spec: dict[str, Any], state: ProviderState
) -> None:
    assert job_answer(obj(status=status, spec=spec)).state is state


def test_only_a_terminal_job_carries_usage_and_a_default_result() -> None:
    usage = {USAGE_ANNOTATION: json.dumps({"tokens": "12k", "cost": "0.5", "nvidia.com/gpu": 2})}
    done = job_answer(obj(status={"conditions": [cond("Complete")]}, annotations=usage))
    assert done.state is S.SUCCEEDED and done.error is None
    assert done.usage == {"tokens": Decimal(12000), "cost": Decimal("0.5"), "nvidia.com/gpu": 2}
    assert done.result == "Job/train-7"
    assert done.outcome is not None
    running = job_answer(obj(status={"active": 1}, annotations=usage))
    assert running.state is S.RUNNING and running.usage is None and running.result is None
    # A running Job's annotation is not read (a half-written one is no error yet).
    half = job_answer(obj(status={"active": 1}, annotations={USAGE_ANNOTATION: "{"}))
    assert half.error is None and half.state is S.RUNNING


def test_the_result_annotation_is_the_result_cut_to_its_bound() -> None:
    failed = job_answer(
        obj(status={"conditions": [cond("Failed")]}, annotations={RESULT_ANNOTATION: "s3://b/k"})
    )
    assert failed.state is S.FAILED and failed.result == "s3://b/k"
    assert failed.usage is None, "no annotation: the Job did not say what it used"
    assert not failed.settles
    long = job_answer(
        obj(status={"conditions": [cond("Complete")]}, annotations={RESULT_ANNOTATION: "x" * 2000})
    )
    assert long.result == "x" * MAX_RESULT_LENGTH
    empty = job_answer(
        obj(status={"conditions": [cond("Complete")]}, annotations={RESULT_ANNOTATION: ""})
    )
    assert empty.result == "Job/train-7"


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        '["tokens"]',
        '{"tokens": "-1"}',
        '{"tokens": "12 k"}',
        '{"tokens": 1.5}',
        '{"tokens": true}',
        '{"tokens": "1e19"}',
        '{"Bad Name": "1"}',
        json.dumps({f"r{i}": "1" for i in range(17)}),
    ],
)
def test_an_unreadable_usage_annotation_is_an_error_answer_never_an_exception(text: str) -> None:
    got = job_answer(
        obj(status={"conditions": [cond("Complete")]}, annotations={USAGE_ANNOTATION: text})
    )
    assert got.state is S.UNKNOWN and got.outcome is None
    assert got.error is not None and USAGE_ANNOTATION in got.error
    assert len(got.error) <= MAX_ERROR_LENGTH
    assert got.usage is None and got.result is None


def test_a_completion_says_what_was_used_only_with_the_annotation() -> None:
    """Without the usage annotation a completed Job says nothing of usage (not proof of
    zero usage: the claim does not settle on it); an empty map says nothing was used."""
    complete = {"conditions": [cond("Complete")]}
    silent = job_answer(obj(status=complete))
    assert silent.state is S.SUCCEEDED and silent.usage is None and not silent.settles
    nothing = job_answer(obj(status=complete, annotations={USAGE_ANNOTATION: "{}"}))
    assert nothing.usage == {} and nothing.settles
    assert job_answer(obj(status={"active": 1})).usage is None
    http_silent = http_answer(200, body(state="Succeeded"), "op/1")
    assert http_silent.usage is None and not http_silent.settles
    assert http_answer(200, body(state="Succeeded", usage=None), "op/1").usage is None
    http_nothing = http_answer(200, body(state="Cancelled", usage={}), "op/1")
    assert http_nothing.usage == {} and http_nothing.settles
    never = http_answer(200, body(state="NeverStarted"), "op/1")
    assert never.usage is None and never.settles, "never started: nothing was used"


def test_a_malformed_object_reads_as_an_answer() -> None:
    assert job_answer({"status": {"conditions": "Complete"}}).state is S.PENDING
    assert job_answer({"status": {"active": "3"}}).state is S.PENDING
    assert job_answer({"status": None, "metadata": None}).state is S.PENDING
    assert pod_answer({}).state is S.PENDING
    assert conditions_answer({"status": {"conditions": [None, 3]}}).state is S.UNKNOWN


# --- Pods ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "extra_meta", "node", "state"),
    [
        ("Succeeded", {}, "n1", S.SUCCEEDED),
        ("Failed", {}, "n1", S.FAILED),
        ("Running", {}, "n1", S.RUNNING),
        ("Pending", {}, None, S.PENDING),
        ("Pending", {}, "n1", S.PENDING),  # bound, not started
        ("Pending", {"deletionTimestamp": "2026-01-01T00:00:00Z"}, "n1", S.RUNNING),
        ("Running", {"deletionTimestamp": "2026-01-01T00:00:00Z"}, "n1", S.RUNNING),
        ("Succeeded", {"deletionTimestamp": "2026-01-01T00:00:00Z"}, "n1", S.SUCCEEDED),
        ("Unknown", {}, "n1", S.UNKNOWN),
    ],
)
def test_a_pod_by_its_phase(
    phase: str, extra_meta: dict[str, Any], node: str | None, state: ProviderState
) -> None:
    pod = obj("Pod", "w-1", status={"phase": phase}, spec={"nodeName": node}, **extra_meta)
    got = pod_answer(pod)
    assert got.state is state and got.error is None
    assert got.result == ("Pod/w-1" if state.terminal else None)


# --- objects with conditions ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("conditions", "state"),
    [
        ([cond("Complete")], S.SUCCEEDED),
        ([cond("Ready"), cond("Succeeded")], S.SUCCEEDED),
        ([cond("Failed")], S.FAILED),
        ([cond("Running")], S.RUNNING),
        ([cond("Ready")], S.RUNNING),
        ([cond("Ready", "False"), cond("Failed", "False")], S.UNKNOWN),
        ([], S.UNKNOWN),
        (None, S.UNKNOWN),
    ],
)
def test_an_object_by_its_conditions(
    conditions: list[dict[str, str]] | None, state: ProviderState
) -> None:
    status = {} if conditions is None else {"conditions": conditions}
    got = conditions_answer(obj("Training", "t1", status=status))
    assert got.state is state and got.error is None
    assert got.result == ("Training/t1" if state.terminal else None)


def test_object_answer_dispatches_by_kind_and_says_what_is_missing() -> None:
    complete = {"conditions": [cond("Complete")]}
    job = ObjectRef(name="train-7")
    assert object_answer(job, obj(status={"active": 1})).state is S.RUNNING
    # A Job's Complete counts; the same object as a Pod has no phase: Pending.
    pod = ObjectRef(api_version="v1", kind="Pod", name="train-7")
    assert object_answer(pod, obj("Pod", status=complete)).state is S.PENDING
    other = ObjectRef(api_version="example.com/v1", kind="Training", name="t1")
    got = object_answer(other, obj("", "t1", status=complete))
    assert got.state is S.SUCCEEDED and got.result == "Training/t1"
    gone = object_answer(job, None)
    assert gone.state is S.UNKNOWN and gone.error == "Job train-7 not found"
    assert object_answer(pod, None).error == "Pod train-7 not found"


# --- the HTTP contract ---------------------------------------------------------------------


def body(**doc: Any) -> bytes:
    return json.dumps({"operationId": "op/1", **doc}).encode()


def test_http_answers_in_the_contract() -> None:
    done = http_answer(
        200, body(state="Succeeded", usage={"tokens": "2k"}, result="s3://x"), "op/1"
    )
    assert done.state is S.SUCCEEDED and done.error is None
    assert done.usage == {"tokens": Decimal(2000)} and done.result == "s3://x"
    for state in S:
        got = http_answer(200, body(state=state.value), "op/1")
        assert got.state is state and got.error is None and got.usage is None
        assert got.result is None  # no default result for HTTP
    running = http_answer(200, body(state="Running", usage={"tokens": "nope"}), "op/1")
    assert running.state is S.RUNNING and running.error is None and running.usage is None
    long = http_answer(200, body(state="Failed", result="r" * 999), "op/1")
    assert long.result == "r" * MAX_RESULT_LENGTH


@pytest.mark.parametrize(
    ("code", "raw", "error"),
    [
        (404, b"", "operation not found"),
        (500, body(state="Succeeded"), "HTTP 500"),
        (204, b"", "HTTP 204"),
        (401, b"", "HTTP 401"),
        (200, b"<html>", "answer is not JSON"),
        (200, b"\xff\xfe", "answer is not JSON"),
        (200, b"[1]", "answer is not a JSON object"),
        (200, json.dumps({"state": "Succeeded"}).encode(), "answer has no operationId"),
        (200, body(state="Succeeded").replace(b"op/1", b"op/2"), "answer names another operation"),
        (200, body(state="Done"), "answer has an unknown state 'Done'"),
        (200, body(state=None), "answer has an unknown state 'None'"),
        (200, body(state="Succeeded", usage={"tokens": "-3"}), "answer's usage is unreadable"),
        (200, body(state="Succeeded", usage=["tokens"]), "answer's usage is unreadable"),
        (200, body(state="Succeeded", result=7), "answer's result is not a string"),
    ],
)
def test_http_errors_are_unknown_answers(code: int, raw: bytes, error: str) -> None:
    got = http_answer(code, raw, "op/1")
    assert got.state is S.UNKNOWN and got.outcome is None
    assert got.error is not None and got.error.startswith(error), got.error
    assert got.usage is None and got.result is None


def test_errors_are_cut_to_their_bound() -> None:
    got = http_answer(200, body(state="Succeeded", usage={"t" * 60: "1" * 40}), "op/1")
    assert got.error is not None and got.state is S.UNKNOWN
    got = http_answer(200, body(state="x" * 500), "op/1")
    assert got.error is not None and len(got.error) <= MAX_ERROR_LENGTH


def test_operation_ids_are_escaped_into_the_url() -> None:
    url = operation_url("https://p.example/ops/{operationId}/status", "a/b c?d")
    assert url == "https://p.example/ops/a%2Fb%20c%3Fd/status"


def test_plurals_and_resources() -> None:
    assert plural_of("Job") == "jobs" and plural_of("Training") == "trainings"
    assert plural_of("Ingress") == "ingresses" and plural_of("Policy") == "policies"
    assert resource_for(ObjectRef(name="x")).__name__ == "Job"
    assert resource_for(ObjectRef(api_version="v1", kind="Pod", name="x")).__name__ == "Pod"
    generic = resource_for(ObjectRef(api_version="example.com/v1", kind="Training", name="x"))
    assert generic._api_info.plural == "trainings"
    assert generic._api_info.resource.group == "example.com"
    with pytest.raises(ValidationError):  # the schema refuses it first
        ObjectRef(api_version="a/b/v1", kind="Training", name="x")
    forged = ObjectRef.model_construct(api_version="a/b/v1", kind="Training", name="x")
    with pytest.raises(ValueError, match="apiVersion"):
        resource_for(forged)  # and the adapter, had it been let through
    with pytest.raises(ValueError, match="apiVersion"):
        resource_for(ObjectRef.model_construct(api_version=None, kind="Training", name="x"))


# --- ProviderClient: I/O, never raising ----------------------------------------------------


def api_error(code: int) -> ApiError:
    return ApiError(status=Status(code=code, reason="Reason", message="fake"))


class FakeKube:
    """Objects by (kind, name); errors by (kind, name); every call recorded."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], Any] = {}
        self.errors: dict[tuple[str, str], Exception] = {}
        self.calls: list[tuple[Any, ...]] = []

    def _find(self, res: Any, name: str) -> Any:
        key = (res._api_info.resource.kind, name)
        if key in self.errors:
            raise self.errors[key]
        if key not in self.objects:
            raise api_error(404)
        return self.objects[key]

    async def get(self, res: Any, name: str, *, namespace: str | None = None) -> Any:
        self.calls.append(("get", res._api_info.resource.kind, name, namespace))
        return self._find(res, name)

    async def patch(self, res: Any, name: str, patch: Any, **kwargs: Any) -> Any:
        self.calls.append(("patch", res._api_info.resource.kind, name, patch, kwargs))
        return self._find(res, name)

    async def delete(self, res: Any, name: str, **kwargs: Any) -> None:
        self.calls.append(("delete", res._api_info.resource.kind, name, kwargs))
        self._find(res, name)


def job_claim(**ref: Any) -> BranchClaimSpec:
    return BranchClaimSpec.model_validate(
        {
            "envelope": "wf",
            "branch": "b",
            "requests": {"tokens": "1"},
            "upstream": {"supportsCancel": True, "ref": {"name": "train-7", **ref}},
        }
    )


def http_claim(operation: str = "op/1") -> BranchClaimSpec:
    return BranchClaimSpec.model_validate(
        {
            "envelope": "wf",
            "branch": "b",
            "requests": {"tokens": "1"},
            "upstream": {"operationId": operation, "supportsStatus": True, "supportsCancel": True},
        }
    )


def http_policy(status_url: str, cancel_url: str | None = None, secret: bool = False) -> Any:
    provider: dict[str, Any] = {"statusURL": status_url}
    if cancel_url:
        provider["cancelURL"] = cancel_url
    if secret:
        provider["tokenSecret"] = {"name": "provider-token", "key": "token"}
    return EnvelopePolicy.model_validate({"provider": provider})


NO_PROVIDER = EnvelopePolicy()


def client_for(kube: Any, **settings: Any) -> ProviderClient:
    """A ProviderClient allowed to call the test provider server (on this machine's own
    address: loopback is never called)."""
    allowed = ProviderSettings(allow=AllowList.parse([host_address()]), **settings)
    return ProviderClient(kube, ProviderHttp(allowed))


async def test_looking_up_objects() -> None:
    kube = FakeKube()
    client = client_for(kube)
    kube.objects[("Job", "train-7")] = obj(status={"conditions": [cond("Complete")]})
    got = await client.look_up("ns", job_claim(), NO_PROVIDER)
    assert got.state is S.SUCCEEDED and got.result == "Job/train-7"
    assert kube.calls == [("get", "Job", "train-7", "ns")]
    gone = await client.look_up("ns", job_claim(name="other"), NO_PROVIDER)
    assert gone.state is S.UNKNOWN and gone.error == "Job other not found"
    kube.errors[("Job", "train-7")] = api_error(403)
    refused = await client.look_up("ns", job_claim(), NO_PROVIDER)
    assert refused.state is S.UNKNOWN and refused.error == "reading Job train-7: HTTP 403 Reason"
    kube.errors[("Job", "train-7")] = RuntimeError("boom")
    broken = await client.look_up("ns", job_claim(), NO_PROVIDER)
    assert broken.error == "lookup failed: RuntimeError: boom"
    kube.objects[("Training", "t1")] = obj("Training", "t1", status={"conditions": [cond("Ready")]})
    training = job_claim(apiVersion="example.com/v1", kind="Training", name="t1")
    assert (await client.look_up("ns", training, NO_PROVIDER)).state is S.RUNNING
    await client.aclose()


async def test_nothing_to_look_up_is_an_answer() -> None:
    client = client_for(FakeKube())
    got = await client.look_up("ns", http_claim(), NO_PROVIDER)
    assert got.state is S.UNKNOWN and got.error is not None
    await client.aclose()


def secret(token: str = "s3cret\n") -> Secret:
    return Secret(data={"token": base64.b64encode(token.encode()).decode()})


async def test_looking_up_over_http_with_a_token() -> None:
    kube = FakeKube()
    kube.objects[("Secret", "provider-token")] = secret()
    client = client_for(kube)
    with provider_server(token="s3cret") as provider:
        provider.script(
            "op/1",
            (500, None),
            answer("op/1", "Running"),
            answer("op/1", "Succeeded", usage={"tokens": "12"}, result="s3://r"),
        )
        policy = http_policy(provider.status_url, secret=True)
        got = [await client.look_up("ns", http_claim(), policy) for _ in range(4)]
        assert [a.state for a in got] == [S.UNKNOWN, S.RUNNING, S.SUCCEEDED, S.SUCCEEDED]
        assert got[0].error == "HTTP 500"
        assert got[2].usage == {"tokens": Decimal(12)} and got[2].result == "s3://r"
        assert provider.lookups("op/1") == 4
        assert {r.path for r in provider.requests} == {"/operations/op%2F1"}
        assert {r.authorization for r in provider.requests} == {"Bearer s3cret"}
        # Not found upstream.
        missing = await client.look_up("ns", http_claim("op-2"), policy)
        assert missing.state is S.UNKNOWN and missing.error == "operation not found"
        # The wrong token: the provider refuses it.
        kube.objects[("Secret", "provider-token")] = secret("wrong")
        assert (await client.look_up("ns", http_claim(), policy)).error == "HTTP 401"
        # No token at all: no header.
        provider.token = None
        await client.look_up("ns", http_claim(), http_policy(provider.status_url))
        assert provider.requests[-1].authorization is None
    await client.aclose()


@pytest.mark.parametrize("code", [403, 404])
async def test_an_unreadable_secret_says_which_and_what_to_do(code: int) -> None:
    kube = FakeKube()
    kube.errors[("Secret", "provider-token")] = api_error(code)
    client = client_for(kube)
    with provider_server() as provider:
        policy = http_policy(provider.status_url, provider.cancel_url, secret=True)
        got = await client.look_up("ns", http_claim(), policy)
        assert got.state is S.UNKNOWN and got.error is not None
        assert "Secret provider-token" in got.error and len(got.error) <= MAX_ERROR_LENGTH
        if code == 403:  # the grant that is missing, and where (README "Security model")
            assert "not granted (bind <release>-provider-tokens" in got.error
            assert "-provider-tokens to the operator in ns)" in got.error
        else:
            assert "not found" in got.error
        done, cancel = await client.forward_cancel(
            "ns", http_claim(), policy, UpstreamCancel.SUSPEND
        )
        assert not done
        assert cancel.startswith("not forwarded: Secret provider-token")
        assert provider.requests == []  # nothing sent without the token
    await client.aclose()


async def test_a_secret_without_the_key_or_with_garbage() -> None:
    kube = FakeKube()
    client = client_for(kube)
    policy = http_policy("http://127.0.0.1:9/{operationId}", secret=True)
    kube.objects[("Secret", "provider-token")] = Secret(data={"other": "eA=="})
    got = await client.look_up("ns", http_claim(), policy)
    assert got.error == "Secret provider-token has no key token"
    kube.objects[("Secret", "provider-token")] = Secret(data={"token": "!!not base64"})
    got = await client.look_up("ns", http_claim(), policy)
    assert got.error == "Secret provider-token key token is not a text token"
    await client.aclose()


async def test_an_unreachable_or_slow_provider_is_an_error_answer() -> None:
    client = client_for(FakeKube(), deadline_seconds=0.5)
    with provider_server() as provider:
        provider.script("op/1", Answer(200, {"operationId": "op/1", "state": "Running"}, 2.0))
        slow = await client.look_up("ns", http_claim(), http_policy(provider.status_url))
        assert slow.state is S.UNKNOWN and slow.error is not None
        assert slow.error == "unreachable"
        url = provider.status_url
    gone = await client.look_up("ns", http_claim(), http_policy(url))
    assert gone.error == "unreachable"
    await client.aclose()


async def test_forwarding_a_cancel_over_http() -> None:
    client = client_for(FakeKube())
    with provider_server() as provider:
        policy = http_policy(provider.status_url, provider.cancel_url)
        how = UpstreamCancel.DELETE
        assert await client.forward_cancel("ns", http_claim(), policy, how) == (
            True,
            "requested (HTTP 202)",
        )
        provider.on_cancel("op/1", 409)
        assert await client.forward_cancel("ns", http_claim(), policy, how) == (
            False,
            "refused (HTTP 409)",
        )
        assert provider.cancels("op/1") == 2
        assert {(r.method, r.path) for r in provider.requests} == {
            ("POST", "/operations/op%2F1/cancel")
        }
        no_cancel = http_policy(provider.status_url)
        done, text = await client.forward_cancel("ns", http_claim(), no_cancel, how)
        assert not done and text == "not forwarded: the provider endpoint has no cancelURL"
        done, never = await client.forward_cancel("ns", http_claim(), policy, UpstreamCancel.NEVER)
        assert not done and never.startswith("not forwarded") and provider.cancels("op/1") == 2
        url = provider.cancel_url
    done, gone = await client.forward_cancel("ns", http_claim(), http_policy(url, url), how)
    assert not done and gone == "not forwarded: unreachable"
    await client.aclose()


async def test_forwarding_a_cancel_to_objects() -> None:
    kube = FakeKube()
    client = client_for(kube)
    # The owner's consent to a deletion: the object is labelled with the claim's name.
    kube.objects[("Job", "train-7")] = obj(labels={"reservoir.dev/claim": "c"})
    suspend, delete = UpstreamCancel.SUSPEND, UpstreamCancel.DELETE
    suspended = await client.forward_cancel("ns", job_claim(), NO_PROVIDER, suspend)
    assert suspended == (True, "suspended the Job")
    assert kube.calls[-1][:4] == ("patch", "Job", "train-7", {"spec": {"suspend": True}})
    assert kube.calls[-1][4]["namespace"] == "ns"
    assert kube.calls[-1][4]["patch_type"].value == "application/merge-patch+json"
    for other in ("", "d"):  # no claim's, or another claim's: not deleted
        done, text = await client.forward_cancel("ns", job_claim(), NO_PROVIDER, delete, other)
        assert (done, text) == (
            False,
            f"not forwarded: Job train-7 is not labelled reservoir.dev/claim={other}",
        )
        assert kube.calls[-1][0] != "delete"
    deleted = await client.forward_cancel("ns", job_claim(), NO_PROVIDER, delete, "c")
    assert deleted == (True, "deleted Job train-7")
    assert kube.calls[-1][:3] == ("delete", "Job", "train-7")
    assert kube.calls[-1][3]["cascade"].value == "Background"
    # Or with the claim's UID (issue 25: a claim's name may not fit in a label value).
    long_name = "c" * 200
    kube.objects[("Job", "train-7")] = obj(labels={"reservoir.dev/claim": "uid-1"})
    deletes = sum(call[0] == "delete" for call in kube.calls)
    done, text = await client.forward_cancel("ns", job_claim(), NO_PROVIDER, delete, long_name)
    assert not done and "is not labelled" in text
    done, text = await client.forward_cancel(
        "ns", job_claim(), NO_PROVIDER, delete, long_name, "uid-2"
    )
    assert not done and "is not labelled reservoir.dev/claim=uid-2 (the claim's UID) or" in text
    assert sum(call[0] == "delete" for call in kube.calls) == deletes
    deleted = await client.forward_cancel(
        "ns", job_claim(), NO_PROVIDER, delete, long_name, "uid-1"
    )
    assert deleted == (True, "deleted Job train-7")

    pod = job_claim(apiVersion="v1", kind="Pod", name="w-1")
    done, text = await client.forward_cancel("ns", pod, NO_PROVIDER, suspend)
    assert not done
    assert text == "not forwarded: a Pod cannot be suspended (policy Delete deletes it)"
    kube.objects[("Pod", "w-1")] = obj("Pod", "w-1", labels={"reservoir.dev/claim": "c"})
    deleted = await client.forward_cancel("ns", pod, NO_PROVIDER, delete, "c")
    assert deleted == (True, "deleted Pod w-1")

    training = job_claim(apiVersion="example.com/v1", kind="Training", name="t1")
    done, text = await client.forward_cancel("ns", training, NO_PROVIDER, suspend)
    assert (done, text) == (False, "not forwarded: only Jobs can be suspended")
    done, text = await client.forward_cancel("ns", training, NO_PROVIDER, delete, "c")
    assert (done, text) == (False, "not forwarded: Training t1 not found")
    kube.errors[("Training", "t1")] = api_error(403)
    done, text = await client.forward_cancel("ns", training, NO_PROVIDER, delete, "c")
    assert (done, text) == (False, "failed: Training t1: HTTP 403 Reason")
    kube.errors[("Job", "train-7")] = RuntimeError("x" * 500)
    done, text = await client.forward_cancel("ns", job_claim(), NO_PROVIDER, suspend)
    assert not done and text.startswith("failed: RuntimeError") and len(text) <= MAX_ERROR_LENGTH
    await client.aclose()


def test_a_suspended_job_is_never_cancelled() -> None:
    """Suspended, by the operator's forwarded cancel or by a queue, with no pod left: not
    terminal while the Job exists (anyone may resume it)."""
    suspended = obj(status={"conditions": [cond("Suspended")]}, spec={"suspend": True})
    assert job_answer(suspended).state is S.PENDING
    stopping = obj(
        status={"terminating": 1, "conditions": [cond("Suspended")]}, spec={"suspend": True}
    )
    assert job_answer(stopping).state is S.RUNNING, "pods remain"


# --- found by review: names that leave the namespace, selectors, floods ----------------


def test_names_that_would_leave_the_namespace_are_refused_by_schema_and_adapter() -> None:
    import pytest
    from pydantic import ValidationError

    from reservoir.core.model import ObjectRef, SecretKeyRef
    from reservoir.k8s.providers import checked_name, resource_for

    for bad in ("../../victim/jobs/x", "a/b", "Upper", "x..", ""):
        with pytest.raises(ValidationError):
            ObjectRef(name=bad)
        with pytest.raises(ValidationError):
            SecretKeyRef(name=bad, key="token")
        with pytest.raises(ValueError, match="not a Kubernetes object name"):
            checked_name(bad, "Job")
    forged = ObjectRef.model_construct(api_version=None, kind="Job", name="../../v/jobs/x")
    with pytest.raises(ValueError, match="not a Kubernetes object name"):
        resource_for(forged)
    assert ObjectRef(kind="Pod", name="w-1").resolved_api_version == "v1"
    assert ObjectRef(name="train-7").resolved_api_version == "batch/v1"
    assert ObjectRef(kind="Training", name="t", apiVersion="ml.example.com/v1").api_version


def test_field_selector_values_are_escaped() -> None:
    from reservoir.k8s.resources import field_value

    assert field_value("plain-key") == "plain-key"
    assert field_value("a,b=c") == "a\\,b\\=c"
    assert field_value("a\\b") == "a\\\\b"


async def test_a_flooding_or_trickling_provider_is_cut_off() -> None:
    client = client_for(FakeKube(), deadline_seconds=0.5)
    with provider_server() as provider:
        big = {"operationId": "op/1", "state": "Running", "pad": "x" * (80 * 1024)}
        provider.script("op/1", Answer(200, big))
        got = await client.look_up("ns", http_claim(), http_policy(provider.status_url))
        assert got.state is S.UNKNOWN and got.error is not None and "larger than" in got.error
        slow = Answer(200, {"operationId": "op/1", "state": "Running"}, 1.5)
        provider.script("op/1", slow)
        got = await client.look_up("ns", http_claim(), http_policy(provider.status_url))
        assert got.error == "unreachable"
    await client.aclose()
