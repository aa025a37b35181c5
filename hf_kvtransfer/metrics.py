"""Score arithmetic shared by the evaluations: floor-normalized retention and bootstrap intervals."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

# TransferredCache warns when exactly as many tokens are fed as it transfers (the `generate` re-feed trap);
# evaluations feed new tokens on purpose (second half of a window, the next turn, the choices).
REFEED_WARNING = "the target is fed"


def normalized_retention(score: float, standalone: float, floor: float) -> float:
    """`(score - floor) / (standalone - floor)`: 1 = as good as the target's own prefill, 0 = no better than
    the floor. NaN when the context is worth nothing to the target (`standalone == floor`)."""
    gain = standalone - floor
    if gain == 0 or not math.isfinite(gain):
        return float("nan")
    return float((score - floor) / gain)


def bootstrap_ci(stat: Callable[[np.ndarray], float], num_rows: int, num_bootstrap: int, seed: int) -> list[float]:
    """95% percentile interval of `stat(row_indices)` over `num_bootstrap` resamples of the rows."""
    if num_bootstrap <= 0 or num_rows < 2:
        return [float("nan"), float("nan")]
    rng = np.random.default_rng(seed)
    values = np.array([stat(rng.integers(0, num_rows, num_rows)) for _ in range(num_bootstrap)])
    values = values[np.isfinite(values)]
    if values.size == 0:
        return [float("nan"), float("nan")]
    return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))]


__all__ = ["REFEED_WARNING", "bootstrap_ci", "normalized_retention"]
