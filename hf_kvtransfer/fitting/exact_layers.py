"""How many of the target's first layers `TransferredCache` should compute itself: a content probe run by the fit.

A mapper can fit keys and values well on average (high R^2, high attention-output cosine) and still lose what the
context *said*: on the bundled family one target layer per direction carries copying and look-up (induction-like
heads whose keys encode the previous token) and its linear map does not reproduce it, so passage recall through the
transfer drops from 77% to chance while perplexity retention stays at 21-26%. The target's layers below and
including that one, computed from the prompt's ids (`num_exact_layers`), bring it back (small -> large: 4 of 8
layers, recall 98%).

The probe measures exactly that property on the fit's own held-out calibration tokens: spans of text repeated from
the prefix (`tasks.repeated_span_items`, kind "text"), scored as own prefill / transfer / first occurrence replaced
(`content_eval.repeated_span_retention`). It picks the fewest exact layers whose floor-normalized retention reaches
`min_retention`, by bisection over `1 .. num_layers` (it assumes computing more layers never loses content; the
whole target computed is its own prefill, retention 1 by construction, and is not run).

Example:
    ```python
    num_exact, report = choose_num_exact_layers(small, large, mapper, heldout_ids)
    cache = TransferredCache(prefill(small, ids), mapper, num_exact_layers=num_exact)
    ```
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import torch
from transformers import PreTrainedModel

from ..evaluation.content import repeated_span_retention
from ..core.mapper import DEFAULT_NUM_EXACT_LAYERS, KVMapper
from ..evaluation.tasks import repeated_span_items

logger = logging.getLogger(__name__)

# Below this NLL drop (nats per repeated token) the target does not copy from its context: a model that does
# drops it by several nats (the bundled family: 8.6 and 8.8); a random-weight model by ~0.
MIN_COPY_GAIN = 0.25
# The probe's items: a repeated span of text inside a prefix, scored in a continuation (`repeated_span_items`).
PROBE_PREFIX_LEN = 256
PROBE_CONTINUATION_LEN = 64


def probe_stream(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[int]:
    """Calibration rows `[num_sequences, seq_len]` as one token stream (padding dropped)."""
    if attention_mask is not None:
        return [int(t) for row, mask in zip(input_ids, attention_mask) for t, m in zip(row, mask) if m]
    return input_ids.reshape(-1).tolist()


def probe_prefix_len(num_tokens: int) -> int | None:
    """The probe's prefix length for a stream of `num_tokens` (None: too short for any item)."""
    # `repeated_span_items` cuts each window and its text span from the stream: it needs 2 windows + a span.
    for prefix_len in (PROBE_PREFIX_LEN, PROBE_PREFIX_LEN // 2, PROBE_PREFIX_LEN // 4):
        if num_tokens >= 2 * (prefix_len + PROBE_CONTINUATION_LEN) + 24:
            return prefix_len
    return None


def choose_num_exact_layers(
    source: PreTrainedModel,
    target: PreTrainedModel,
    mapper: KVMapper,
    token_ids: list[int] | torch.Tensor,
    *,
    min_retention: float = 0.95,
    num_items: int = 64,
    prefix_len: int | None = None,
    seed: int = 0,
    progress: bool = False,
) -> tuple[int | None, dict[str, Any]]:
    """The fewest target layers to compute exactly for `min_retention` of the target's copying from its context.

    Args:
        source, target, mapper: the pair and its mapper (any type).
        token_ids: held-out text tokens (a stream, or `[num_sequences, seq_len]` rows read in order) that the
            repeated spans and their windows are cut from.
        min_retention: floor-normalized repeated-span retention to reach (0.95: the project's goal).
        num_items: repeated spans scored per candidate.
        prefix_len: the items' prefix length (default: 256, or less for a short stream).

    Returns:
        `(num_exact_layers, report)`. `num_exact_layers` is None when the probe cannot decide (too few tokens, or
        the target does not copy from its context): the cache then uses `DEFAULT_NUM_EXACT_LAYERS`. The report
        has every candidate tried with its retention and 95% interval, the target's own copy gain, and the reason.
    """
    stream = probe_stream(token_ids) if isinstance(token_ids, torch.Tensor) else list(token_ids)
    num_layers = mapper.target_layout.num_layers
    report: dict[str, Any] = {
        "metric": "repeated-span retention (text spans of held-out calibration tokens; own / transfer / first "
        "occurrence replaced; 1 recomputed token)",
        "min_retention": min_retention,
        "num_items": num_items,
        "probe_tokens": len(stream),
        "tried": [],
        "chosen": None,
    }
    prefix_len = prefix_len or probe_prefix_len(len(stream))
    if prefix_len is None:
        report["reason"] = (
            f"{len(stream)} held-out tokens are too few for the probe (it needs "
            f"{2 * (PROBE_PREFIX_LEN // 4 + PROBE_CONTINUATION_LEN) + 24}); default {DEFAULT_NUM_EXACT_LAYERS} kept"
        )
        return None, report
    items = repeated_span_items(
        target.config.get_text_config().vocab_size, stream, num_items, seed=seed, prefix_len=prefix_len,
        continuation_len=PROBE_CONTINUATION_LEN, kind="text",
    )  # fmt: skip
    report["prefix_len"] = prefix_len

    baseline: dict[str, Any] | None = None  # the target's own and no-context scores do not depend on k

    def retention(k: int) -> float | None:
        nonlocal baseline
        r = repeated_span_retention(
            source, target, mapper, items, num_recompute_tokens=1, num_exact_layers=k, progress=progress,
            reference=baseline, desc=f"exact-layers probe: {k} of {num_layers} layers exact",
        )  # fmt: skip
        baseline = baseline or r
        report["tried"].append({"num_exact_layers": k, "retention": r["retention"], "retention_ci": r["retention_ci"]})
        return r["retention"]

    first = retention(DEFAULT_NUM_EXACT_LAYERS)
    gain = report["copy_gain"] = baseline["context_gain"]
    if first is None or gain["mean"] < MIN_COPY_GAIN or gain["ci"][0] <= 0:
        report["reason"] = (
            f"the target barely copies from its context on the probe (NLL gain {gain['mean']:.3f} nats/token, "
            f"95% CI [{gain['ci'][0]:.3f}, {gain['ci'][1]:.3f}]; needs >= {MIN_COPY_GAIN}): there is no content to "
            f"keep; default {DEFAULT_NUM_EXACT_LAYERS} kept"
        )
        return None, report
    # Bisection: `lo` layers are known to lose content, `hi` to keep it (all of them: the target's own prefill).
    lo, hi = DEFAULT_NUM_EXACT_LAYERS, num_layers
    if first >= min_retention:
        hi = lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        value = retention(mid)
        if value is not None and value >= min_retention:
            hi = mid
        else:
            lo = mid
    report["chosen"] = hi
    report["tried"].sort(key=lambda row: row["num_exact_layers"])
    if hi == num_layers:
        report["reason"] = (
            f"no mapped layer keeps {min_retention:.0%} of the copying short of computing all {num_layers}: the "
            "target computes its whole cache itself (no prefill saved; pass num_exact_layers to TransferredCache to "
            "trade content for speed)"
        )
        logger.warning("exact layers: %s", report["reason"])
    else:
        report["reason"] = f"the fewest exact layers with retention >= {min_retention:.0%}"
    return hi, report




# -- the search over configurations: exact layers x map inputs, by retention and time to the first token ---------

# Residual layers the search tries: those leaving at least half of the target mapped (more exact layers than half
# the target cannot save half of its prefill, whatever the maps read).
def residual_candidates(num_layers: int) -> list[int]:
    """Candidate `residual_layer`s J (J + 1 exact layers) for a target of `num_layers` layers."""
    return list(range(0, max(1, num_layers // 2)))


def _inputs_label(mapper: KVMapper) -> str:
    c = mapper.config
    if c.residual_layer is None:
        return "source K/V"
    rank = f", rank {c.residual_rank}" if c.residual_rank else ""
    lags = ", ".join("t" if lag == 0 else f"t-{lag}" for lag in c.residual_lags)
    return f"source K/V + target residual entering layer {c.residual_layer} ({lags}{rank})"


def _time_candidate(source, target, mapper: KVMapper, ids: torch.Tensor, num_exact: int) -> dict[str, float]:
    from ..evaluation.timing import time_to_first_token

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the figure of one core, comparable across machines' core counts and loads
    try:
        return time_to_first_token(source, target, mapper, ids, num_exact_layers=num_exact)
    finally:
        torch.set_num_threads(threads)


def choose_configuration(
    source: PreTrainedModel,
    target: PreTrainedModel,
    mapper: KVMapper,
    token_ids: list[int] | torch.Tensor,
    *,
    residual_mappers: dict[int, KVMapper] | None = None,
    min_retention: float = 0.95,
    num_items: int = 64,
    prefix_len: int | None = None,
    timing_tokens: int = 512,
    seed: int = 0,
    progress: bool = False,
) -> tuple[KVMapper, dict[str, Any]]:
    """The fastest configuration (exact layers x map inputs) that keeps `min_retention` of the target's copying.

    Candidates: `mapper` (source K/V only) with the exact layers `choose_num_exact_layers` tries, and each of
    `residual_mappers` (`{J: mapper whose maps also read the target's residual entering layer J}`, from
    `residual_stats.solve_residual_mapper`) with `J + 1` exact layers. Each is scored by the probe's repeated-span
    retention and timed to the first token (`evaluation.timing.time_to_first_token`, one thread, on the first
    `timing_tokens` probe tokens, the cache's default recomputed tokens) on this machine. The chosen one is the
    candidate with the shortest time among those whose retention reaches `min_retention`; none reaching it, the
    source-only mapper with the probe's answer (possibly the whole target).

    Returns:
        `(mapper, report)`: the chosen mapper with its `num_exact_layers` recorded, and the probe's report with
        `candidates` (the frontier: one row per candidate with inputs, exact layers, retention and its 95%
        interval, transfer and prefill milliseconds, speed-up, chosen) besides `choose_num_exact_layers`' keys.
    """
    stream = probe_stream(token_ids) if isinstance(token_ids, torch.Tensor) else list(token_ids)
    chosen_kv, report = choose_num_exact_layers(
        source, target, mapper, stream, min_retention=min_retention, num_items=num_items, prefix_len=prefix_len,
        seed=seed, progress=progress,
    )  # fmt: skip
    num_layers = mapper.target_layout.num_layers
    if report.get("prefix_len") is None or report.get("copy_gain") is None or "barely copies" in report.get("reason", ""):
        return _with_num_exact(mapper, chosen_kv), report  # nothing to compare on: the source-only answer
    items = repeated_span_items(
        target.config.get_text_config().vocab_size, stream, num_items, seed=seed, prefix_len=report["prefix_len"],
        continuation_len=PROBE_CONTINUATION_LEN, kind="text",
    )  # fmt: skip
    ids = torch.tensor(stream[: min(timing_tokens, len(stream))]).unsqueeze(0)
    rows: list[dict[str, Any]] = []
    candidates: list[tuple[KVMapper, int]] = []
    for row in report["tried"]:
        candidates.append((mapper, row["num_exact_layers"]))
        rows.append({"inputs": _inputs_label(mapper), "residual_layer": None, **row})
    baseline = None
    for layer, residual_mapper in sorted((residual_mappers or {}).items()):
        num_exact = layer + 1
        r = repeated_span_retention(
            source, target, residual_mapper, items, num_recompute_tokens=1, num_exact_layers=num_exact,
            progress=progress, reference=baseline,
        )  # fmt: skip
        baseline = baseline or r
        candidates.append((residual_mapper, num_exact))
        rows.append({"inputs": _inputs_label(residual_mapper), "residual_layer": layer, "num_exact_layers": num_exact,
                     "retention": r["retention"], "retention_ci": r["retention_ci"]})  # fmt: skip
    for row, (m, num_exact) in zip(rows, candidates):
        if num_exact >= num_layers:
            row.update(transfer_ms=None, target_prefill_ms=None, speedup=1.0)  # the target's own prefill
            continue
        timing = _time_candidate(source, target, m, ids, num_exact)
        row.update(transfer_ms=timing["transfer_ms"], target_prefill_ms=timing["target_prefill_ms"], speedup=timing["speedup"])
    ok = [i for i, row in enumerate(rows) if row["retention"] is not None and row["retention"] >= min_retention and row["transfer_ms"] is not None]
    report["timing"] = {"num_tokens": int(ids.shape[-1]), "threads": 1, "num_recompute_tokens": "TransferredCache default"}
    report["candidates"] = rows
    if not ok:
        for row in rows:
            row["chosen"] = False
        return _with_num_exact(mapper, chosen_kv), report
    best = min(ok, key=lambda i: rows[i]["transfer_ms"])
    for i, row in enumerate(rows):
        row["chosen"] = i == best
    chosen_mapper, num_exact = candidates[best]
    report["chosen"] = num_exact
    report["chosen_inputs"] = rows[best]["inputs"]
    report["reason"] = (
        f"the fastest candidate (time to the first token on {int(ids.shape[-1])} tokens, one thread) with retention >= "
        f"{min_retention:.0%}"
    )
    return _with_num_exact(chosen_mapper, num_exact), report


def _with_num_exact(mapper: KVMapper, num_exact: int | None) -> KVMapper:
    # A shallow copy (same weights) with its own config: the caller's mapper is left as it was.
    chosen = copy.copy(mapper)
    chosen.config = dataclasses.replace(mapper.config, num_exact_layers=num_exact)
    return chosen


__all__ = ["MIN_COPY_GAIN", "choose_configuration", "choose_num_exact_layers", "probe_stream", "residual_candidates"]
