"""The core knows nothing of Kubernetes: no client, no kopf, no I/O libraries."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "operator" / "reservoir" / "core"
FORBIDDEN = (
    "kopf",
    "lightkube",
    "kubernetes",
    "kubernetes_asyncio",
    "httpx",
    "aiohttp",
    "requests",
    "socket",
    "subprocess",
    "reservoir.k8s",
    "reservoir.handlers",
    "reservoir.sdk",
)


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_core_imports_no_kubernetes_client_kopf_or_io() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert len(files) >= 8
    assert CORE / "model" / "common.py" in files  # the model package is checked too
    for path in files:
        bad = [n for n in imports(path) if n.split(".")[0] in FORBIDDEN or n in FORBIDDEN]
        bad += [n for n in imports(path) if any(n.startswith(f + ".") for f in FORBIDDEN)]
        assert not bad, f"{path.relative_to(CORE)} imports {bad}"


def test_the_core_uses_no_binary_floats() -> None:
    for path in sorted(CORE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        floats = [
            n.lineno
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, float)
        ]
        calls = [
            n.lineno
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "float"
        ]
        where = path.relative_to(CORE)
        assert not floats and not calls, f"{where}: floats at lines {floats + calls}"
