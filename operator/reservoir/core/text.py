"""Bounds on the texts the operator generates (queue reasons, condition messages and
reasons, Event messages), applied where each text is made.

Found by review (issue 21, §3 defect 4): with 16 resources of 63-character names, an
InsufficientCapacity message was 1,059 characters against the status field's 1,024, the
API server refused every status write of the envelope, and nothing settled. A generated
text is cut to its field's bound, with an ellipsis marking the cut, and counted in UTF-8
bytes (at most as many characters), as the ledger's byte budget counts it.
"""

from __future__ import annotations

from reservoir.core.model import MESSAGE_LENGTH, REASON_LENGTH

__all__ = ["ELLIPSIS", "EVENT_MESSAGE_LENGTH", "MESSAGE_LENGTH", "REASON_LENGTH", "bounded"]

ELLIPSIS = "…"
EVENT_MESSAGE_LENGTH = 1000  # a Kubernetes Event's message (kept under the API's 1 KiB note)


def bounded(text: str, limit: int) -> str:
    """`text` if it fits in `limit` UTF-8 bytes, else cut (never mid-character) so that it
    fits with the ellipsis after it."""
    data = text.encode()
    if len(data) <= limit:
        return text
    room = limit - len(ELLIPSIS.encode())
    return data[:room].decode(errors="ignore") + ELLIPSIS


def names(items: list[str], shown: int = 4) -> str:
    """A few names of a list, then how many more: `a, b, c, d and 12 more`."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more
