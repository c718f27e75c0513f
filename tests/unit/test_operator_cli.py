"""`reservoir-operator` as a user meets it: --help, --version, and failing fast and clearly
when there is nothing to log in with."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from reservoir import __version__
from reservoir.cli.operator import parse, peering_priority
from reservoir.endpoints import Health

OPERATOR = Path(sys.executable).parent / "reservoir-operator"


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(OPERATOR), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_version_prints_the_package_version() -> None:
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"reservoir-operator {__version__}"


def test_help_lists_every_flag_with_its_default() -> None:
    text = " ".join(run("--help").stdout.split())
    for flag, default in {
        "--namespace": "[]",
        "--metrics-port": "8080",
        "--metrics-auth": "none",
        "--liveness": "None",
        "--peering": "None",
        "--priority": "None",
        "--verbose": "False",
        "--placeholder-priority-class": "reservoir-placeholder",
        "--all-namespaces": "False",
        "--transition-events": "exceptions",
        "--queue-reason-after": "10",
        "--provider-allow": "[]",
        "--provider-max-in-flight": "32",
        "--provider-max-in-flight-per-namespace": "4",
        "--provider-calls-per-second-per-namespace": "2.0",
        "--provider-burst-per-namespace": "10",
        "--restrict-placement": "False",
        "--allowed-toleration-key": "[]",
        "--allowed-node-label-key": "[]",
    }.items():
        assert flag in text
        after = text[text.index(flag) :]
        assert f"(default: {default})" in after, flag


BROKEN_KUBECONFIGS = {
    "missing": (None, "no Kubernetes credentials"),
    "no-context": (
        "apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n",
        "no Kubernetes credentials",
    ),
    "empty-file": ("", "unusable kubeconfig"),
    "malformed": ("a: [b\n", "unusable kubeconfig"),
    "context-names-a-missing-cluster": (
        "apiVersion: v1\nkind: Config\nclusters: []\nusers: []\ncontexts:\n- name: x\n"
        "  context: {cluster: nope, user: nope}\ncurrent-context: x\n",
        "missing entry 'nope'",
    ),
    "certificate-files-missing": (
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: "
        "'https://127.0.0.1:1', certificate-authority: /nonexistent/ca.crt}\nusers:\n"
        "- name: u\n  user: {client-certificate: /nonexistent/c.crt, client-key: "
        "/nonexistent/c.key}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\n"
        "current-context: x\n",
        "missing file(s) /nonexistent/ca.crt",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_KUBECONFIGS))
def test_without_usable_credentials_it_exits_at_once_with_one_line(
    tmp_path: Path, case: str
) -> None:
    content, expected = BROKEN_KUBECONFIGS[case]
    path = tmp_path / "kubeconfig"
    if content is not None:
        path.write_text(content)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(path)}
    result = run("--metrics-port", "0", env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("reservoir-operator: ") and expected in lines[0]
    assert str(path) in lines[0]


def test_the_provider_allow_list_is_checked_at_start_and_reaches_the_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from reservoir.cli.operator import allowed_entries
    from reservoir.k8s.provider_http import ProviderSettings

    bad = run("--provider-allow", "10.0.0.0/33")
    assert bad.returncode == 2 and "--provider-allow: '10.0.0.0/33' is not" in bad.stderr
    assert run("--provider-max-in-flight", "0").returncode == 2
    args = parse(["--provider-allow", "a.example, *.b.example", "--provider-allow", "10.1.0.0/16"])
    entries = allowed_entries(args.provider_allow)
    assert entries == ["a.example", "*.b.example", "10.1.0.0/16"]
    monkeypatch.setenv("RESERVOIR_PROVIDER_ALLOW", ",".join(entries))
    monkeypatch.setenv("RESERVOIR_PROVIDER_MAX_IN_FLIGHT_PER_NAMESPACE", "2")
    settings = ProviderSettings.from_env()
    assert settings.allow.allows_name("a.example") and settings.allow.allows_name("x.b.example")
    assert not settings.allow.allows_name("b.example")
    assert settings.max_in_flight_per_namespace == 2 and settings.max_in_flight == 32
    monkeypatch.delenv("RESERVOIR_PROVIDER_ALLOW")
    assert not ProviderSettings.from_env().allow, "no flag: no HTTP provider at all"


USABLE_KUBECONFIG = (
    "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: "
    "'https://127.0.0.1:1', insecure-skip-tls-verify: true}\nusers:\n- name: u\n"
    "  user: {token: t}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\n"
    "current-context: x\n"
)


@pytest.mark.parametrize("endpoint", ["metrics", "liveness"])
def test_a_port_already_taken_stops_it_at_once_with_one_line(tmp_path: Path, endpoint: str) -> None:
    """Not a start-up retried every minute with a traceback (issue 21): exit 2, one line."""
    path = tmp_path / "kubeconfig"
    path.write_text(USABLE_KUBECONFIG)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(path)}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        if endpoint == "metrics":
            flags = ["--metrics-port", str(port)]
        else:
            flags = ["--metrics-port", "0", "--liveness", f"http://127.0.0.1:{port}/healthz"]
        try:
            result = run(*flags, env=env, timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 30 s after its {endpoint} port was found taken")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("reservoir-operator: cannot serve ")
    assert f"on port {port}: Address already in use" in lines[0]


def test_peering_replicas_get_distinct_random_priorities_unless_one_is_given() -> None:
    args = parse(["--peering", "reservoir"])
    chosen = {peering_priority(args.peering, args.priority) for _ in range(20)}
    assert len(chosen) == 20 and min(chosen) > 0
    assert peering_priority("reservoir", 7) == 7
    assert peering_priority(None, None) == 0


def test_readiness_reflects_start_up_and_the_latest_reconcile() -> None:
    health = Health()
    assert health.problem() == "starting"
    health.started = True
    assert health.problem() is None
    health.failed("ConnectError: refused")
    assert health.problem() is not None and "ConnectError" in health.problem()  # type: ignore[operator]
    health.succeeded()
    assert health.problem() is None


def test_the_placement_allow_list_reaches_the_device_holder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chart's --restrict-placement and keys become the allow-list the operator checks
    before it copies hints onto a placeholder; without the flag, none (hints copied)."""
    import json

    from reservoir.services import placement_allow_list

    args = parse(
        [
            "--restrict-placement",
            "--allowed-toleration-key=nvidia.com/gpu",
            "--allowed-node-label-key=kubernetes.io/hostname",
            "--allowed-node-label-key=zone",
        ]
    )
    assert args.restrict_placement
    given = {
        "tolerationKeys": args.allowed_toleration_key,
        "nodeLabelKeys": args.allowed_node_label_key,
    }
    monkeypatch.setenv("RESERVOIR_PLACEMENT_ALLOWED", json.dumps(given))
    allowed = placement_allow_list()
    assert allowed is not None
    assert allowed.toleration_keys == {"nvidia.com/gpu"}
    assert allowed.node_label_keys == {"kubernetes.io/hostname", "zone"}
    monkeypatch.delenv("RESERVOIR_PLACEMENT_ALLOWED")
    assert placement_allow_list() is None


def test_the_plugins_help_keeps_one_verb_a_line() -> None:
    """Issue 25's rough edge: argparse refolded the usage into one paragraph."""
    from reservoir.cli.plugin import parser

    shown = parser().format_help()
    for verb in ("hold", "dispatch|cancel|renew|get", "usage", "finish", "ledger", "recommend"):
        assert any(
            line.strip().startswith(f"kubectl reservoir {verb}") for line in shown.splitlines()
        ), verb
