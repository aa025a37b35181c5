"""How much memory a fit's statistics may take: one rule for both kinds of sums the calibration pass collects, read by
the fit and by `plan` alike.

- The K/V sums (`accumulate.py`) live on the statistics device; past their budget the pass switches to two-stage
  statistics (the blocks of the top-k source layers only).
- The residual input's sums (`residual_stats.py`) live on the CPU; their budget decides how many residual layers the
  fit searches, and whether the sums also hold the source's K/V.

`fit --max-statistics-memory GIB` is one total: the K/V sums take what they need first (two-stage past the budget),
and the residual sums what the K/V sums leave of it where both live in the same memory (the CPU; `after_kv`); with the
K/V sums on a GPU each memory has the whole budget. Without it the K/V sums may take half the free memory where they
live, and the residual sums `RESIDUAL_STATISTICS_BYTES`: each residual layer adds to every token of the calibration pass
a product as wide as its features, so their default stays fixed rather than growing with the machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the fit's config validates its budget with `budget_bytes` and imports no torch
    import torch

# The residual-input sums' default budget (float64, on the CPU): for the bundled families a few MiB per residual layer;
# for a billion-parameter pair a few GiB per layer without the source's K/V, tens of GiB with them.
RESIDUAL_STATISTICS_BYTES = 4 * 2**30


def available_memory(device: torch.device) -> int:
    """Free bytes where statistics would live (GPU free memory, or available RAM)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class StatisticsBudget:
    """Bytes each kind of the fit's sums may take; `given`: set by `max_statistics_memory` (else the defaults)."""

    kv_bytes: int
    residual_bytes: int
    given: bool
    free_bytes: int | None = None  # the free memory the K/V budget was taken from (None: not read)
    kv_taken: int | None = None  # what the K/V sums took of a given budget both kinds share (`after_kv`)

    def after_kv(self, kv_bytes: int, kv_device: torch.device | str) -> StatisticsBudget:
        """The budget the residual sums have once the K/V sums take `kv_bytes` on `kv_device`: what they leave of a
        given budget where both live in the CPU's memory; else unchanged (each memory its own budget, or the
        defaults)."""
        if not self.given or str(kv_device).split(":")[0] != "cpu":
            return self
        return replace(self, residual_bytes=max(self.kv_bytes - kv_bytes, 0), kv_taken=kv_bytes)

    def two_stage(self, full_bytes: int) -> bool:
        """Whether K/V sums of `full_bytes` (every set: fit and held-out) switch to two-stage statistics."""
        return full_bytes > self.kv_bytes

    def origin(self, kind: str) -> str:
        """Where the budget of `kind` ("kv" or "residual") comes from, and how to change it."""
        if self.given and kind == "residual" and self.kv_taken is not None:
            return f"what the K/V sums' {_size(self.kv_taken)} leave of --max-statistics-memory {_size(self.kv_bytes)}"
        if self.given:
            return "--max-statistics-memory"
        if kind == "kv":
            return "half the free memory; --max-statistics-memory sets it"
        return "the default; --max-statistics-memory raises it"

    def describe(self, kind: str) -> str:
        """'the budget of 4 GiB (the default; ...)': the budget of `kind` and where it comes from."""
        return f"the budget of {_size(self.kv_bytes if kind == 'kv' else self.residual_bytes)} ({self.origin(kind)})"


def statistics_budget(max_statistics_memory: float | None, free_bytes: int | None = None,
                      device: torch.device | str = "cpu") -> StatisticsBudget:  # fmt: skip
    """The fit's statistics budget: `max_statistics_memory` GiB for both kinds of sums together when given (the
    residual sums' share: `after_kv`); else half of
    `free_bytes` (default: `available_memory(device)`, where the K/V sums live) for the K/V sums and
    `RESIDUAL_STATISTICS_BYTES` for the residual sums."""
    if max_statistics_memory is not None:
        given = budget_bytes(max_statistics_memory)
        return StatisticsBudget(given, given, True, free_bytes)
    if free_bytes is None:
        import torch

        free_bytes = available_memory(torch.device(device))
    return StatisticsBudget(int(free_bytes) // 2, RESIDUAL_STATISTICS_BYTES, False, int(free_bytes))


def budget_bytes(max_statistics_memory: float) -> int:
    """`max_statistics_memory` GiB in bytes; a budget must be > 0."""
    if not max_statistics_memory > 0:
        raise ValueError(f"max_statistics_memory must be > 0 GiB, got {max_statistics_memory}")
    return int(max_statistics_memory * 2**30)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.3g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


__all__ = ["RESIDUAL_STATISTICS_BYTES", "StatisticsBudget", "available_memory", "budget_bytes", "statistics_budget"]
