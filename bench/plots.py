"""The benchmark's figures as PNGs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt


def _cdf(axis: plt.Axes, label: str, seconds: Sequence[float]) -> None:
    if not seconds:
        return
    ordered = sorted(value * 1000 for value in seconds)
    fractions = [(index + 1) / len(ordered) for index in range(len(ordered))]
    axis.step(ordered, fractions, where="post", label=f"{label} (n={len(ordered)})")


def _rate(axis: plt.Axes, label: str, ends: Sequence[float], origin: float, bin_s: float) -> None:
    if not ends:
        return
    last = max(ends) - origin
    bins = max(1, int(last / bin_s) + 1)
    counts = [0] * bins
    for end in ends:
        counts[min(bins - 1, int((end - origin) / bin_s))] += 1
    axis.plot(
        [bin_s * (index + 0.5) for index in range(bins)],
        [count / bin_s for count in counts],
        label=label,
    )


def latency_and_rate(
    path: Path,
    title: str,
    latencies: Mapping[str, Sequence[float]],
    completions: Mapping[str, tuple[Sequence[float], float]],
    extra: Mapping[str, Sequence[tuple[float, float]]] | None = None,
) -> None:
    """Left: latency CDFs (seconds in, milliseconds shown, log scale). Right: completions
    per second over time, for each run ({label: (end times, start time)}). `extra`: more
    time series ({label: [(t, value)]}) on a third panel."""
    panels = 3 if extra else 2
    figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    left, right = axes[0], axes[1]
    for label, values in latencies.items():
        _cdf(left, label, values)
    left.set_xscale("log")
    left.set_xlabel("latency (ms, log)")
    left.set_ylabel("fraction of claims")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    left.set_title("latency CDF")
    for label, (ends, origin) in completions.items():
        span = (max(ends) - origin) if ends else 1.0
        _rate(right, label, ends, origin, max(1.0, span / 60))
    right.set_xlabel("time since start (s)")
    right.set_ylabel("completed per second")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8)
    right.set_title("throughput over time")
    if extra:
        third = axes[2]
        for label, series in extra.items():
            if series:
                third.plot([t for t, _ in series], [v for _, v in series], label=label)
        third.set_xlabel("time since start (s)")
        third.grid(True, alpha=0.3)
        third.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def bars(path: Path, title: str, groups: Mapping[str, Mapping[str, float]], ylabel: str) -> None:
    """Grouped horizontal bars: {group: {label: value}} (e.g. requests per claim by verb
    and resource, per user)."""
    labels = sorted({label for values in groups.values() for label in values})
    if not labels:
        labels = ["(none)"]
    figure, axis = plt.subplots(figsize=(10, max(3.0, 0.35 * len(labels) * max(1, len(groups)))))
    height = 0.8 / max(1, len(groups))
    for index, (group, values) in enumerate(groups.items()):
        axis.barh(
            [position + index * height for position in range(len(labels))],
            [values.get(label, 0.0) for label in labels],
            height=height,
            label=group,
        )
    axis.set_yticks([position + height * (len(groups) - 1) / 2 for position in range(len(labels))])
    axis.set_yticklabels(labels, fontsize=8)
    axis.set_xlabel(ylabel)
    axis.grid(True, axis="x", alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def series(
    path: Path, title: str, lines: Mapping[str, Sequence[tuple[float, float]]], ylabel: str
) -> None:
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for label, points in lines.items():
        if points:
            axis.plot([t for t, _ in points], [v for _, v in points], label=label)
    axis.set_xlabel("time since start (s)")
    axis.set_ylabel(ylabel)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
