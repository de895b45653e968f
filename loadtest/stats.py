"""Summary statistics as bench_serving reports them (mean, median, p90, p99)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Summary:
    count: int
    mean: float
    median: float
    p90: float
    p99: float

    def scaled(self, factor: float) -> Summary:
        return Summary(
            self.count,
            self.mean * factor,
            self.median * factor,
            self.p90 * factor,
            self.p99 * factor,
        )

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), ``q`` in [0, 100]."""
    if not sorted_values:
        return math.nan
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return float(sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low))


def summarize(values: Sequence[float]) -> Summary:
    ordered = sorted(values)
    if not ordered:
        return Summary(0, math.nan, math.nan, math.nan, math.nan)
    return Summary(
        count=len(ordered),
        mean=sum(ordered) / len(ordered),
        median=percentile(ordered, 50),
        p90=percentile(ordered, 90),
        p99=percentile(ordered, 99),
    )


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan
