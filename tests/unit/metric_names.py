"""The metric names the operator declares, the ones a PromQL expression uses, and promtool.

Shared by the tests of the alert rules and of the Grafana dashboard: both may only query
series that `reservoir.metrics` can expose, so a renamed metric fails a test instead of
silently emptying a panel or disabling an alert. Both check their PromQL with `promtool`,
which `make tools` builds into the control plane's cache; without it they fail, not skip.
"""

from __future__ import annotations

import importlib
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from tests.tools import tool

REPO = Path(__file__).resolve().parents[2]

# Names of the series a family of each type exposes, after its base name.
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}

# A metric name in PromQL that belongs to Reservoir (functions, labels and keywords never
# start with the prefix). Names inside label values are not used by the rules or panels.
_REFERENCE = re.compile(r"(?<![A-Za-z0-9_:])reservoir_[A-Za-z0-9_:]*")


def _series_names(families: Iterable[Metric]) -> set[str]:
    names: set[str] = set()
    for family in families:
        # A counter's or histogram's family name is no series of its own.
        suffixes = _SUFFIXES.get(family.type, ("",))
        names.update(family.name + suffix for suffix in suffixes)
        names.update(sample.name for sample in family.samples)
    return names


def declared_metric_names() -> set[str]:
    """Every series name that importing `reservoir.metrics` registers, suffixes included."""
    module = importlib.import_module("reservoir.metrics")
    registries = [REGISTRY]
    families: list[Metric] = []
    for value in vars(module).values():
        if isinstance(value, CollectorRegistry) and value is not REGISTRY:
            registries.append(value)
        elif isinstance(value, MetricWrapperBase):
            families += value.describe()
    for registry in registries:
        # Collectors yield their families even before they have samples.
        families += registry.collect()
    return _series_names(families)


def referenced_metric_names(expression: str) -> set[str]:
    """The reservoir_* metric names a PromQL expression selects."""
    return set(_REFERENCE.findall(expression))


def promtool(*args: str, cwd: Path = REPO) -> str:
    """Run promtool, failing the test (with its output) unless it exits 0."""
    result = subprocess.run(
        [str(tool("promtool")), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, (
        f"promtool {' '.join(args)} exited {result.returncode}:\n{output}"
    )
    return output
