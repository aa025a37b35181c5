"""Timing: warm up, then time calls with CUDA synchronised only on CUDA; medians in milliseconds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads on first use: the CLI reads the default lengths below to build `--help`
    import torch

# The context lengths `bench` times by default and with --quick.
DEFAULT_SEQ_LENS = (256, 512, 1024, 2048, 4096, 8192)
QUICK_SEQ_LENS = (256, 1024, 4096, 8192)


def synchronize(device: torch.device | str) -> None:
    """Wait for queued CUDA work on `device` (a no-op elsewhere)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(
    fn: Callable[[], Any], device: torch.device | str = "cpu", repeats: int = 5, warmup: int = 1
) -> tuple[list[float], list[float]]:
    """Wall-clock and process CPU seconds per call of `fn`, after `warmup` untimed calls.

    CUDA is synchronised only on CUDA. The CPU time (all threads of this process) is the steadier figure on a
    shared machine, where wall time includes waiting for a core; on CUDA it is only the host's share.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        synchronize(device)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return wall, cpu


def median_ms(times: Sequence[float]) -> float:
    """Median of times in seconds, in milliseconds."""
    return 1e3 * statistics.median(times)


__all__ = ["DEFAULT_SEQ_LENS", "QUICK_SEQ_LENS", "median_ms", "synchronize", "time_call"]
