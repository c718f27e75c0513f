"""Provider adapters: what the upstream operation of a claim says about itself.

A claim names its upstream operation either as a Kubernetes object in its namespace
(`upstream.ref`: a Job, a Pod, or any object with standard `status.conditions`) or as an
operation id the envelope's HTTP endpoint (`policy.provider`) answers for. The pure
functions here read an object or an HTTP answer into a `ProviderAnswer`; `ProviderClient`
does the I/O (and never raises: a lookup that failed is an answer with `error` set).

Objects. A terminal object may carry, as annotations, what the work consumed and where its
result is:
    reservoir.dev/usage:  '{"tokens": "12k", "cost": "0.42"}'  (Kubernetes quantities)
    reservoir.dev/result: 's3://bucket/run-7/out.json'         (default: "Job/train-7")
Without the usage annotation the answer says nothing of usage (`usage` None): the claim
does not settle on it (a completion is not proof of zero usage).

HTTP contract. GET statusURL ("{operationId}" replaced by the URL-escaped id, with
"Authorization: Bearer <token>" when the endpoint names a token Secret) answers 200 with
    {"operationId": "op-1", "state": "Succeeded",
     "usage": {"tokens": "12k"}, "result": "s3://bucket/op-1"}
where state is one of Pending, Running, Succeeded, Failed, Cancelled, NeverStarted,
Unknown, and usage and result are optional (read only for terminal states; without usage,
a terminal answer settles nothing, {} says nothing was used). 404 means the
provider does not know the operation (Unknown). POST cancelURL (same substitution) asks
for cancellation; any 2xx is "requested", never "confirmed". The calls are made by
provider_http (the administrator's allow-list, caps and rate per namespace, no cookies, no
redirects); a call it does not make or that gets no answer is recorded only as "refused by
policy" or "unreachable" (what exactly went wrong is in the operator's log).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
import urllib.parse
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from lightkube import ApiError, AsyncClient
from lightkube.core.resource import NamespacedResourceG
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.batch_v1 import Job
from lightkube.resources.core_v1 import Pod, Secret
from lightkube.types import CascadeType, PatchType

from reservoir.core.model import (
    API_GROUP,
    API_VERSION_PATTERN,
    MAX_ERROR_LENGTH,
    MAX_RESOURCES,
    MAX_RESULT_LENGTH,
    OBJECT_NAME,
    RESOURCE_NAME,
    BranchClaimSpec,
    EnvelopePolicy,
    ObjectRef,
    ProviderEndpoint,
    ProviderState,
    UpstreamCancel,
)
from reservoir.core.provider import Adapter, ProviderAnswer, adapter_for
from reservoir.core.quantity import parse_quantity
from reservoir.k8s.provider_http import (
    AnswerTooLargeError,
    BusyError,
    ProviderHttp,
    RateLimitedError,
    RefusedByPolicyError,
    UnreachableError,
)
from reservoir.k8s.provider_policy import check_template
from reservoir.k8s.resources import CLAIM_LABEL, labelled_for

log = logging.getLogger("reservoir.providers")

USAGE_ANNOTATION = f"{API_GROUP}/usage"
RESULT_ANNOTATION = f"{API_GROUP}/result"
# What the tenant sees of an HTTP call that was not made or got no answer: nothing more,
# so that the error is no oracle of what listens where (details: the operator's log).
REFUSED_BY_POLICY = "refused by policy"
UNREACHABLE = "unreachable"
BUSY = "not called: too many provider calls in flight"
RATE_LIMITED = "not called: too many provider calls from this namespace lately"
OPERATION_ID_PLACEHOLDER = "{operationId}"

# The CRD's rule for resource names (reservoir.core.model.RESOURCE_NAME_RULE): a usage map
# the ledger could not store is refused here, as an unreadable answer.
_RESOURCE_NAME = re.compile(RESOURCE_NAME)
_API_VERSION = re.compile(API_VERSION_PATTERN)


# What a forwarded cancel says (anything else was not forwarded, and is tried again).
REQUESTED = "requested"
SUSPENDED = "suspended the Job"
DELETED = "deleted"
FORWARDED = (REQUESTED, SUSPENDED, DELETED)


def cut(text: str, bound: int = MAX_ERROR_LENGTH) -> str:
    """At most `bound` characters (the status fields' bounds)."""
    return text if len(text) <= bound else text[: bound - 1] + "…"


def failed(error: str) -> ProviderAnswer:
    """A lookup that did not get an answer: Unknown, with why."""
    return ProviderAnswer(state=ProviderState.UNKNOWN, error=cut(error))


# --- reading answers (pure) ----------------------------------------------------------------


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _true_conditions(status: Mapping[str, Any]) -> set[str]:
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return set()
    return {
        str(c.get("type"))
        for c in conditions
        if isinstance(c, Mapping) and str(c.get("status", "")).lower() == "true"
    }


def parse_usage(raw: object) -> dict[str, Decimal]:
    """A usage map from JSON: resource name -> quantity (a string, or an integer). Raises
    ValueError (naming the resource) for anything the ledger could not hold."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError("usage is not a JSON object of resource to quantity")
    if len(raw) > MAX_RESOURCES:
        raise ValueError(f"usage names {len(raw)} resources, at most {MAX_RESOURCES}")
    usage: dict[str, Decimal] = {}
    for name, value in raw.items():
        if not isinstance(name, str) or len(name) > 63 or not _RESOURCE_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a resource name")
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise ValueError(f"{name}: {value!r} is not a quantity string")
        try:
            usage[name] = parse_quantity(value)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
    return usage


def _settled(state: ProviderState, obj: Mapping[str, Any], kind: str) -> ProviderAnswer:
    """A terminal answer from an object, with the usage and result its annotations name."""
    meta = _mapping(obj.get("metadata"))
    annotations = _mapping(meta.get("annotations"))
    text = annotations.get(USAGE_ANNOTATION)
    usage: dict[str, Decimal] | None = None  # not said: not proof of zero usage
    if text is not None:
        try:
            usage = parse_usage(json.loads(str(text)))
        except ValueError as error:  # JSONDecodeError, QuantityError are ValueErrors
            return failed(f"annotation {USAGE_ANNOTATION} is unreadable: {error}")
    result = annotations.get(RESULT_ANNOTATION)
    if not isinstance(result, str) or not result:
        result = f"{kind}/{meta.get('name', '')}"
    return ProviderAnswer(state=state, usage=usage, result=result[:MAX_RESULT_LENGTH])


def _answer(state: ProviderState, obj: Mapping[str, Any], kind: str) -> ProviderAnswer:
    return _settled(state, obj, kind) if state.terminal else ProviderAnswer(state=state)


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def job_answer(obj: Mapping[str, Any]) -> ProviderAnswer:
    """A batch/v1 Job: Complete or SuccessCriteriaMet -> Succeeded; Failed or FailureTarget
    -> Failed; active (or terminating) pods or a start time -> Running; otherwise (queued,
    or suspended) Pending. A suspended Job is never Cancelled, even one the operator
    suspended to forward a cancel: whoever may write the Job can resume it, and it runs
    and completes (found by review). Only its own terminal condition is an answer."""
    status = _mapping(obj.get("status"))
    true = _true_conditions(status)
    if true & {"Complete", "SuccessCriteriaMet"}:
        state = ProviderState.SUCCEEDED
    elif true & {"Failed", "FailureTarget"}:
        state = ProviderState.FAILED
    elif (
        _count(status.get("active")) > 0
        or _count(status.get("terminating")) > 0
        or status.get("startTime")
    ):
        state = ProviderState.RUNNING
    else:  # not started: queued, or spec.suspend before it started
        state = ProviderState.PENDING
    return _answer(state, obj, "Job")


def pod_answer(obj: Mapping[str, Any]) -> ProviderAnswer:
    """A v1 Pod by its phase. Pending stays Pending once bound to a node (its containers
    have not started); a pod being deleted that has not finished is still Running (its
    containers may be, until they stop)."""
    status = _mapping(obj.get("status"))
    phase = status.get("phase")
    if phase == "Succeeded":
        return _answer(ProviderState.SUCCEEDED, obj, "Pod")
    if phase == "Failed":
        return _answer(ProviderState.FAILED, obj, "Pod")
    if _mapping(obj.get("metadata")).get("deletionTimestamp"):
        return ProviderAnswer(state=ProviderState.RUNNING)
    if phase == "Running":
        return ProviderAnswer(state=ProviderState.RUNNING)
    if phase in ("Pending", None, ""):
        return ProviderAnswer(state=ProviderState.PENDING)
    return ProviderAnswer(state=ProviderState.UNKNOWN)  # phase Unknown: node lost


def conditions_answer(obj: Mapping[str, Any]) -> ProviderAnswer:
    """Any object with standard status.conditions: Complete or Succeeded -> Succeeded,
    Failed -> Failed, Running or Ready -> Running (each with status True). No conditions, or
    none of these true: Unknown (not an error: the object has not said anything yet)."""
    kind = str(obj.get("kind") or "Object")
    true = _true_conditions(_mapping(obj.get("status")))
    if true & {"Complete", "Succeeded"}:
        return _answer(ProviderState.SUCCEEDED, obj, kind)
    if "Failed" in true:
        return _answer(ProviderState.FAILED, obj, kind)
    if true & {"Running", "Ready"}:
        return ProviderAnswer(state=ProviderState.RUNNING)
    return ProviderAnswer(state=ProviderState.UNKNOWN)


def is_job(ref: ObjectRef) -> bool:
    return ref.resolved_api_version == "batch/v1" and ref.kind == "Job"


def is_pod(ref: ObjectRef) -> bool:
    return ref.resolved_api_version == "v1" and ref.kind == "Pod"


def checked_name(name: str, what: str) -> str:
    """A name the operator puts in an API path: an RFC 1123 subdomain, nothing else, even
    if the schema were bypassed (a name is a path segment: "../x" would leave the
    namespace)."""
    if not re.fullmatch(OBJECT_NAME, name):
        raise ValueError(f"{what} name {name!r} is not a Kubernetes object name")
    return name


def object_answer(ref: ObjectRef, obj: Mapping[str, Any] | None) -> ProviderAnswer:
    """The answer of the object `ref` names (None: it does not exist)."""
    if obj is None:
        return failed(f"{ref.kind} {ref.name} not found")
    if is_job(ref):
        return job_answer(obj)
    if is_pod(ref):
        return pod_answer(obj)
    return conditions_answer({**obj, "kind": ref.kind})


def http_answer(status_code: int, body: bytes, operation_id: str) -> ProviderAnswer:
    """The HTTP contract's answer (see the module's docstring) for `operation_id`."""
    if status_code == 404:
        return failed("operation not found")
    if status_code != 200:
        return failed(f"HTTP {status_code}")
    try:
        doc = json.loads(body)
    except ValueError:  # not JSON, or not UTF-8
        return failed("answer is not JSON")
    if not isinstance(doc, dict):
        return failed("answer is not a JSON object")
    if "operationId" not in doc:
        return failed("answer has no operationId")
    if doc["operationId"] != operation_id:
        return failed("answer names another operation")
    raw_state = doc.get("state")
    try:
        state = ProviderState(str(raw_state))
    except ValueError:
        return failed(f"answer has an unknown state {str(raw_state)[:40]!r}")
    if not state.terminal:
        return ProviderAnswer(state=state)
    try:
        raw_usage = doc.get("usage")
        usage = None if raw_usage is None else parse_usage(raw_usage)
    except ValueError as error:
        return failed(f"answer's usage is unreadable: {error}")
    result = doc.get("result")
    if result is not None and not isinstance(result, str):
        return failed("answer's result is not a string")
    return ProviderAnswer(
        state=state, usage=usage, result=result[:MAX_RESULT_LENGTH] if result else None
    )


def operation_url(template: str, operation_id: str) -> str:
    return template.replace(OPERATION_ID_PLACEHOLDER, urllib.parse.quote(operation_id, safe=""))


# --- reading objects (I/O) -----------------------------------------------------------------


def plural_of(kind: str) -> str:
    """The resource (plural) name of a kind, guessed as Kubernetes guesses it
    (meta.UnsafeGuessKindToResource): lowercase; -s -> -ses, -y -> -ies, else -s. Right for
    Job, Pod and nearly every CRD; a kind whose plural is irregular cannot be referenced
    (there is no discovery lookup: the operator's RBAC does not need one)."""
    lower = kind.lower()
    if lower.endswith("s"):
        return lower + "es"
    if lower.endswith("y"):
        return lower[:-1] + "ies"
    return lower + "s"


def resource_for(ref: ObjectRef) -> type[NamespacedResourceG]:
    """The lightkube resource to read `ref` with: the typed Job and Pod, else a generic
    namespaced resource of that group/version/kind. Raises ValueError for an apiVersion that
    is not [group/]version, or a kind lightkube knows with another plural."""
    checked_name(ref.name, ref.kind)
    if is_job(ref):
        return Job
    if is_pod(ref):
        return Pod
    api_version = ref.resolved_api_version
    if api_version is None or not _API_VERSION.fullmatch(api_version):
        raise ValueError(f"apiVersion {api_version!r} is not [group/]version")
    group, _, version = api_version.rpartition("/")
    resource: type[NamespacedResourceG] = create_namespaced_resource(
        group, version, ref.kind, plural_of(ref.kind)
    )
    return resource


def _as_mapping(obj: object) -> Mapping[str, Any]:
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return _mapping(to_dict())
    return _mapping(obj)


def _api_failure(what: str, error: ApiError) -> str:
    return f"{what}: HTTP {error.status.code} {error.status.reason or ''}".rstrip()


def not_called(namespace: str, what: str, error: Exception) -> str:
    """What the tenant sees of an HTTP call that was not made or got no answer; the
    details go to the operator's log."""
    if isinstance(error, RefusedByPolicyError):
        log.warning("provider %s for namespace %s refused by policy: %s", what, namespace, error)
        return REFUSED_BY_POLICY
    if isinstance(error, BusyError):
        return BUSY
    if isinstance(error, RateLimitedError):
        return RATE_LIMITED
    detail = error if isinstance(error, UnreachableError) else f"{type(error).__name__}: {error}"
    log.info("provider %s for namespace %s unreachable: %s", what, namespace, detail)
    return UNREACHABLE


class ProviderError(Exception):
    """A call to the provider could not be made (its reason, for the claim's record)."""


class ProviderClient:
    """Looks up (and forwards cancels to) claims' upstream operations. Never raises: every
    failure is an answer (or a text) saying what went wrong."""

    def __init__(self, client: AsyncClient, http: ProviderHttp | None = None) -> None:
        self.client = client
        self.http = http if http is not None else ProviderHttp()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def look_up(
        self, namespace: str, spec: BranchClaimSpec, policy: EnvelopePolicy
    ) -> ProviderAnswer:
        try:
            adapter = adapter_for(spec, policy)
            ref, endpoint, operation = (
                spec.upstream.ref,
                policy.provider,
                spec.upstream.operation_id,
            )
            if adapter is Adapter.OBJECT and ref is not None:
                return await self._look_up_object(namespace, ref)
            if adapter is Adapter.HTTP and endpoint is not None and operation:
                return await self._look_up_http(namespace, endpoint, operation)
            return failed("nothing to look up: no upstream.ref, and no provider endpoint")
        except ProviderError as error:
            return failed(str(error))
        except Exception as error:  # never raise: a lookup that failed is an answer
            return failed(f"lookup failed: {type(error).__name__}: {error}")

    async def _look_up_object(self, namespace: str, ref: ObjectRef) -> ProviderAnswer:
        try:
            resource = resource_for(ref)
        except ValueError as error:
            return failed(f"{ref.kind} {ref.name}: {error}")
        try:
            obj = await self.client.get(resource, ref.name, namespace=namespace)
        except ApiError as error:
            if error.status.code == 404:
                return object_answer(ref, None)
            return failed(_api_failure(f"reading {ref.kind} {ref.name}", error))
        return object_answer(ref, _as_mapping(obj))

    async def _look_up_http(
        self, namespace: str, endpoint: ProviderEndpoint, operation: str
    ) -> ProviderAnswer:
        headers = await self._headers(namespace, endpoint)
        url = operation_url(endpoint.status_url, operation)
        try:
            check_template(endpoint.status_url)
            code, body = await self.http.get(namespace, url, headers)
        except AnswerTooLargeError:
            return failed(f"answer larger than {self.http.settings.max_answer_bytes} bytes")
        except Exception as error:
            return failed(not_called(namespace, "lookup", error))
        return http_answer(code, body, operation)

    async def _headers(self, namespace: str, endpoint: ProviderEndpoint) -> dict[str, str]:
        """The Authorization header, with the token from the endpoint's Secret (if any)."""
        ref = endpoint.token_secret
        if ref is None:
            return {}
        try:
            checked_name(ref.name, "Secret")
        except ValueError as error:
            raise ProviderError(str(error)) from None
        try:
            secret = await self.client.get(Secret, ref.name, namespace=namespace)
        except ApiError as error:
            if error.status.code == 403:
                # The operator reads no Secret until the namespace grants it (README
                # "Security model"): say which grant is missing, where.
                raise ProviderError(
                    f"Secret {ref.name}: not granted (bind "
                    f"<release>-provider-tokens to the operator in {namespace})"
                ) from None
            if error.status.code == 404:
                raise ProviderError(f"Secret {ref.name} not found") from None
            raise ProviderError(_api_failure(f"reading Secret {ref.name}", error)) from None
        data = secret.data or {}
        if ref.key not in data:
            raise ProviderError(f"Secret {ref.name} has no key {ref.key}")
        try:
            token = base64.b64decode(data[ref.key], validate=True).decode().strip()
        except (binascii.Error, UnicodeDecodeError):
            raise ProviderError(f"Secret {ref.name} key {ref.key} is not a text token") from None
        return {"Authorization": f"Bearer {token}"}

    async def forward_cancel(
        self,
        namespace: str,
        spec: BranchClaimSpec,
        policy: EnvelopePolicy,
        how: UpstreamCancel,
        claim: str = "",
        claim_uid: str = "",
    ) -> tuple[bool, str]:
        """Ask the provider to cancel: whether it was forwarded, and what was done, in a few
        words (never raises). Even when forwarded, the cancel is only requested: the answer
        comes by lookup. One that was not forwarded is tried again on a later pass."""
        try:
            text = await self._forward_cancel(namespace, spec, policy, how, claim, claim_uid)
        except ProviderError as error:
            text = f"not forwarded: {error}"
        except Exception as error:  # never raise
            text = f"failed: {type(error).__name__}: {error}"
        return text.startswith(FORWARDED), cut(text)

    async def _forward_cancel(
        self,
        namespace: str,
        spec: BranchClaimSpec,
        policy: EnvelopePolicy,
        how: UpstreamCancel,
        claim: str,
        claim_uid: str = "",
    ) -> str:
        if how is UpstreamCancel.NEVER:
            return "not forwarded: the envelope's upstreamCancel is Never"
        ref, endpoint, operation = spec.upstream.ref, policy.provider, spec.upstream.operation_id
        if ref is not None:
            return await self._cancel_object(namespace, ref, how, claim, claim_uid)
        if endpoint is not None and operation:  # a cancel needs no status lookup
            return await self._cancel_http(namespace, endpoint, operation)
        return "not forwarded: no upstream.ref, and no provider endpoint"

    async def _cancel_http(self, namespace: str, endpoint: ProviderEndpoint, operation: str) -> str:
        if endpoint.cancel_url is None:
            return "not forwarded: the provider endpoint has no cancelURL"
        headers = await self._headers(namespace, endpoint)
        url = operation_url(endpoint.cancel_url, operation)
        try:
            check_template(endpoint.cancel_url)
            code = await self.http.post(namespace, url, headers)
        except Exception as error:
            return f"not forwarded: {not_called(namespace, 'cancel', error)}"
        return f"{REQUESTED} (HTTP {code})" if 200 <= code < 300 else f"refused (HTTP {code})"

    async def _cancel_object(
        self, namespace: str, ref: ObjectRef, how: UpstreamCancel, claim: str, claim_uid: str = ""
    ) -> str:
        try:
            checked_name(ref.name, ref.kind)
        except ValueError as error:
            return f"not forwarded: {error}"
        try:
            if how is UpstreamCancel.SUSPEND:
                if is_job(ref):
                    await self.client.patch(
                        Job,
                        ref.name,
                        {"spec": {"suspend": True}},
                        namespace=namespace,
                        patch_type=PatchType.MERGE,
                    )
                    return SUSPENDED
                if is_pod(ref):
                    return "not forwarded: a Pod cannot be suspended (policy Delete deletes it)"
                return "not forwarded: only Jobs can be suspended"
            try:
                resource = resource_for(ref)
            except ValueError as error:
                return f"not forwarded: {ref.kind} {ref.name}: {error}"
            # Deleted only with its owner's consent: the object's label names the claim, by
            # its name or UID (a name may not fit in a label value); the chart's admission
            # policy refuses the operator any other delete.
            target = _as_mapping(await self.client.get(resource, ref.name, namespace=namespace))
            labels = (target.get("metadata") or {}).get("labels") or {}
            if not labelled_for(labels.get(CLAIM_LABEL), claim_uid, claim):
                names = f"{claim_uid} (the claim's UID) or {claim}" if claim_uid else claim
                return f"not forwarded: {ref.kind} {ref.name} is not labelled {CLAIM_LABEL}={names}"
            await self.client.delete(
                resource, ref.name, namespace=namespace, cascade=CascadeType.BACKGROUND
            )
            return f"{DELETED} {ref.kind} {ref.name}"
        except ApiError as error:
            if error.status.code == 404:
                return f"not forwarded: {ref.kind} {ref.name} not found"
            return _api_failure(f"failed: {ref.kind} {ref.name}", error)
