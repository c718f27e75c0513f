"""Client identities for the benchmarks: one kubeconfig per user, so that the API server's
audit log tells who made each request (the operator, Kueue, the load generator).

Each user gets a client certificate signed by the local cluster's CA, in the group
system:masters (the benchmarks measure speed and cost, not authorization)."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hack"))

from localcluster import sign_certificate  # noqa: E402


def user_kubeconfig(cluster_dir: Path, user: str) -> Path:
    """A kubeconfig for `user` (a certificate CN) next to the cluster's own, made once."""
    pki = cluster_dir / "pki"
    path = cluster_dir / f"kubeconfig-{user}"
    if not (pki / f"user-{user}.crt").exists():
        sign_certificate(
            pki, f"user-{user}", f"/O=system:masters/CN={user}", "extendedKeyUsage=clientAuth\n"
        )
    config = json.loads((cluster_dir / "kubeconfig").read_text())
    credentials = {
        "client-certificate-data": base64.b64encode((pki / f"user-{user}.crt").read_bytes()),
        "client-key-data": base64.b64encode((pki / f"user-{user}.key").read_bytes()),
    }
    config["users"] = [{"name": user, "user": {k: v.decode() for k, v in credentials.items()}}]
    for context in config["contexts"]:
        context["context"]["user"] = user
    path.write_text(json.dumps(config, indent=2))
    path.chmod(0o600)
    return path
