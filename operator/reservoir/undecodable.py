"""Objects the operator cannot decode: set aside, so that the others are still served.

A tenant can store an object that Python's JSON decoder refuses: nested a few thousand
levels deep (a free-form field the schema did not bound), it raises `RecursionError`.
kopf decodes a whole LIST response, or a watch event, at once: one such object failed the
watch of its kind for every namespace, and a restart read it again.

`decode_list` and `decode_event` decode as usual and, only when that fails, decode again
with every container nested deeper than `MAX_DEPTH` replaced by a marker: the objects that
hold one are taken out (from a list) or turned into a BOOKMARK that carries their
resourceVersion (a watch event: kopf skips it and resumes after it), and reported to
`on_set_aside` with their identity, which sits at the top of the object and survives.
Documents are decoded with orjson, and with Python's own decoder where orjson refuses one
or would read a number differently (an integer literal past 64 bits, which orjson reads
as a float: found by review): orjson is about twice as fast, and it shares the keys of
every object it decodes, where each object decoded by `json` held its own copy of every
key (the operator keeps a record of each of up to 100,000 claims,
`claim_source.claim_record`). orjson refuses nesting past 1,024 levels, where `json`'s
limit was the stack left to it (about 940 levels from kopf's): an object nested between
the two is now delivered, as shallower ones always were; deeper, it is set aside as
before.
A document that is not JSON at all cannot name its object: it raises as before (the watch
fails, and `kopf_watch` restarts it and says so on /readyz meanwhile). Pure: no I/O here;
`kopf_watch` installs these into kopf.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

# Deeper than any object the operator reads (a pod's affinity is about 12 levels) and far
# below what the decoder manages on the stack that kopf calls it from.
MAX_DEPTH = 100
_MARKER = "\x00reservoir.dev/too-deep\x00"  # a JSON string no API object holds: NUL inside
_MARKER_JSON = json.dumps(_MARKER)
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
# A number of 19 digits or more: perhaps an integer past 64 bits (below -2**63, or 2**64
# and up: 20 digits), which orjson reads as a float. Only where a JSON number can start
# (first, or after `:`, `,` or `[`): digits inside a string (a timestamp in nanoseconds in an
# annotation) would send every event of that object to the slower decoder, whose objects
# share no keys (found by review: 40 % more memory for each such claim's record). A string
# holding ":" and 19 digits only costs that object the slower decoder.
_LONG_NUMBER = re.compile(r"(?:\A|[:,\[])\s*-?[0-9]{19}")


@dataclass(frozen=True)
class SetAside:
    """An object left out because it could not be decoded, and why."""

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str
    resource_version: str
    generation: int | None
    why: str


Report = Callable[[SetAside], None]


def _cut_deep(text: str, depth: int = MAX_DEPTH) -> str:
    """`text` with every container that opens deeper than `depth` replaced by the marker.
    Linear: one pass over the brackets and strings (strings may hold brackets)."""
    pieces: list[str] = []
    level = 0
    kept_until = 0  # text[:kept_until] is in pieces already
    skipping_from: int | None = None
    for token in _TOKENS.finditer(text):
        char = token.group()
        if char in "[{":
            level += 1
            if level > depth and skipping_from is None:
                skipping_from = token.start()
        elif char in "]}":
            if skipping_from is not None and level == depth + 1:
                pieces += [text[kept_until:skipping_from], _MARKER_JSON]
                kept_until, skipping_from = token.end(), None
            level -= 1
    pieces.append(text[kept_until:])
    return "".join(pieces)


def _holds_marker(value: Any) -> bool:
    """Whether the marker is anywhere in `value` (already cut to MAX_DEPTH: no recursion
    limit to fear, but walked with a stack anyway)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif item == _MARKER:
            return True
    return False


def _identity(obj: Any, why: str, default_kind: str = "", default_api: str = "") -> SetAside:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    meta = meta if isinstance(meta, dict) else {}

    def text(value: Any) -> str:
        return value if isinstance(value, str) else ""

    generation = meta.get("generation")
    return SetAside(
        api_version=text(obj.get("apiVersion")) or default_api,
        kind=text(obj.get("kind")) or default_kind,
        namespace=text(meta.get("namespace")),
        name=text(meta.get("name")),
        uid=text(meta.get("uid")),
        resource_version=text(meta.get("resourceVersion")),
        generation=generation if isinstance(generation, int) else None,
        why=why,
    )


def _why(error: BaseException) -> str:
    if isinstance(error, RecursionError):
        return f"nested deeper than the operator decodes ({MAX_DEPTH} levels)"
    return f"not decodable: {type(error).__name__}"


def loads(text: str) -> Any:
    """A JSON document decoded, by orjson; by `json` if it may hold an integer past 64 bits,
    or if orjson refuses it (NaN, a lone surrogate, nesting past orjson's limit): `json`'s
    answer or error stands."""
    if _LONG_NUMBER.search(text) is None:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text)


def _salvage(text: str) -> Any:
    """The document with too-deep containers cut out, or None if even that fails."""
    try:
        return json.loads(_cut_deep(text))
    except (RecursionError, ValueError):
        return None


def decode_event(line: str, on_set_aside: Report) -> Any:
    """A watch event: decoded; or, holding an undecodable object, a BOOKMARK at that
    object's resourceVersion (the object reported). Anything else raises as before."""
    try:
        return loads(line)
    except (RecursionError, ValueError) as error:
        why, failure = _why(error), error
    event = _salvage(line)
    if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
        raise failure
    obj = event["object"]
    if event.get("type") not in ("ADDED", "MODIFIED", "DELETED") or not _holds_marker(obj):
        raise failure
    found = _identity(obj, why)
    on_set_aside(found)
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    if event["type"] == "DELETED" and not _holds_marker(meta):
        # Gone: whatever the operator kept of an earlier, decodable version goes too.
        slim = {"apiVersion": found.api_version, "kind": found.kind, "metadata": meta}
        return {"type": "DELETED", "object": slim}
    return {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": found.resource_version}}}


def decode_list(body: str, on_set_aside: Report) -> Any:
    """A LIST response: decoded; or, with items that cannot be, without those items
    (each reported). Anything else that fails to decode raises as before."""
    try:
        return loads(body)
    except (RecursionError, ValueError) as error:
        why, failure = _why(error), error
    listed = _salvage(body)
    if not isinstance(listed, dict) or not isinstance(listed.get("items"), list):
        raise failure
    kind = str(listed.get("kind") or "").removesuffix("List")
    api_version = str(listed.get("apiVersion") or "")
    kept = []
    for item in listed["items"]:
        if _holds_marker(item):
            on_set_aside(_identity(item, why, kind, api_version))
        else:
            kept.append(item)
    if _holds_marker({k: v for k, v in listed.items() if k != "items"}):
        raise failure
    listed["items"] = kept
    return listed
