"""How big an envelope's ledger may grow: its status must always fit in one etcd object.

etcd refuses an object above ~1.5 MiB. The API server once stored the status twice over
in effect (the status itself, plus its managedFields, measured at about 0.75 of the
status); since the schema makes the status one unit of field management, its
managedFields are a few hundred bytes, and the budget below keeps that margin. So the
ledger keeps a byte budget for its status JSON, and admits a claim (or records an entry
for a claim that never held anything) only while the budget has room for the
entry's *largest possible* future: every map it can still gain (usage, consumed,
released, the late-report baseline, an overrun's usage and excess) at the longest
quantity, over the envelope's resources, plus every scalar it can still gain. Reports are
recorded over the envelope's resources only, and the API server keeps that set of
resources fixed from the envelope's creation, so nothing a worker sends can push an entry
past that. The budget can therefore never be crossed by settlement, late reports or
overruns, whatever the schema lets people write.
"""

from __future__ import annotations

from collections.abc import Iterable

from reservoir.core.model import (
    DEVICE_CLASSES,
    MAX_CHILDREN,
    MAX_CONDITIONS,
    MAX_DEVICE_NAME_LENGTH,
    MAX_ENVELOPE_CHILDREN,
    MAX_ERROR_LENGTH,
    MAX_LOANS,
    MAX_NAME_LENGTH,
    MAX_POOL_NAMESPACES,
    MAX_PREEMPTIONS,
    MAX_RESULT_LENGTH,
    MAX_TRANSITIONS,
    MESSAGE_LENGTH,
    SUMMARY_LENGTH,
    WINDOW_SLICES,
    LedgerEntry,
    ReservationEnvelopeStatus,
)
from reservoir.core.model.preemption import PREEMPTOR_LENGTH

# The status JSON: the object stays well under etcd's limit, managedFields or not.
LEDGER_BYTES_BUDGET = 640 * 1024
LONGEST_QUANTITY = len('"1000000000000000000.000000000"')  # 1E with nine decimals, quoted
ENTRY_KEY_BYTES = 48  # the claim UID as the entry's key
# Scalars an admitted entry can still gain: commit, start and detach times, a heartbeat,
# a deadline action, the settlement record, late-report and overrun bookkeeping.
GROWING_SCALARS_BYTES = 1024
# Preemption (reservoir.core.preemption) at its largest: a pool's request (keyed by UID),
# and an envelope's decision on one.
PREEMPTION_REQUEST_BYTES = 48 + MAX_NAME_LENGTH + 63 + PREEMPTOR_LENGTH + 64 + 63 + 40 + 160
# A namespace's line in `status.shares` beside what it holds: share, weight, counts, keys.
SHARE_SCALARS_BYTES = 200
PREEMPTION_RECORD_BYTES = PREEMPTOR_LENGTH + 64 + 63 + 16 + 40 + MESSAGE_LENGTH + 160
# Recorded later for a device claim: the hand-off time and that the devices are free.
DEVICES_RELEASED_BYTES = (
    len(',"released":true,"handedOffAt":"2026-01-01T00:00:00.000000Z","handedOffTo":""') + 64
)
CONDITION_BYTES = 1400  # a condition at its bounds (type, reason, message, time)
# One history item at its bounds: phases, a 48-character reason, trigger, time, generation.
TRANSITION_BYTES = (
    len(
        '{"from":"Committed","to":"Committed","reason":"","trigger":"Admission",'
        '"at":"2026-01-01T00:00:00.000000Z","leaseGeneration":1000000000},'
    )
    + 48
)
# The provider record at its bounds: state, times, counters, the error and cancel texts.
PROVIDER_BYTES = 2 * MAX_ERROR_LENGTH + len(
    ',"provider":{"state":"NeverStarted","checkedAt":"2026-01-01T00:00:00.000000Z",'
    '"lookups":1000000000,"failures":1000000000,"lastError":"",'
    '"nextLookupAt":"2026-01-01T00:00:00.000000Z",'
    '"cancelForwardedAt":"2026-01-01T00:00:00.000000Z","cancel":"",'
    '"cancelForwardedAs":"Suspend"}'
)
RESULT_BYTES = len(',"result":""') + MAX_RESULT_LENGTH
# An adjustment (returned and charged together cover each resource at most once) and a
# retry hold, each with its time and flags.
LATE_RECORDS_BYTES = 260
COUNTS_BYTES = 512  # claims per phase


def device_record_bytes(count: int) -> int:
    """The most a DeviceHold of `count` devices takes: node name and device names at their
    longest, quoted, with the keys."""
    return (
        len(',"devices":{"node":"","devices":[],"released":false}')
        + MAX_NAME_LENGTH
        + (count * (MAX_DEVICE_NAME_LENGTH + 3))
    )


def map_bytes(dimensions: Iterable[str]) -> int:
    """The most one resource map over `dimensions` can take: `"name":"quantity",` each."""
    return 2 + sum(len(name) + 4 + LONGEST_QUANTITY for name in dimensions)


# One slice of a Replenishing resource's window (issue 22), at its bounds.
WINDOW_SLICE_BYTES = LONGEST_QUANTITY + len(
    '{"start":"2026-01-01T00:00:00.000000Z","returnsAt":"2026-01-01T00:00:00.000000Z","amount":},'
)
CONTRACT_BYTES = len('"":"Replenishing",')


