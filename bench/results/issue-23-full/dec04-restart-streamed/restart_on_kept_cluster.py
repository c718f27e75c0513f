"""A restart on a cluster the scale scenario left running (`--keep-cluster`): start one
operator (of the repository given) as the scenario does, create one claim at once, and
report when the claims' initial state was complete (/metrics), the operator's first
envelope status write (audit log), the new claim Tentative, its RSS 15 s later, and the
ERROR lines of its log.

    .venv/bin/python restart_on_kept_cluster.py REPO NAMESPACE LABEL [CLUSTER_DIR]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

from reservoir.sdk import Reservoir

CLAIMS = 'resource="branchclaims.reservoir.dev"'
WRITE = (b'"verb":"patch"', b'"verb":"update"')


def metric(port: int, series: str) -> float:
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        text = urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def first_envelope_write(audit: Path, offset: int) -> float | None:
    """Epoch seconds of the operator's first envelope status write past `offset`."""
    with audit.open("rb") as log:
        log.seek(offset)
        for line in log:
            if (
                b'"username":"reservoir-operator"' in line
                and b'"reservationenvelopes"' in line
                and b'"subresource":"status"' in line
                and any(verb in line for verb in WRITE)
            ):
                stamp = json.loads(line)["requestReceivedTimestamp"].replace("Z", "+00:00")
                return datetime.fromisoformat(stamp).timestamp()
    return None


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def main() -> None:
    repo, namespace, label = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    cluster = Path(sys.argv[4] if len(sys.argv) > 4 else "/work/wt-bench/.cluster/bench")
    sys.path.insert(0, str(repo / "hack"))
    from localcluster import free_port  # the repository's own

    audit = cluster / "logs" / "audit.log"
    log = cluster / "logs" / f"operator-{label}.log"
    port = free_port()
    offset = audit.stat().st_size
    env = {**os.environ, "KUBECONFIG": str(cluster / "kubeconfig-reservoir-operator")}
    command = [str(repo / ".venv/bin/reservoir-operator"), "-n", namespace]
    started = time.time()
    with log.open("ab") as out:
        operator = subprocess.Popen(
            [*command, "--metrics-port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    sdk = Reservoir(namespace=namespace, kubeconfig=str(cluster / "kubeconfig"))
    name = f"after-{label}"
    sdk.hold("fresh", name, {"tokens": "10"}, name=name)
    listed = written = tentative = None
    while time.time() - started < 400 and None in (listed, written, tentative):
        time.sleep(0.25)
        if listed is None and any(
            metric(port, f'reservoir_watch_initial_states_total{{how="{how}",{CLAIMS}}}')
            for how in ("streamed", "listed")
        ):
            listed = time.time() - started
        if tentative is None and str(sdk.get(name).status.phase).endswith("Tentative"):
            tentative = time.time() - started
        if written is None:
            at = first_envelope_write(audit, offset)
            written = None if at is None else at - started
    time.sleep(15)
    print(
        f"{label}: claims listed {listed}, first envelope write {written}, "
        f"new claim Tentative {tentative}, RSS {rss_mib(operator.pid):.0f} MiB (15 s later)"
    )
    operator.terminate()
    operator.wait(30)
    lines = log.read_text().splitlines()
    print("ERROR lines:", sum(" ERROR " in line for line in lines))
    sdk.close()


if __name__ == "__main__":
    main()
