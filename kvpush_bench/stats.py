"""Small statistics shared by the benchmark parts: every measure gets a median and a p90."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def pct(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation), or None without values."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def summary(values: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """{median, p90, min, max, n} of ``values``; None entries when there are none."""

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, digits)

    return {
        "median": r(pct(values, 50)),
        "p90": r(pct(values, 90)),
        "min": r(min(values)) if len(values) else None,
        "max": r(max(values)) if len(values) else None,
        "n": len(values),
    }


def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return round(a / b, digits)
