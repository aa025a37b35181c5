"""The per-request quality gate: how close the mapper's K/V are to the target's own on the tokens the target
recomputes, and the threshold below which a request row falls back to the target's own prefill.

The last `num_recompute_tokens` tokens of a prompt are computed by the target itself, so for those positions the
target's K/V at every layer are known exactly; the mapper's prediction for the same positions is compared with them.
The score of a row is the worst cosine similarity over the mapped layers and over keys and values (each flattened
over heads, recomputed positions and head_dim): 1 is a perfect prediction. A fit calibrates the threshold as a low
quantile of the score on held-out prompts (`fitting/quality_gate.py`), so text like the calibration text passes and
text the maps were not fit for (random tokens) falls back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .status import APPLIED, FALLBACK

FALLBACK_REASON = "quality gate"


@dataclass
class QualityGateConfig:
    """The gate a mapper carries in its config (`MapperConfig.quality_gate`; None: no gate).

    Args:
        threshold: rows whose score (`gate_scores`) is below it fall back to the target's own prefill.
        quantile: the quantile of the held-out scores the threshold is (recorded by the fit).
        num_prompts: how many held-out prompts the quantile was taken over.
        prompt_length: their length in tokens.
    """

    threshold: float
    quantile: float = 0.01
    num_prompts: int = 0
    prompt_length: int = 0

    def __post_init__(self):
        if not -1.0 <= float(self.threshold) <= 1.0:
            raise ValueError(f"quality_gate.threshold is a cosine in [-1, 1], got {self.threshold}")
        if not 0.0 <= float(self.quantile) <= 1.0:
            raise ValueError(f"quality_gate.quantile must be in [0, 1], got {self.quantile}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """What the gate does to a request, in one sentence for `info` and the model card."""
        where = (f"the {self.quantile:g} quantile of the score over {self.num_prompts} held-out prompts of "
                 f"{self.prompt_length} tokens" if self.num_prompts else f"the {self.quantile:g} quantile of the score")  # fmt: skip
        return (f"a request row whose mapped K/V come within a cosine of {self.threshold:.4f} of the target's own on "
                f"the recomputed tokens is served from them, a lower one from the target's own prefill ({where})")

    @classmethod
    def from_value(cls, value: QualityGateConfig | dict | None) -> QualityGateConfig | None:
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"quality_gate must be a dict of QualityGateConfig fields or None, got {type(value).__name__}")


@dataclass(frozen=True)
class TransferStatus:
    """What a `TransferredCache` did with each row of its batch (`cache.transfer_status`).

    applied[i] is True where row i runs on the transferred K/V, False where it fell back to the target's own prefill
    (then `reason` is "quality gate"); `scores` are the rows' gate scores (None when the gate did not run) and
    `threshold` the gate's threshold (None without a gate).
    """

    applied: tuple[bool, ...]
    scores: tuple[float, ...] | None = None
    threshold: float | None = None

    @property
    def reason(self) -> str | None:
        return None if all(self.applied) else FALLBACK_REASON

    @property
    def statuses(self) -> tuple[str, ...]:
        """Each row's status in the connector's words: "applied" or "fallback" (`core/status.py`)."""
        return tuple(APPLIED if ok else FALLBACK for ok in self.applied)

    @property
    def fallback_rows(self) -> list[int]:
        return [i for i, ok in enumerate(self.applied) if not ok]


def _row_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.flatten(1).double(), b.flatten(1).double()
    return torch.nn.functional.cosine_similarity(a, b, dim=1, eps=1e-12)


def gate_scores(predicted: Sequence[tuple[torch.Tensor, torch.Tensor]], exact: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Per-row score `[batch]`: the worst cosine over layers and over K and V between the mapper's `predicted` and the
    target's `exact` (key, value) pairs, each `[batch, heads, positions, head_dim]` for the same positions."""
    if not predicted or len(predicted) != len(exact):
        raise ValueError(f"gate_scores needs one (key, value) pair per layer on both sides, got {len(predicted)} and {len(exact)}")
    per_layer = [torch.minimum(_row_cosine(pk, ek), _row_cosine(pv, ev)) for (pk, pv), (ek, ev) in zip(predicted, exact)]
    return torch.stack(per_layer).amin(dim=0).float()


def passes(scores: torch.Tensor, gate: QualityGateConfig | None) -> torch.Tensor:
    """Boolean `[batch]`: the rows the gate lets through (all of them without a gate)."""
    if gate is None:
        return torch.ones_like(scores, dtype=torch.bool)
    return scores >= gate.threshold


@dataclass
class PendingGate:
    """What a `TransferredCache` keeps until its gate runs (on the first conversion): the source cache (for the
    mapper's prediction of the recomputed tokens) and the prompt's mask and positions."""

    gate: QualityGateConfig
    source_cache: Any
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor  # [batch, prompt length]


def _own_kv(model, ids, mask, positions, past=None):
    """The target's own K/V after a forward of `ids` (on `past`, a `DynamicCache`, when given)."""
    from transformers import DynamicCache

    from .capture import cache_argument

    cache = past if past is not None else DynamicCache(config=model.config)
    model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_argument(model): cache})
    return cache


def run_gate(cache, pending: PendingGate, model, like: torch.Tensor) -> TransferStatus:
    """Fill `cache`'s pending layers from the source (all of them at once), score each row on the recomputed tokens,
    and replace the rows below the threshold with the target's own prefill of the transferred tokens."""
    from transformers import DynamicCache

    prompt = cache.prompt_ids
    held = pending.position_ids.shape[-1] - cache.num_recompute_tokens  # the transferred tokens
    # The mapper's prediction for every prompt token, the recomputed ones included: a transfer that recomputes none.
    full = type(cache)(pending.source_cache, cache.mapper, pending.attention_mask, 0, input_ids=prompt,
                       num_exact_layers=cache.num_exact_layers, model=model, gate=False)  # fmt: skip
    full.convert_all(like.device, like.dtype)
    mask = pending.attention_mask.to(like.device) if pending.attention_mask is not None else None
    probe = DynamicCache(config=model.config)
    for i, layer in enumerate(full.layers):
        probe.update(layer.keys[:, :, :held], layer.values[:, :, :held], i)
    ids, positions = prompt.to(like.device), pending.position_ids.to(like.device)
    _own_kv(model, ids[:, held:], mask, positions[:, held:], probe)  # the target's own K/V of the recomputed tokens
    predicted = [(layer.keys[:, :, held:], layer.values[:, :, held:]) for layer in full.layers]
    exact = [(layer.keys[:, :, held:], layer.values[:, :, held:]) for layer in probe.layers]
    scores = gate_scores(predicted, exact)
    ok = passes(scores, pending.gate)
    layers = [(layer.keys[:, :, :held].contiguous(), layer.values[:, :, :held].contiguous()) for layer in full.layers]
    bad = (~ok).nonzero().flatten()
    if bad.numel():
        rows_mask = mask[bad, :held] if mask is not None else None
        own = _own_kv(model, ids[bad, :held], rows_mask, positions[bad, :held])
        for (keys, values), layer in zip(layers, own.layers):
            keys[bad], values[bad] = layer.keys.to(keys.dtype), layer.values.to(values.dtype)
    cache.fill_converted(layers, like.shape[0])
    return TransferStatus(tuple(ok.tolist()), tuple(scores.tolist()), pending.gate.threshold)


__all__ = ["FALLBACK_REASON", "PendingGate", "QualityGateConfig", "TransferStatus", "gate_scores", "passes", "run_gate"]
