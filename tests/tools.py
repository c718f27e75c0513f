"""Where the tests find the real tools `make tools` builds (promtool, helm, kubectl, ...)."""

from __future__ import annotations

import os
from pathlib import Path

BIN = (
    Path(os.environ.get("RESERVOIR_CACHE", Path.home() / ".cache" / "reservoir"))
    / "bin"
    / "current"
)


def tool(name: str) -> Path:
    """The built binary; a clear failure (never a skip) when it is missing."""
    path = BIN / name
    if not path.exists():
        raise AssertionError(f"{path} is missing: run `make tools` (hack/tools/build.sh)")
    return path
