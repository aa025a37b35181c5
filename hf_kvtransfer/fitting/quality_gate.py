"""Calibrating the per-request quality gate (`core/quality_gate.py`) in a fit: the threshold is a low quantile of the
gate's score over held-out prompts, so about that share of text like the calibration text falls back and text the
maps were not fit for (random tokens, say) falls back far more often."""

from __future__ import annotations

import dataclasses

import torch

from ..core.cache import TransferredCache
from ..core.capture import cache_argument, prefill
from ..core.mapper import KVMapper
from ..core.quality_gate import QualityGateConfig

GATE_PROMPTS = 200  # held-out prompts the quantile is taken over, at most
GATE_TOKENS = 256  # tokens of each


@torch.no_grad()
def gate_scores_on(source, target, mapper: KVMapper, input_ids: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """The gate's score `[rows]` of each prompt in `input_ids` (unpadded), with the mapper's transfer settings."""
    scores = []
    everything = QualityGateConfig(threshold=-1.0)  # every row passes: only the scores are wanted
    for start in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[start : start + batch_size]
        cache = TransferredCache(prefill(source, ids), mapper, gate=everything, model=target)
        target(ids[:, -cache.num_recompute_tokens :], **{cache_argument(target): cache})
        scores.append(torch.tensor(cache.transfer_status.scores))
    return torch.cat(scores)


def calibrate_quality_gate(source, target, mapper: KVMapper, heldout_ids: torch.Tensor, quantile: float) -> KVMapper:
    """`mapper` with a `QualityGateConfig` whose threshold is the `quantile` of the score over up to `GATE_PROMPTS`
    held-out prompts of (at most) `GATE_TOKENS` tokens; the scores' summary goes to `mapper.report["quality_gate"]`."""
    ids = heldout_ids[:GATE_PROMPTS, :GATE_TOKENS]
    scores = gate_scores_on(source, target, mapper, ids)
    threshold = float(torch.quantile(scores.double(), quantile))
    gate = QualityGateConfig(threshold=max(min(threshold, 1.0), -1.0), quantile=quantile,
                             num_prompts=int(ids.shape[0]), prompt_length=int(ids.shape[1]))  # fmt: skip
    mapper.config = dataclasses.replace(mapper.config, quality_gate=gate)
    mapper.report = {**mapper.report, "quality_gate": {"scores_min": float(scores.min()), "scores_median": float(scores.median())}}
    return mapper


__all__ = ["GATE_PROMPTS", "GATE_TOKENS", "calibrate_quality_gate", "gate_scores_on"]
