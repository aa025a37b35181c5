"""Fit a ridge KVMapper: one pass of calibration tokens through both models, then a closed-form solve."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from huggingface_hub.utils import tqdm
from transformers import PreTrainedModel

from .capture import capture_kv
from .mapper import KVMapper, MapperConfig, _mapper_from_solution
from .ridge import select_layers, single_source_r2, solve_layers
from .rope import check_supported, text_config
from .stats import KVLayout, KVStatistics, statistics_nbytes

logger = logging.getLogger(__name__)


def _model_device(model: PreTrainedModel) -> torch.device:
    return next(model.parameters()).device


def check_pair(source: PreTrainedModel, target: PreTrainedModel) -> None:
    """Raise if two models cannot share a token stream (vocabulary) or an architecture is unsupported."""
    for which, model in (("source", source), ("target", target)):
        check_supported(text_config(model.config))
    s_vocab, t_vocab = text_config(source.config).vocab_size, text_config(target.config).vocab_size
    if s_vocab != t_vocab:
        raise ValueError(
            f"source and target vocabularies differ ({s_vocab} vs {t_vocab} tokens): KV transfer needs both models "
            "to read the same token ids; pick two models of one family that share a tokenizer"
        )


def _batches(
    calibration_input_ids: torch.Tensor | Iterable, attention_mask: torch.Tensor | None, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """Yield `(input_ids, attention_mask)` batches from a tensor or an iterable of tensors / dicts."""
    if isinstance(calibration_input_ids, torch.Tensor):
        ids = calibration_input_ids if calibration_input_ids.ndim == 2 else calibration_input_ids.unsqueeze(0)
        for start in range(0, ids.shape[0], batch_size):
            mask = attention_mask[start : start + batch_size] if attention_mask is not None else None
            yield ids[start : start + batch_size], mask
        return
    for item in calibration_input_ids:
        if isinstance(item, dict):
            ids, mask = item["input_ids"], item.get("attention_mask")
        else:
            ids, mask = item, None
        ids = torch.as_tensor(ids)
        yield (ids if ids.ndim == 2 else ids.unsqueeze(0)), (
            torch.as_tensor(mask).reshape(ids.shape[0] if ids.ndim == 2 else 1, -1) if mask is not None else None
        )


def new_statistics(
    source: PreTrainedModel, target: PreTrainedModel, metadata: dict[str, Any] | None = None, **kwargs
) -> KVStatistics:
    """Empty `KVStatistics` shaped for this model pair."""
    return KVStatistics(
        KVLayout.from_config(source.config),
        KVLayout.from_config(target.config),
        text_config(source.config).to_dict(),
        text_config(target.config).to_dict(),
        metadata=metadata,
        **kwargs,
    )


@torch.no_grad()
def collect_statistics(
    source: PreTrainedModel,
    target: PreTrainedModel,
    calibration_input_ids: torch.Tensor | Iterable,
    attention_mask: torch.Tensor | None = None,
    stride: int = 4,
    batch_size: int = 8,
    statistics: KVStatistics | None = None,
    progress: bool = True,
) -> KVStatistics:
    """Run both models over calibration tokens and accumulate `KVStatistics` (one pass).

    Args:
        source, target: causal LMs of one family (same vocabulary).
        calibration_input_ids: `[num_sequences, seq_len]` ids, or an iterable of such batches (tensors or
            dicts with `input_ids` / `attention_mask`).
        stride: use every `stride`-th token of each sequence (paper: 4).
        statistics: existing statistics to add to (e.g. a resumed run); a new object otherwise.

    Returns:
        The statistics; pass them to `solve_mapper` for any `top_k` / `ridge_lambda`.
    """
    check_pair(source, target)
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    stats = statistics if statistics is not None else new_statistics(source, target)
    logger.info(
        "statistics need %.1f MiB (%s, %s)",
        statistics_nbytes(stats.source_layout, stats.target_layout, stats.dtype) / 2**20,
        stats.dtype,
        stats.device,
    )
    src_device, tgt_device = _model_device(source), _model_device(target)
    total = calibration_input_ids.shape[0] if isinstance(calibration_input_ids, torch.Tensor) else None
    bar = tqdm(total=total, desc="calibration", unit="seq", disable=not progress)
    tokens, start = 0, time.perf_counter()
    for ids, mask in _batches(calibration_input_ids, attention_mask, batch_size):
        src_k, src_v = capture_kv(source, ids.to(src_device), mask.to(src_device) if mask is not None else None)
        tgt_k, tgt_v = capture_kv(target, ids.to(tgt_device), mask.to(tgt_device) if mask is not None else None)
        stats.update(src_k, src_v, tgt_k, tgt_v, attention_mask=mask, stride=stride)
        tokens += int(mask.sum()) if mask is not None else ids.numel()
        bar.update(ids.shape[0])
        bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - start, 1e-9):.0f}")
    bar.close()
    stats.metadata.setdefault("stride", stride)
    return stats


def solve_mapper(
    statistics: KVStatistics,
    top_k: int | str | None = 4,
    ridge_lambda: float = 0.01,
    dtype: torch.dtype = torch.float32,
    **config_kwargs: Any,
) -> KVMapper:
    """Build a ridge `KVMapper` from statistics: rank source layers, keep the top k, solve.

    Args:
        top_k: source layers per target layer (`"all"`/`None` for all of them).
        ridge_lambda: ridge penalty on the centered *sum* Gram matrix (paper and scikit-learn semantics).
        config_kwargs: extra `MapperConfig` fields (model ids, revisions, calibration description, ...).
    """
    if top_k == "all":
        top_k = None
    scores = single_source_r2(statistics, ridge_lambda)["mean"]
    selected = select_layers(scores, top_k)
    selections = dict(enumerate(selected))
    solutions = {kind: solve_layers(statistics, kind, selections, ridge_lambda) for kind in ("key", "value")}
    calibration = dict(statistics.metadata.get("calibration", {}))
    calibration.setdefault("stride", statistics.metadata.get("stride"))
    calibration["num_tokens"] = statistics.count
    config_kwargs.setdefault("calibration", calibration)
    for key in ("source_model_id", "target_model_id", "source_revision", "target_revision"):
        if key in statistics.metadata:
            config_kwargs.setdefault(key, statistics.metadata[key])
    config = MapperConfig(
        source_config=statistics.source_config,
        target_config=statistics.target_config,
        selected_layers=selected,
        top_k=top_k if top_k is not None else statistics.source_layout.num_layers,
        ridge_lambda=ridge_lambda,
        **config_kwargs,
    )
    return _mapper_from_solution(config, solutions, dtype=dtype)


def fit_mapper(
    source: PreTrainedModel,
    target: PreTrainedModel,
    calibration_input_ids: torch.Tensor | Iterable,
    top_k: int | str | None = 4,
    ridge_lambda: float = 0.01,
    stride: int = 4,
    batch_size: int = 8,
    attention_mask: torch.Tensor | None = None,
    progress: bool = True,
    **config_kwargs: Any,
) -> KVMapper:
    """Fit a closed-form ridge mapper from `source`'s KV cache to `target`'s.

    One pass over the calibration tokens through both models collects sufficient statistics; the top-k
    source layers per target layer are picked by single-source R^2 and each target layer is solved in
    closed form. To try other `top_k` / `ridge_lambda` without running the models again, use
    `collect_statistics` + `solve_mapper`.

    Args:
        source, target: causal LMs of one family sharing a tokenizer.
        calibration_input_ids: `[num_sequences, seq_len]` token ids (or an iterable of batches).
        top_k: source layers per target layer (`"all"` for every layer).
        ridge_lambda: ridge penalty (default 0.01, as in the paper).
        stride: use every `stride`-th token (default 4).

    Returns:
        A `KVMapper` (float32) with per-layer fit R^2 in `mapper.config`.

    Example:
        ```python
        mapper = fit_mapper(source, target, calibration_ids, top_k=4)
        mapper.save_pretrained("mappers/small-to-large")
        ```
    """
    stats = collect_statistics(
        source, target, calibration_input_ids, attention_mask=attention_mask, stride=stride,
        batch_size=batch_size, progress=progress,
    )
    for which, model in (("source", source), ("target", target)):
        name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
        if name:
            config_kwargs.setdefault(f"{which}_model_id", name)
    return solve_mapper(stats, top_k=top_k, ridge_lambda=ridge_lambda, **config_kwargs)
