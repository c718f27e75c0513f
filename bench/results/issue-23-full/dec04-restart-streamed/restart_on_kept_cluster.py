"""A restart experiment on the kept 100k bench cluster: start the operator (of the repo
given), create one claim at once (as the bench does), measure: claims' initial state
complete (metric), first envelope status write (audit log), the new claim Tentative, RSS."""
import json, os, subprocess, sys, time, urllib.request
from datetime import datetime
from pathlib import Path
repo = Path(sys.argv[1]); ns = sys.argv[2]; label = sys.argv[3]
cl = Path("/work/wt-bench/.cluster/bench")
audit = cl / "logs" / "audit.log"
sys.path.insert(0, str(repo / "hack"))
from localcluster import free_port
from reservoir.sdk import Reservoir
port = free_port()
log = cl / "logs" / f"operator-{label}.log"
offset = audit.stat().st_size
env = {**os.environ, "KUBECONFIG": str(cl / "kubeconfig-reservoir-operator")}
started = time.time()
proc = subprocess.Popen([str(repo / ".venv/bin/reservoir-operator"), "-n", ns, "--metrics-port", str(port)],
    env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
sdk = Reservoir(namespace=ns, kubeconfig=str(cl / "kubeconfig"))
name = f"after-{label}"
sdk.hold("fresh", name, {"tokens": "10"}, name=name)
first = listed = tentative = None
def rss():
    return int(open(f"/proc/{proc.pid}/status").read().split("VmRSS:")[1].split()[0]) / 1024
def metric(series):
    try:
        m = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except Exception:
        return 0.0
    for l in m.splitlines():
        if l.startswith(series + " "):
            return float(l.split()[-1])
    return 0.0
claims = 'resource="branchclaims.reservoir.dev"'
while time.time() - started < 400:
    time.sleep(0.25)
    if listed is None and (metric(f'reservoir_watch_initial_states_total{{how="streamed",{claims}}}') or metric(f'reservoir_watch_initial_states_total{{how="listed",{claims}}}')):
        listed = time.time() - started
    if tentative is None:
        phase = (sdk.get(name).status.phase if hasattr(sdk, "get") else None)
        if str(phase).endswith("Tentative"):
            tentative = time.time() - started
    if first is None:
        with audit.open("rb") as f:
            f.seek(offset)
            for line in f:
                if b'"username":"reservoir-operator"' in line and b'"reservationenvelopes"' in line and b'"subresource":"status"' in line and (b'"verb":"patch"' in line or b'"verb":"update"' in line):
                    e = json.loads(line)
                    t = datetime.fromisoformat(e["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
                    first = t - started; break
    if first is not None and tentative is not None and listed is not None:
        break
time.sleep(15)
print(f"{label}: claims listed {listed}, first envelope write {first}, new claim Tentative {tentative}, RSS {rss():.0f} MiB (15 s later)")
proc.terminate(); proc.wait(30)
text = log.read_text()
print("ERROR lines:", sum(1 for l in text.splitlines() if " ERROR " in l), "Traceback:", text.count("Traceback"))
sdk.close() if hasattr(sdk, "close") else None
