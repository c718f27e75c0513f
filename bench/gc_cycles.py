"""What cyclic garbage can pile up under a garbage-collector setting (reservoir.gc_tuning).

Each of 20,000 requests fails, and its exception is kept with its traceback: a reference
cycle (exception → traceback → frame → the exception) holding the frame's 20 KB body, which
only the cyclic collector frees. Prints the process's peak resident memory for each young
threshold given, each in a fresh interpreter:

    .venv/bin/python bench/gc_cycles.py 700 10000 50000
"""

from __future__ import annotations

import gc
import resource
import subprocess
import sys

REQUESTS = 20_000
BODY_BYTES = 20_000


def fail(body: bytes) -> None:
    raise ValueError(f"refused a body of {len(body)} bytes")


def request() -> None:
    body = b"x" * BODY_BYTES
    try:
        fail(body)
    except ValueError as error:
        kept = error  # noqa: F841 (kept: the exception -> traceback -> this frame -> kept)


def peak_mib(young: int) -> int:
    """In this process: the collector set as the operator sets it, with `young`."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(young, 20, 20)
    for _ in range(REQUESTS):
        request()
        _ = [{} for _ in range(3)]  # ordinary container turnover between requests
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(peak_mib(int(sys.argv[2])))
        return
    for young in sys.argv[1:] or ["700", "10000", "50000"]:
        out = subprocess.run(
            [sys.executable, __file__, "--one", young], check=True, capture_output=True, text=True
        )
        print(f"young threshold {int(young):>6}: {out.stdout.strip()} MiB peak")


if __name__ == "__main__":
    main()
