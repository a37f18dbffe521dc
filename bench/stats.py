"""Small statistics shared by the scenarios: percentiles, overlaps, FIFO inversions.

Why here: every scenario summarises latencies the same way (nearest-rank percentiles --
an observed value, never an interpolation -- in milliseconds), and the exclusion and
order checks must mean the same thing wherever they are reported.
"""

from __future__ import annotations

from itertools import pairwise

from .lock_bench import percentile


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def summary(values: list[float], prefix: str = "") -> dict[str, float | None]:
    """p50/p99/max/mean of ``values`` (seconds), in ms, keys prefixed with ``prefix``."""
    if not values:
        return {f"{prefix}p50_ms": None, f"{prefix}p99_ms": None, f"{prefix}max_ms": None, f"{prefix}mean_ms": None}
    return {
        f"{prefix}p50_ms": ms(percentile(values, 50)),
        f"{prefix}p99_ms": ms(percentile(values, 99)),
        f"{prefix}max_ms": ms(max(values)),
        f"{prefix}mean_ms": ms(sum(values) / len(values)),
    }


def overlaps(intervals: list[tuple[float, float]]) -> int:
    """How many intervals (sorted by start) began before the previous one ended.

    For a mutex every such case is a violation of exclusion.
    """
    ordered = sorted(intervals)
    return sum(1 for prev, cur in pairwise(ordered) if cur[0] < prev[1])


def inverted(order_keys: list) -> int:
    """In acquisition order, how many contenders acquired before one that joined earlier.

    ``order_keys[i]`` is the queue-join order (e.g. the fencing token) of the i-th holder.
    A holder counts once if any later holder has a smaller key -- it overtook someone.
    For a FIFO lock the result is 0.
    """
    count = 0
    smallest_later = None
    for key in reversed(order_keys):
        if smallest_later is not None and key > smallest_later:
            count += 1
        smallest_later = key if smallest_later is None else min(smallest_later, key)
    return count
