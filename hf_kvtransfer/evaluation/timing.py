"""Timing: warm up, then time calls with CUDA synchronised only on CUDA; medians in milliseconds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads on first use: the CLI reads the default lengths below to build `--help`
    import torch
    from transformers import PreTrainedModel

    from ..core.mapper import KVMapper

# The context lengths `bench` times by default and with --quick.
DEFAULT_SEQ_LENS = (256, 512, 1024, 2048, 4096, 8192)
QUICK_SEQ_LENS = (512, 1024, 4096, 8192)


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


def time_to_first_token(
    source: PreTrainedModel,
    target: PreTrainedModel,
    mapper: KVMapper,
    input_ids: torch.Tensor,
    *,
    num_recompute_tokens: int | None = None,
    num_exact_layers: int | None = None,
    repeats: int = 3,
    measure_own: bool = True,
) -> dict[str, float]:
    """Median milliseconds to the target's first logits for `input_ids` `[1, T]`: from the source's cache (build the
    `TransferredCache`, map it, compute the exact layers, run the recomputed tokens) vs the target's own prefill. The
    source's prefill is not counted: it read the conversation already. One warm-up call each (first-call
    allocations and kernel selection are not what a server pays per request). `num_recompute_tokens` and
    `num_exact_layers` default to `TransferredCache`'s. `measure_own=False` skips the target's own prefill (its
    entries are then None), for a second configuration timed against the same baseline.

    Returns:
        `{"num_tokens", "num_recompute_tokens", "num_exact_layers", "transfer_ms", "target_prefill_ms", "speedup"}`
        with the numbers actually used (wall clock), and `"transfer_cpu_ms"`, `"target_prefill_cpu_ms"`: the same
        calls' process CPU time (`time_call`), the steadier figure where other processes share the cores."""
    import inspect

    import torch

    from ..core.cache import TransferredCache
    from ..core.defaults import resolve_num_recompute_tokens
    from ..core.capture import cache_argument, prefill

    num_recompute_tokens = resolve_num_recompute_tokens(num_recompute_tokens, input_ids.shape[-1], mapper, num_exact_layers)

    src_cache = prefill(source, input_ids.to(next(source.parameters()).device))
    device = next(target.parameters()).device
    ids = input_ids.to(device)

    # Both as `generate` runs them: logits of the last position only (`logits_to_keep=1`), not the vocabulary
    # projection of every prompt token (about half the compute of the bundled small model's prefill).
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}

    def from_transfer():
        cache = TransferredCache(src_cache, mapper, num_recompute_tokens=num_recompute_tokens,
                                 num_exact_layers=num_exact_layers, model=target)  # fmt: skip
        target(ids[:, -num_recompute_tokens:], use_cache=True, **keep, **{cache_argument(target): cache})

    with torch.no_grad():
        transfer, transfer_cpu = (median_ms(t) for t in time_call(from_transfer, device, repeats))
        own = own_cpu = None
        if measure_own:
            own, own_cpu = (median_ms(t) for t in time_call(lambda: target(ids, use_cache=True, **keep), device, repeats))
    return {"num_tokens": int(ids.shape[-1]), "num_recompute_tokens": num_recompute_tokens,
            "num_exact_layers": mapper.resolve_num_exact_layers(num_exact_layers), "transfer_ms": transfer,
            "target_prefill_ms": own, "speedup": None if own is None else own / transfer,
            "transfer_cpu_ms": transfer_cpu, "target_prefill_cpu_ms": own_cpu}  # fmt: skip


__all__ = ["DEFAULT_SEQ_LENS", "QUICK_SEQ_LENS", "median_ms", "synchronize", "time_call", "time_to_first_token"]