def base_bytes(dimensions: frozenset[str]) -> int:
    """Everything in the status but the entries, at its largest: the seven totals and the
    peak, the four summary strings, the counts, the conditions, every resource's contract
    and every Replenishing window at its most slices."""
    summary = 4 * (SUMMARY_LENGTH + 16)
    contracts = sum(len(name) + CONTRACT_BYTES for name in dimensions)
    windows = sum(len(name) + 6 + (WINDOW_SLICES + 1) * WINDOW_SLICE_BYTES for name in dimensions)
    return (
        8 * map_bytes(dimensions)
        + summary
        + COUNTS_BYTES
        + MAX_CONDITIONS * CONDITION_BYTES
        + contracts
        + windows
    )


def entry_bytes(entry: LedgerEntry) -> int:
    """Its size as etcd stores it: UTF-8 bytes, not characters (found by review)."""
    return ENTRY_KEY_BYTES + len(entry.model_dump_json(by_alias=True, exclude_none=True).encode())


def cut_bytes(text: str, limit: int) -> str:
    """`text` cut to at most `limit` UTF-8 bytes (and so characters), never mid-character:
    free texts the operator records are bounded in bytes, as the budget counts them."""
    return text.encode()[:limit].decode(errors="ignore")


def projected_bytes(entry: LedgerEntry, dimensions: frozenset[str]) -> int:
    """The most this entry can ever take: its size now plus all it can still gain."""
    size = entry_bytes(entry)
    devices = sum(int(n) for name, n in entry.reserved.items() if name in DEVICE_CLASSES)
    if devices and (entry.devices is None or not entry.devices.released):
        # The devices it may still record (or record again, placed elsewhere), at their
        # longest, plus the hand-off and release marks (found by review).
        size += device_record_bytes(devices) + DEVICES_RELEASED_BYTES
    reserved = map_bytes(entry.reserved)
    # History, provider lookups, a result, an adjustment and a retry hold: all it can gain.
    records = (
        (MAX_TRANSITIONS - len(entry.history)) * TRANSITION_BYTES
        + (PROVIDER_BYTES if entry.provider is None else 2 * MAX_ERROR_LENGTH)
        + (RESULT_BYTES if entry.result is None else 0)
        + (2 * reserved + LATE_RECORDS_BYTES if entry.adjustment is None else 0)
    )
    if entry.settlement is not None:
        # a late report replaces the baseline's usage
        return size + map_bytes(dimensions) + records
    # Settlement adds consumed, released and a Reusable resource's occupancy; the end of
    # its work, the Reusable part returned early (issue 22).
    return size + 5 * reserved + 3 * map_bytes(dimensions) + GROWING_SCALARS_BYTES + records


def child_line_bytes(dimensions: Iterable[str]) -> int:
    """The most one child line takes: its key, names, times, reason and three maps."""
    return 48 + MAX_NAME_LENGTH + 63 + 3 * map_bytes(dimensions) + 400


def parent_record_bytes(dimensions: Iterable[str]) -> int:
    """The most an envelope's `status.parent` takes: names, times, what it was reserved,
    its class and grant, and its settled line."""
    names = MAX_NAME_LENGTH + 64 + 63 + 200  # parent's name and UID, class, keys and times
    return names + 2 * map_bytes(dimensions) + child_line_bytes(dimensions)


def tree_bytes(dimensions: frozenset[str]) -> int:
    """Reserved up front in every envelope's budget: its child lines, its loans out and in,
    where it draws from, and what it wants, all at their largest. Budgets nest at a fixed
    cost, so nothing a tree does can push a ledger past etcd's limit."""
    loans = 2 * MAX_LOANS * (48 + MAX_NAME_LENGTH + 4 * map_bytes(dimensions) + 300)
    parent = parent_record_bytes(dimensions)
    wants = map_bytes(dimensions) + 128
    lines = MAX_ENVELOPE_CHILDREN * child_line_bytes(dimensions)
    return lines + loans + parent + wants + PREEMPTION_RECORD_BYTES


def pool_lines(dimensions: frozenset[str]) -> int:
    """How many lines a pool may have in flight: MAX_CHILDREN, fewer when its resources'
    names are so long that that many would not fit in the budget."""
    requests = MAX_PREEMPTIONS * PREEMPTION_REQUEST_BYTES
    shares = MAX_POOL_NAMESPACES * (63 + map_bytes(dimensions) + SHARE_SCALARS_BYTES)
    room = LEDGER_BYTES_BUDGET - base_bytes(dimensions) - requests - shares
    return max(2, min(MAX_CHILDREN, room // child_line_bytes(dimensions)))


def ledger_bytes(entries: Iterable[LedgerEntry], dimensions: frozenset[str]) -> int:
    """The most the ledger's status can ever take with these entries."""
    return (
        base_bytes(dimensions)
        + tree_bytes(dimensions)
        + sum(projected_bytes(e, dimensions) for e in entries)
    )


def status_bytes(status: ReservationEnvelopeStatus) -> int:
    """What the status takes now, as written."""
    return len(status.model_dump_json(by_alias=True, exclude_none=True).encode())
