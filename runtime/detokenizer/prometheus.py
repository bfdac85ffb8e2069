"""Counters, gauges and histograms rendered as Prometheus text exposition format 0.0.4.

Small on purpose: one process (the detokenizer) owns every series, so there is no registry, no
multiprocess mode and no dependency on prometheus_client.
"""
from __future__ import annotations

import bisect
import math
from typing import Iterable, Sequence

LabelValues = tuple[str, ...]


def format_value(x: float) -> str:
    """Go's float formatting as Prometheus writes it (+Inf, -Inf, NaN, else the shortest repr)."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    return "{" + ",".join(f'{n}="{_escape_label(v)}"' for n, v in zip(names, values)) + "}"


class _Family:
    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()):
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)

    def _check(self, labels: LabelValues) -> LabelValues:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {labels}")
        return tuple(str(v) for v in labels)

    def header(self, exposed_name: str) -> list[str]:
        return [f"# HELP {exposed_name} {_escape_help(self.documentation)}",
                f"# TYPE {exposed_name} {self.kind}"]


class Counter(_Family):
    """Monotonic total; exposed as `<name>_total` like prometheus_client does."""

    kind = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()):
        super().__init__(name, documentation, labelnames)
        self.values: dict[LabelValues, float] = {}

    def inc(self, labels: LabelValues = (), amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (inc by {amount})")
        key = self._check(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def render(self) -> list[str]:
        exposed = self.name + "_total"
        return self.header(exposed) + [f"{exposed}{_labels(self.labelnames, k)} {format_value(v)}"
                                       for k, v in self.values.items()]


class Gauge(_Family):
    kind = "gauge"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()):
        super().__init__(name, documentation, labelnames)
        self.values: dict[LabelValues, float] = {}

    def set(self, labels: LabelValues, value: float) -> None:
        self.values[self._check(labels)] = float(value)

    def render(self) -> list[str]:
        return self.header(self.name) + [f"{self.name}{_labels(self.labelnames, k)} {format_value(v)}"
                                         for k, v in self.values.items()]


class Histogram(_Family):
    """Cumulative buckets (`le` upper bounds, +Inf added), `_sum` and `_count` per label set."""

    kind = "histogram"

    def __init__(self, name: str, documentation: str, buckets: Iterable[float],
                 labelnames: Sequence[str] = ()):
        super().__init__(name, documentation, labelnames)
        self.bounds = sorted(float(b) for b in buckets)
        if not self.bounds or self.bounds[-1] != math.inf:
            self.bounds.append(math.inf)
        self.counts: dict[LabelValues, list[int]] = {}  # per bucket, not cumulative
        self.sums: dict[LabelValues, float] = {}

    def touch(self, labels: LabelValues) -> None:
        """Create the series with zero counts, so it is exposed before the first observation."""
        key = self._check(labels)
        self.counts.setdefault(key, [0] * len(self.bounds))
        self.sums.setdefault(key, 0.0)

    def observe(self, labels: LabelValues, value: float) -> None:
        key = self._check(labels)
        self.touch(key)
        self.counts[key][bisect.bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.sums[key] += value

    def render(self) -> list[str]:
        lines = self.header(self.name)
        names = self.labelnames + ("le",)
        for key, counts in self.counts.items():
            cumulative = 0
            for bound, n in zip(self.bounds, counts):
                cumulative += n
                lines.append(f"{self.name}_bucket{_labels(names, key + (format_value(bound),))} {cumulative}")
            lines.append(f"{self.name}_sum{_labels(self.labelnames, key)} {format_value(self.sums[key])}")
            lines.append(f"{self.name}_count{_labels(self.labelnames, key)} {cumulative}")
        return lines


def render(families: Iterable[_Family]) -> str:
    return "\n".join(line for family in families for line in family.render()) + "\n"
