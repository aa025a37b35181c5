"""Score arithmetic shared by the evaluations: floor-normalized retention and bootstrap intervals."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

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


def mean_and_ci(values: Sequence[float] | np.ndarray, num_bootstrap: int = 1000, seed: int = 0) -> dict[str, Any]:
    """`{"mean", "ci"}` of per-item values; `ci` is the 95% percentile bootstrap interval of the mean over items."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        raise ValueError("no per-item values to summarise: the evaluation needs at least one item")
    return {
        "mean": float(values.mean()),
        "ci": bootstrap_ci(lambda idx: float(values[idx].mean()), len(values), num_bootstrap, seed),
    }


def retention_over_items(
    own: Sequence[float] | np.ndarray,
    transfer: Sequence[float] | np.ndarray | None,
    no_context: Sequence[float] | np.ndarray,
    *,
    higher_is_better: bool = True,
    num_bootstrap: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """Floor-normalized retention of per-item scores, with a bootstrap interval paired over items.

    `retention = (mean(transfer) - mean(no_context)) / (mean(own) - mean(no_context))` (for losses, where lower is
    better: `(no_context - transfer) / (no_context - own)`): 1 = the transfer is worth as much as the target's own
    prefill, 0 = no better than no context at all. Each bootstrap resample draws items, keeping an item's three
    scores together, so the interval reflects the paired design.

    Args:
        own, transfer, no_context: one score per item each (same items, same order); `transfer` may be None
            (only the target was measured).
        higher_is_better: False for losses (NLL).

    Returns:
        `retention` (None when undefined), `retention_ci` ([low, high] or None), `retention_undefined` (None, or
        why there is no retention: no transfer, or the context is worth nothing to the target here),
        `context_gain` (`{"mean", "ci"}` of own over no context, in the direction "better"), and
        `transfer_minus_own` (`{"mean", "ci"}`, raw units) when `transfer` is given.
    """
    sign = 1.0 if higher_is_better else -1.0
    own, no_context = np.asarray(own, dtype=np.float64), np.asarray(no_context, dtype=np.float64)
    arrays = [own, no_context] + ([np.asarray(transfer, dtype=np.float64)] if transfer is not None else [])
    if len({a.shape for a in arrays}) != 1 or own.ndim != 1 or own.size == 0:
        raise ValueError(f"own, transfer and no_context need one score per item each, got shapes {[a.shape for a in arrays]}")
    gain = sign * (own.mean() - no_context.mean())
    out: dict[str, Any] = {
        "retention": None,
        "retention_ci": None,
        "retention_undefined": None,
        "context_gain": mean_and_ci(sign * (own - no_context), num_bootstrap, seed),
    }
    if transfer is None:
        out["retention_undefined"] = "no transfer measured (no source and mapper given)"
        return out
    transfer = arrays[2]
    out["transfer_minus_own"] = mean_and_ci(transfer - own, num_bootstrap, seed)
    if not gain > 0:
        # A ratio over a gain of ~0 is noise (or infinite): say so instead of reporting it.
        out["retention_undefined"] = (
            f"the context is worth nothing to the target on these items (own {own.mean():.4g} vs no context "
            f"{no_context.mean():.4g}): retention is undefined"
        )
        logger.warning("%s; use items the target can solve from its context, or a model that reads it", out["retention_undefined"])
        return out

    def stat(idx: np.ndarray) -> float:
        return normalized_retention(sign * transfer[idx].mean(), sign * own[idx].mean(), sign * no_context[idx].mean())

    out["retention"] = stat(np.arange(own.size))
    out["retention_ci"] = bootstrap_ci(stat, own.size, num_bootstrap, seed)
    return out


def gap_recovered_over_items(
    own: Sequence[float] | np.ndarray,
    transfer: Sequence[float] | np.ndarray,
    source_alone: Sequence[float] | np.ndarray,
    *,
    num_bootstrap: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """The share of the source-to-target gap a transfer recovers, with a bootstrap interval paired over items.

    `gap_recovered = (mean(transfer) - mean(source_alone)) / (mean(own) - mean(source_alone))`: 1 = the target
    answers after the transfer as well as after its own prefill, 0 = no better than the source answering itself
    (the switch bought nothing). Retention's floor is the target without the context; this one's floor is the
    source, so a transfer can keep most of the content and still recover little of what the larger model adds.

    Returns:
        `gap_recovered` and `gap_recovered_ci` (None when undefined), `gap_undefined` (None, or why: the target is
        no better than the source on these items), and `target_minus_source` (`{"mean", "ci"}`, raw units).
    """
    own, transfer, alone = (np.asarray(x, dtype=np.float64) for x in (own, transfer, source_alone))
    if len({a.shape for a in (own, transfer, alone)}) != 1 or own.ndim != 1 or own.size == 0:
        raise ValueError(f"own, transfer and source_alone need one score per item each, got shapes "
                         f"{[a.shape for a in (own, transfer, alone)]}")  # fmt: skip
    out: dict[str, Any] = {"gap_recovered": None, "gap_recovered_ci": None, "gap_undefined": None,
                           "target_minus_source": mean_and_ci(own - alone, num_bootstrap, seed)}  # fmt: skip
    if not own.mean() > alone.mean():
        out["gap_undefined"] = (f"the target is no better than the source alone on these items (own {own.mean():.4g} "
                                f"vs source {alone.mean():.4g}): there is no gap to recover")  # fmt: skip
        return out

    def stat(idx: np.ndarray) -> float:
        return normalized_retention(transfer[idx].mean(), own[idx].mean(), alone[idx].mean())

    out["gap_recovered"] = stat(np.arange(own.size))
    out["gap_recovered_ci"] = bootstrap_ci(stat, own.size, num_bootstrap, seed)
    return out


def retention_difference(
    own: Sequence[float] | np.ndarray,
    no_context: Sequence[float] | np.ndarray,
    transfer: Sequence[float] | np.ndarray,
    reference: Sequence[float] | np.ndarray | None,
    *,
    higher_is_better: bool = True,
    num_bootstrap: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """Floor-normalized retention of `transfer` minus that of `reference` on the same items, with a paired
    bootstrap interval (each resample draws items, keeping all four scores of an item together).

    `reference` None is the target's own prefill (retention 1 by construction). Returns `difference` and
    `difference_ci` ([low, high]); both None when the context is worth nothing to the target on these items.
    """
    own, no_context, transfer = (np.asarray(x, dtype=np.float64) for x in (own, no_context, transfer))
    ref = np.asarray(reference, dtype=np.float64) if reference is not None else None
    sign = 1.0 if higher_is_better else -1.0

    def stat(idx: np.ndarray) -> float:
        o, f = sign * own[idx].mean(), sign * no_context[idx].mean()
        base = 1.0 if ref is None else normalized_retention(sign * ref[idx].mean(), o, f)
        return normalized_retention(sign * transfer[idx].mean(), o, f) - base

    if not sign * (own.mean() - no_context.mean()) > 0:
        return {"difference": None, "difference_ci": None}
    return {"difference": stat(np.arange(own.size)), "difference_ci": bootstrap_ci(stat, own.size, num_bootstrap, seed)}


def sign_test_min_wins(rounds: int, level: float = 0.05) -> int | None:
    """The fewest of `rounds` paired rounds one candidate must win for its lead to be real at `level` (two-sided
    sign test: under no difference each round is a coin toss); None when no count is enough."""
    for wins in range(rounds // 2 + 1, rounds + 1):
        if 2 * sum(math.comb(rounds, k) for k in range(wins, rounds + 1)) / 2**rounds <= level:
            return wins
    return None


__all__ = [
    "REFEED_WARNING", "bootstrap_ci", "gap_recovered_over_items", "mean_and_ci", "normalized_retention", "retention_difference", "retention_over_items",
    "sign_test_min_wins",
]
