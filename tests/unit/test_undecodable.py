"""Objects the operator cannot decode are set aside, the rest served (issue 21): a claim
nested 2,000 levels deep failed the whole LIST and every watch line it was in."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reservoir.endpoints import Health
from reservoir.undecodable import MAX_DEPTH, SetAside, decode_event, decode_list, loads


def deep(levels: int) -> str:
    """An affinity nested `levels` deep, as JSON text (json.dumps would recurse)."""
    return '{"a":' * levels + "1" + "}" * levels


def claim_text(name: str, affinity: str, uid: str = "", namespace: str = "team-a") -> str:
    return (
        '{"apiVersion":"reservoir.dev/v1alpha1","kind":"BranchClaim","metadata":'
        f'{{"name":"{name}","namespace":"{namespace}","uid":"{uid or "uid-" + name}",'
        f'"resourceVersion":"7","generation":2,"managedFields":[{{"fieldsV1":{affinity}}}]}},'
        f'"spec":{{"envelope":"e","placement":{{"affinity":{affinity}}},'
        '"note":"a string with [ { brackets \\" and quotes"}}'
    )


def collect() -> tuple[list[SetAside], Any]:
    found: list[SetAside] = []
    return found, found.append


def test_the_json_decoder_refuses_the_deep_claim_as_kopf_met_it() -> None:
    with pytest.raises(RecursionError):
        json.loads(claim_text("deep", deep(2000)))


def test_a_list_keeps_every_readable_item_and_sets_the_deep_one_aside() -> None:
    items = [claim_text("a", "{}"), claim_text("deep", deep(2000)), claim_text("b", deep(20))]
    body = '{"kind":"BranchClaimList","apiVersion":"reservoir.dev/v1alpha1",'
    body += '"metadata":{"resourceVersion":"9"},"items":[' + ",".join(items) + "]}"
    found, report = collect()
    listed = decode_list(body, report)
    assert [i["metadata"]["name"] for i in listed["items"]] == ["a", "b"]
    assert listed["items"][1] == json.loads(items[2])  # untouched, 20 levels and all
    assert listed["metadata"]["resourceVersion"] == "9"
    assert len(found) == 1
    aside = found[0]
    assert (aside.kind, aside.namespace, aside.name, aside.uid) == (
        "BranchClaim",
        "team-a",
        "deep",
        "uid-deep",
    )
    assert (aside.api_version, aside.resource_version, aside.generation) == (
        "reservoir.dev/v1alpha1",
        "7",
        2,
    )
    assert str(MAX_DEPTH) in aside.why


def test_a_readable_list_is_decoded_as_it_always_was() -> None:
    found, report = collect()
    body = '{"items":[' + claim_text("a", deep(50)) + "]}"
    assert decode_list(body, report) == json.loads(body)
    assert found == []


def test_a_deep_watch_event_becomes_a_bookmark_at_its_version() -> None:
    found, report = collect()
    line = '{"type":"MODIFIED","object":' + claim_text("deep", deep(3000)) + "}"
    assert decode_event(line, report) == {
        "type": "BOOKMARK",
        "object": {"metadata": {"resourceVersion": "7"}},
    }
    assert [f.name for f in found] == ["deep"]


def test_a_deep_object_deleted_is_delivered_as_deleted_without_its_body() -> None:
    found, report = collect()
    line = '{"type":"DELETED","object":' + claim_text("deep", deep(3000)) + "}"
    event = decode_event(line, report)
    assert event["type"] == "DELETED"
    assert event["object"]["metadata"]["uid"] == "uid-deep"
    assert "managedFields" not in event["object"]["metadata"]
    assert "spec" not in event["object"]
    assert len(found) == 1


def test_a_line_that_is_not_json_still_fails_the_watch() -> None:
    """Nothing names the object: the watch fails and is restarted (kopf_watch), and
    /readyz says so meanwhile; it is not skipped silently."""
    found, report = collect()
    with pytest.raises(ValueError, match="Expecting"):
        decode_event('{"type":"ADDED","object":{"metadata":', report)
    with pytest.raises(ValueError, match="Expecting"):
        decode_list('{"items":[', report)
    assert found == []


def test_a_readable_event_is_decoded_as_it_always_was() -> None:
    found, report = collect()
    line = '{"type":"ADDED","object":' + claim_text("a", "{}") + "}"
    assert decode_event(line, report) == json.loads(line)
    assert found == []


def test_readiness_says_a_watch_is_down_until_it_has_listed_again() -> None:
    health = Health(started=True)
    assert health.problem() is None
    health.watch_down("branchclaims.reservoir.dev cluster-wide", "RecursionError: too deep")
    problem = health.problem()
    assert problem is not None and "branchclaims.reservoir.dev cluster-wide" in problem
    health.watch_up("branchclaims.reservoir.dev cluster-wide")
    assert health.problem() is None


# Any JSON document the API server can send: objects, lists, strings with escapes and
# non-ASCII text, integers (int64, uint64, and float64s Go writes without an exponent, up
# to 1e21), floats, booleans and null.
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**21), max_value=10**21)
    | st.sampled_from([2**63 - 1, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 310091574997940240000])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
def test_orjson_decodes_every_document_as_python_s_decoder_does(value: Any) -> None:
    text = json.dumps(value)
    decoded = loads(text)
    assert decoded == json.loads(text)
    assert json.dumps(decoded) == json.dumps(json.loads(text))  # types too (1 is not 1.0)


@pytest.mark.parametrize("text", ["NaN", '{"a": Infinity}', '"\\ud800"', "[" * 2000 + "]" * 2000])
def test_what_orjson_refuses_is_decoded_or_refused_as_python_s_decoder_does(text: str) -> None:
    try:
        expected: Any = json.loads(text)
    except (RecursionError, ValueError) as error:
        with pytest.raises(type(error)):
            loads(text)
        return
    decoded = loads(text)
    assert json.dumps(decoded) == json.dumps(expected)


def test_long_digits_inside_a_string_keep_the_fast_decoder() -> None:
    """Digits in a string (a timestamp in nanoseconds) are no number: the document stays on
    orjson, whose objects share their keys (found by review: 40 % more memory a record)."""
    first, second = (
        loads(json.dumps({"metadata": {"annotations": {"t": "1733299200000000000"}}}))
        for _ in range(2)
    )
    assert next(iter(first)) is next(iter(second))
    assert first["metadata"]["annotations"]["t"] == "1733299200000000000"


def test_objects_decoded_one_by_one_share_their_keys() -> None:
    first, second = (loads(json.dumps({"lastTransitionTime": i})) for i in range(2))
    assert next(iter(first)) is next(iter(second))
