"""Fit a ridge KVMapper: one pass of calibration tokens through both models, then a closed-form solve."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import replace
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.utils import tqdm
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from .capture import capture_kv
from .mapper import KVMapper, MapperConfig, config_fingerprint
from .ridge import heldout_r2, layer_scores, probe_single_source_r2, select_layers, solve_layers, sweep_heldout
from .rope import check_supported, text_config
from .stats import (
    BlockStatistics,
    KVLayout,
    KVStatistics,
    block_statistics_nbytes,
    flatten_layers,
    statistics_from_state,
    statistics_nbytes,
    token_selection,
)

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


def check_tokenizers(source_tokenizer, target_tokenizer) -> None:
    """Raise if two tokenizers would turn the same text into different ids (vocabulary or special tokens)."""
    problems = []
    vs, vt = source_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if vs != vt:
        only_s, only_t = sorted(set(vs) - set(vt)), sorted(set(vt) - set(vs))
        moved = sorted(tok for tok in set(vs) & set(vt) if vs[tok] != vt[tok])
        problems.append(
            f"vocabularies differ ({len(vs)} vs {len(vt)} entries; only in source: {only_s[:5]}, only in target: "
            f"{only_t[:5]}, different ids: {moved[:5]})"
        )
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(source_tokenizer, attr, None), getattr(target_tokenizer, attr, None)
        if a != b:
            problems.append(f"{attr} is {a} in the source and {b} in the target")
    sa, ta = sorted(map(str, source_tokenizer.all_special_tokens)), sorted(map(str, target_tokenizer.all_special_tokens))
    if sa != ta:
        problems.append(f"special tokens differ: {sa} vs {ta}")
    if problems:
        raise ValueError(
            "source and target tokenizers differ: " + "; ".join(problems) + ". KV transfer needs both models to read "
            "the same token ids; pick a source and target of one family that share a tokenizer"
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
    total = calibration_input_ids.shape[0] if isinstance(calibration_input_ids, torch.Tensor) else None
    bar = tqdm(total=total, desc="calibration", unit="seq", disable=not progress)
    tokens, start = 0, time.perf_counter()
    for ids, mask in _batches(calibration_input_ids, attention_mask, batch_size):
        src_k, src_v = capture_kv(source, ids, mask)
        tgt_k, tgt_v = capture_kv(target, ids, mask)
        stats.update(src_k, src_v, tgt_k, tgt_v, attention_mask=mask, stride=stride)
        tokens += int(mask.sum()) if mask is not None else ids.numel()
        bar.update(ids.shape[0])
        bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - start, 1e-9):.0f}")
    bar.close()
    stats.metadata.setdefault("stride", stride)
    return stats


# -- large fits: sharded, checkpointed, distributed accumulation ------------------------------------------

CHECKPOINT_PREFIX = "checkpoint-rank"


def _dist_info(group=None) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def statistics_memory_line(
    source_layout: KVLayout, target_layout: KVLayout, dtype: torch.dtype, device, heldout: bool = False
) -> str:
    """The line printed before a fit: the statistics' size by DESIGN §2's formula and where they live."""
    ds, dt = source_layout.total_dim, target_layout.total_dim
    nbytes = statistics_nbytes(source_layout, target_layout, dtype) * (2 if heldout else 1)
    return (
        f"statistics: 2 x ({ds}^2 + {ds}x{dt} + {ds} + 2x{dt}) {str(dtype).replace('torch.', '')} "
        f"{'x 2 (fit + held-out shard) ' if heldout else ''}= {nbytes / 2**20:,.1f} MiB on {device}"
    )


def _default_statistics_device(model: PreTrainedModel, nbytes: int) -> torch.device:
    """The model's GPU when the statistics take under half of its free memory, else the CPU."""
    device = _model_device(model)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if nbytes < free // 2:
            return device
        logger.warning("statistics (%.1f GiB) do not fit next to the model on %s; accumulating on CPU", nbytes / 2**30, device)
    return torch.device("cpu")


def _json_roundtrip(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _save_checkpoint(path: Path, train: KVStatistics, heldout: KVStatistics | None, done: int, run: dict) -> None:
    """One safetensors file holding both accumulators and the progress: written to a temp file, then renamed."""
    tensors = {f"train.{k}": v.detach().cpu().contiguous() for k, v in train.tensors.items()}
    if heldout is not None:
        tensors.update({f"heldout.{k}": v.detach().cpu().contiguous() for k, v in heldout.tensors.items()})
    meta = {"run": run, "done": done, "train": train._meta(), "heldout": heldout._meta() if heldout is not None else None}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"checkpoint": json.dumps(meta, sort_keys=True)})
    os.replace(tmp, path)


def _load_checkpoint(path: Path, run: dict, device) -> tuple[KVStatistics, KVStatistics | None, int] | None:
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {})["checkpoint"])
    if meta["run"] != _json_roundtrip(run):
        diffs = sorted(k for k in set(run) | set(meta["run"]) if _json_roundtrip(run).get(k) != meta["run"].get(k))
        raise ValueError(
            f"checkpoint {path} belongs to a different fit (differs in: {', '.join(diffs)}); rerun with the same "
            "models, data and options to resume it, or delete it (or choose another --stats-dir) to start over"
        )
    tensors = load_file(str(path), device=str(device))
    train = statistics_from_state(
        {k[6:]: v for k, v in tensors.items() if k.startswith("train.")}, meta["train"], str(path)
    )
    heldout = None
    if meta["heldout"] is not None:
        heldout = statistics_from_state(
            {k[8:]: v for k, v in tensors.items() if k.startswith("heldout.")}, meta["heldout"], str(path)
        )
    return train, heldout, int(meta["done"])


class _GracefulInterrupt:
    """Turn the first SIGINT into a flag checked between batches (so a checkpoint is written); the second one
    interrupts at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        logger.warning("interrupt received: finishing the current batch and writing a checkpoint (Ctrl-C again to abort)")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


@torch.no_grad()
def accumulate_statistics(
    source: PreTrainedModel,
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    stride: int = 4,
    batch_size: int = 8,
    num_heldout: int = 0,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 64,
    statistics_device: torch.device | str | None = None,
    statistics_dtype: torch.dtype = torch.float64,
    metadata: dict[str, Any] | None = None,
    progress: bool = True,
    group=None,
    two_stage: bool = False,
    probe_tokens: int = 8192,
    max_top_k: int | None = 8,
    probe_ridge_lambda: float = 0.01,
    product_dtype: torch.dtype | None = None,
) -> tuple[KVStatistics, KVStatistics | None]:
    """Accumulate fit (and held-out) statistics over a fixed token sample: resumable and distributed.

    The last `num_heldout` sequences form the held-out shard. Under `torch.distributed` (torchrun,
    accelerate launch) rank r takes sequences r, r + world, ... of each shard and the sums are all-reduced
    at the end, so every rank returns the statistics of the whole sample. With `checkpoint_dir`, each rank
    saves its partial sums every `checkpoint_every` sequences (atomic rename), on SIGINT and on errors, and a
    call with the same arguments resumes from there; the result equals an uninterrupted run.

    Args:
        input_ids: `[num_sequences, seq_len]` token ids (e.g. from `calibration.build_calibration`).
        attention_mask: optional `[num_sequences, seq_len]` mask (1 = real token).
        stride: use every `stride`-th token of each sequence.
        statistics_device: where the sums live; default the model's GPU when they fit, else the CPU.
        two_stage: bounded memory (DESIGN §2): the first `probe_tokens` fit tokens are kept as features and
            rank source layers (single-source R^2); then only the Gram/cross blocks of each target layer's
            top-`max_top_k` layers are accumulated (`BlockStatistics`; any k <= max_top_k can be solved).
            Under torch.distributed, rank 0's probe decides for all ranks.
        product_dtype: dtype of the per-batch products; float32 = per-batch centering + float64 merge
            (default on CUDA), else exact products in `statistics_dtype` (default on CPU).

    Returns:
        `(fit_statistics, heldout_statistics or None)`.
    """
    check_pair(source, target)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [num_sequences, seq_len], got shape {list(input_ids.shape)}")
    if stride < 1 or batch_size < 1 or checkpoint_every < 1:
        raise ValueError(f"stride, batch_size and checkpoint_every must be >= 1, got {stride}, {batch_size}, {checkpoint_every}")
    num_sequences = input_ids.shape[0]
    if not 0 <= num_heldout < num_sequences:
        raise ValueError(f"num_heldout must be in [0, {num_sequences}) (the number of sequences), got {num_heldout}")
    rank, world = _dist_info(group)
    from .calibration import sample_hash

    digest = sample_hash(input_ids)
    if world > 1:
        import torch.distributed as dist

        digests = [None] * world
        dist.all_gather_object(digests, digest, group=group)
        if len(set(digests)) != 1:
            raise ValueError(f"ranks built different calibration samples ({digests}); every rank must read the same data")
    src_layout, tgt_layout = KVLayout.from_config(source.config), KVLayout.from_config(target.config)
    if two_stage:
        max_top_k = src_layout.num_layers if max_top_k is None else min(max_top_k, src_layout.num_layers)
        nbytes = block_statistics_nbytes(src_layout, tgt_layout, max_top_k, statistics_dtype) * (2 if num_heldout else 1)
    else:
        nbytes = statistics_nbytes(src_layout, tgt_layout, statistics_dtype) * (2 if num_heldout else 1)
    device = torch.device(statistics_device) if statistics_device is not None else _default_statistics_device(target, nbytes)
    logger.info(statistics_memory_line(src_layout, tgt_layout, statistics_dtype, device, bool(num_heldout)))
    run = {
        "sample_sha256": digest,
        "mask_sha256": sample_hash(attention_mask.long()) if attention_mask is not None else None,
        "stride": stride,
        "num_heldout": num_heldout,
        "world_size": world,
        "statistics_dtype": str(statistics_dtype),
        "source": config_fingerprint(source.config),
        "target": config_fingerprint(target.config),
        "two_stage": {"probe_tokens": probe_tokens, "max_top_k": max_top_k, "lambda": probe_ridge_lambda} if two_stage else None,
    }

    def fresh() -> KVStatistics:
        return new_statistics(source, target, metadata=metadata, dtype=statistics_dtype, device=device)

    # float64 GEMMs are slow on most GPUs: multiply per-batch centered float32 there (see KVStatistics._add).
    product_dtype = product_dtype or (torch.float32 if device.type == "cuda" else statistics_dtype)

    # Two-stage: no statistics until the probe has chosen the blocks; until then, features of the probe tokens.
    train, heldout, done = (None, None, 0) if two_stage else (fresh(), (fresh() if num_heldout else None), 0)
    probe: dict[str, tuple[list, list]] | None = {k: ([], []) for k in ("key", "value")} if two_stage else None
    probe_count = 0
    path = Path(checkpoint_dir) / f"{CHECKPOINT_PREFIX}{rank}-of-{world}.safetensors" if checkpoint_dir else None
    if path is not None:
        resumed = _load_checkpoint(path, run, device)
        if resumed is not None:
            train, heldout, done = resumed
            probe = None
            logger.warning("resuming from %s: %d sequences of this rank already done", path, done)

    def finish_probe():
        nonlocal train, heldout, probe
        features = {kind: (torch.cat(xs), torch.cat(ys)) if xs else None for kind, (xs, ys) in probe.items()}
        scores = None
        if rank == 0:
            if probe_count < 2:
                raise ValueError(f"the two-stage probe got {probe_count} tokens; raise probe_tokens or the data size")
            scores = probe_single_source_r2(features, src_layout, tgt_layout, probe_ridge_lambda)["mean"]
        if world > 1:
            import torch.distributed as dist

            box = [scores]
            dist.broadcast_object_list(box, src=0, group=group)
            scores = box[0]
        selections = select_layers(scores, max_top_k)

        def blocks():
            return BlockStatistics(
                src_layout, tgt_layout, selections, scores, text_config(source.config).to_dict(),
                text_config(target.config).to_dict(), metadata=metadata, dtype=statistics_dtype, device=device,
            )  # fmt: skip

        train = blocks()
        heldout = blocks() if num_heldout else None
        if probe_count:
            for kind, (x, y) in features.items():
                train.add_features(kind, x, y)
        train.count = probe_count
        for stats in (train, heldout):
            if stats is not None:
                stats.metadata.update(metadata or {})
                stats.metadata["stride"] = stride
                stats.metadata["two_stage"] = {"probe_tokens": probe_count, "max_top_k": max_top_k}
                stats.product_dtype = product_dtype
        probe = None
        logger.info("two-stage probe on %d tokens chose blocks: %.1f MiB of statistics", probe_count, train.nbytes() / 2**20)
    for stats in (train, heldout):
        if stats is not None:
            stats.metadata.update(metadata or {})
            stats.metadata["stride"] = stride
            stats.product_dtype = product_dtype

    num_train = num_sequences - num_heldout
    order = [("train", i) for i in range(rank, num_train, world)]
    order += [("heldout", i) for i in range(num_train + rank, num_sequences, world)]
    batches: list[tuple[str, list[int]]] = []
    for which, i in order[done:]:
        if batches and batches[-1][0] == which and len(batches[-1][1]) < batch_size:
            batches[-1][1].append(i)
        else:
            batches.append((which, [i]))

    seq_len = input_ids.shape[1]
    bar = tqdm(
        total=len(order) * seq_len, initial=done * seq_len, desc="calibration", unit="tok", unit_scale=True,
        disable=not progress or rank != 0,
    )
    saved = done
    with _GracefulInterrupt() as interrupt:
        for which, rows in batches:
            if probe is not None and which != "train":
                finish_probe()
            stats = train if which == "train" else heldout
            ids = input_ids[rows]
            mask = attention_mask[rows] if attention_mask is not None else None
            try:
                src_k, src_v = capture_kv(source, ids, mask)
                tgt_k, tgt_v = capture_kv(target, ids, mask)
            except BaseException:
                # Sums are untouched by this batch: keep what is done (OOM, Ctrl-C twice, a bad batch, ...).
                if path is not None and done > saved and train is not None:
                    _save_checkpoint(path, train, heldout, done, run)
                raise
            if probe is not None:
                index = token_selection(len(rows), seq_len, stride, mask, src_k[0].device)
                for kind, xs, ys in (("key", src_k, tgt_k), ("value", src_v, tgt_v)):
                    x, y = flatten_layers(xs, index), flatten_layers(ys, index.to(ys[0].device))
                    if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
                        raise ValueError(f"non-finite {kind} states in a calibration batch (NaN/inf from the model)")
                    probe[kind][0].append(x.to(device))
                    probe[kind][1].append(y.to(device))
                probe_count += int(index.numel())
                done += len(rows)
                bar.update(len(rows) * seq_len)
                if probe_count >= probe_tokens:
                    finish_probe()
                    saved = -checkpoint_every  # checkpoint now: there are statistics to save
                elif interrupt.requested:
                    raise KeyboardInterrupt("interrupted during the two-stage probe (no checkpoint yet: it restarts)")
                else:
                    continue
            else:
                stats.update(src_k, src_v, tgt_k, tgt_v, attention_mask=mask, stride=stride)
                done += len(rows)
                bar.update(len(rows) * seq_len)
            if path is not None and (interrupt.requested or done - saved >= checkpoint_every or done == len(order)):
                _save_checkpoint(path, train, heldout, done, run)
                saved = done
            if interrupt.requested:
                bar.close()
                raise KeyboardInterrupt(f"interrupted after {done} of {len(order)} sequences; checkpoint in {path}")
    bar.close()
    if probe is not None:
        finish_probe()
        saved = -checkpoint_every
    if path is not None and done > saved:
        _save_checkpoint(path, train, heldout, done, run)
    if world > 1:
        train.all_reduce(group)
        if heldout is not None:
            heldout.all_reduce(group)
    return train, heldout


def remove_checkpoints(checkpoint_dir: str | os.PathLike) -> None:
    """Delete the checkpoint files `accumulate_statistics` wrote (and the directory if it is then empty)."""
    path = Path(checkpoint_dir)
    for file in path.glob(f"{CHECKPOINT_PREFIX}*.safetensors"):
        file.unlink(missing_ok=True)
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()


def solve_mapper(
    statistics: KVStatistics,
    top_k: int | str | None = 4,
    ridge_lambda: float = 0.01,
    dtype: torch.dtype = torch.float32,
    rank: int | list[list[int]] | None = None,
    energy: float | None = None,
    size_budget: float | int | None = None,
    scores: torch.Tensor | None = None,
    **config_kwargs: Any,
) -> KVMapper:
    """Build a ridge `KVMapper` from statistics: rank source layers, keep the top k, solve.

    Args:
        top_k: source layers per target layer (`"all"`/`None` for all of them).
        ridge_lambda: ridge penalty on the centered *sum* Gram matrix (paper and scikit-learn semantics).
        dtype: weight dtype of the mapper (`torch.bfloat16` / `torch.float16` halve the storage).
        rank / energy / size_budget: at most one, for a reduced-rank mapper (see `lowrank.py`): a rank per map
            (int, or `[key_rank, value_rank]` per target layer), the fraction of fitted variance to keep per
            map (e.g. 0.99), or a parameter budget (count, or fraction of full rank) spread over the layers.
        scores: `[L_s, L_t]` layer-ranking scores already computed (`ridge.layer_scores`), to skip recomputing.
        config_kwargs: extra `MapperConfig` fields (model ids, revisions, calibration description, ...).
    """
    if top_k == "all":
        top_k = None
    selected = select_layers(scores if scores is not None else layer_scores(statistics, ridge_lambda), top_k)
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
    if rank is not None or energy is not None or size_budget is not None:
        from .lowrank import lowrank_mapper_from_solution

        return lowrank_mapper_from_solution(
            statistics, config, solutions, rank=rank, energy=energy, size_budget=size_budget, dtype=dtype
        )
    fit_r2 = {f"fit_r2_{kind}": [solutions[kind][t][2] for t in range(len(selected))] for kind in ("key", "value")}
    mapper = KVMapper(replace(config, **fit_r2))
    state = {
        f"layers.{t}.{kind}.{name}": tensor
        for kind in ("key", "value")
        for t, (weight, bias, _) in solutions[kind].items()
        for name, tensor in (("weight", weight), ("bias", bias))
    }
    mapper.load_state_dict(state)
    return mapper.to(dtype)


# The paper's k sweep and a lambda grid around its 0.01 (lambda multiplies the *sum* Gram matrix).
PAPER_TOP_K_CANDIDATES = (1, 2, 4, 6, 8, 10, 12, 16, 20, 24, None)
RIDGE_LAMBDA_CANDIDATES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0)


def _as_list(value) -> list:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        return [w for v in value for w in _as_list(v)]
    return [value]


def parse_top_k(top_k) -> list[int | None | str]:
    """`8`, `"all"`, `"1,2,all"`, `"auto"`, `[1, "all"]` -> a list of ints, None (= all) and "auto"."""
    out = []
    for v in _as_list(top_k):
        if v is None or v == "all":
            out.append(None)
        elif v == "auto":
            out.append("auto")
        else:
            try:
                out.append(int(v))
            except (TypeError, ValueError):
                raise ValueError(f"top_k must be integers, 'all' or 'auto' (comma-separated), got {v!r}") from None
    return list(dict.fromkeys(out))


def parse_ridge_lambda(ridge_lambda) -> list[float | str]:
    """`0.01`, `"auto"`, `"0.01,0.1,auto"` -> a list of floats and "auto"."""
    out = []
    for v in _as_list(ridge_lambda):
        if v == "auto":
            out.append("auto")
            continue
        try:
            value = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"ridge_lambda must be numbers or 'auto' (comma-separated), got {v!r}") from None
        if value < 0:
            raise ValueError(f"ridge_lambda must be >= 0, got {value}")
        out.append(value)
    return list(dict.fromkeys(out))


def mapper_name(top_k: int | None) -> str:
    """Subdirectory name of the mapper for one k when several are written: `k4`, `kall`."""
    return "kall" if top_k is None else f"k{top_k}"


def solve_mappers(
    statistics: KVStatistics,
    heldout: KVStatistics | None = None,
    top_k: int | str | Sequence | None = 8,
    ridge_lambda: float | str | Sequence = 0.01,
    refit: bool = True,
    dtype: torch.dtype = torch.float32,
    **config_kwargs: Any,
) -> dict[str, KVMapper]:
    """Solve one mapper per requested k from one set of statistics, with held-out scoring and model selection.

    Args:
        statistics: fit statistics (from `accumulate_statistics` / `collect_statistics`).
        heldout: statistics of a held-out shard. With it, every mapper gets `heldout_r2_key/value` per
            target layer (fit on `statistics`, scored on `heldout`), and `"auto"` is allowed.
        top_k: one or several of int / "all", or "auto" to pick by held-out R^2 among the listed values
            (the paper's sweep 1, 2, 4, ..., 24, all when none are listed).
        ridge_lambda: a number, or "auto" to pick by held-out R^2 (among listed numbers, or 1e-3 ... 1e3).
        refit: after scoring, solve the final weights on fit + held-out statistics (all sequences, as in the
            paper); the held-out R^2 recorded is that of the fit-shard model, an honest estimate.

    Returns:
        `{mapper_name(k): KVMapper}` in the order requested (one entry for "auto").
    """
    ks, lams = parse_top_k(top_k), parse_ridge_lambda(ridge_lambda)
    auto_k, auto_l = "auto" in ks, "auto" in lams
    ks, lams = [k for k in ks if k != "auto"], [v for v in lams if v != "auto"]
    num_source = statistics.source_layout.num_layers
    for k in ks:
        if k is not None and not 1 <= k <= num_source:
            raise ValueError(f"top_k must be between 1 and the source's {num_source} layers (or 'all'), got {k}")
    max_k = statistics.max_top_k if isinstance(statistics, BlockStatistics) else num_source
    for k in ks:
        if (num_source if k is None else k) > max_k:
            raise ValueError(
                f"top_k {'all' if k is None else k} needs blocks the two-stage fit did not keep (it kept the top "
                f"{max_k}); rerun with a larger max top_k or without two_stage"
            )
    model_selection = None
    heldout_rows: dict[tuple, dict] = {}
    if auto_k or auto_l:
        if heldout is None or heldout.count < 2:
            raise ValueError(
                "top_k/ridge_lambda 'auto' choose by held-out R^2 and need a held-out shard: set heldout_fraction "
                "(CLI: --heldout-fraction) above 0"
            )
        cand_k = ks if ks else [k for k in PAPER_TOP_K_CANDIDATES if k is None or k < num_source]
        cand_k = [k for k in cand_k if (num_source if k is None else k) <= max_k]
        cand_l = (lams or list(RIDGE_LAMBDA_CANDIDATES)) if auto_l else lams
        if len(cand_l) != 1 and not auto_l:
            raise ValueError(f"give one ridge_lambda, or several with 'auto' among them to pick one; got {lams}")
        curve = sweep_heldout(statistics, heldout, cand_k, cand_l)
        heldout_rows = {(r["top_k"], r["ridge_lambda"]): r for r in curve}
        if auto_k:
            best = max(curve, key=lambda r: r["heldout_r2"])  # ties keep the first: the smaller k / lambda
            chosen = [(best["top_k"], best["ridge_lambda"])]
        else:
            chosen = [(k, max((r for r in curve if r["top_k"] == k), key=lambda r: r["heldout_r2"])["ridge_lambda"]) for k in cand_k]
        model_selection = {
            "metric": "held-out R^2 (head-averaged, mean over target layers of K and V)",
            "top_k_candidates": ["all" if k is None else k for k in cand_k] if auto_k else None,
            "ridge_lambda_candidates": cand_l if auto_l else None,
            "curve": [
                {
                    "top_k": "all" if r["top_k"] is None else r["top_k"],
                    "ridge_lambda": r["ridge_lambda"],
                    "heldout_r2": r["heldout_r2"],
                    "heldout_r2_key": sum(r["heldout_r2_key"]) / len(r["heldout_r2_key"]),
                    "heldout_r2_value": sum(r["heldout_r2_value"]) / len(r["heldout_r2_value"]),
                }
                for r in curve
            ],
            "chosen": [{"top_k": "all" if k is None else k, "ridge_lambda": lam} for k, lam in chosen],
            "heldout_tokens": heldout.count,
            "refit_on_all": refit,
        }
    else:
        if len(lams) != 1:
            raise ValueError(f"give one ridge_lambda, or several with 'auto' among them to pick one; got {lams}")
        chosen = [(k, lams[0]) for k in ks]
    final = statistics + heldout if (heldout is not None and refit) else statistics
    mappers = {}
    scores: dict[tuple[int, float], torch.Tensor] = {}  # one ranking per statistics and lambda, shared by every k

    def ranking(stats: KVStatistics, lam: float) -> torch.Tensor:
        if (id(stats), lam) not in scores:
            scores[id(stats), lam] = layer_scores(stats, lam)
        return scores[id(stats), lam]

    for k, lam in chosen:
        extra = dict(config_kwargs)
        if heldout is not None and heldout.count >= 2:
            row = heldout_rows.get((k, lam))
            if row is None:
                selections = dict(enumerate(select_layers(ranking(statistics, lam), k)))
                row = {f"heldout_r2_{kind}": heldout_r2(statistics, heldout, kind, selections, lam) for kind in ("key", "value")}
            extra.setdefault("heldout_r2_key", row["heldout_r2_key"])
            extra.setdefault("heldout_r2_value", row["heldout_r2_value"])
        mapper = solve_mapper(final, top_k=k, ridge_lambda=lam, dtype=dtype, scores=ranking(final, lam), **extra)
        if model_selection is not None:
            mapper.report["model_selection"] = model_selection
        if heldout is not None:
            mapper.config.calibration.update(
                heldout_tokens=heldout.count, fit_tokens=statistics.count, refit_on_all=refit
            )
        mappers[mapper_name(k)] = mapper
    return mappers


def fit_mapper(
    source: PreTrainedModel,
    target: PreTrainedModel,
    calibration_input_ids: torch.Tensor | Iterable | str | os.PathLike | None = None,
    top_k: int | str | Sequence | None = 4,
    ridge_lambda: float | str | Sequence = 0.01,
    stride: int = 4,
    batch_size: int = 8,
    attention_mask: torch.Tensor | None = None,
    progress: bool = True,
    *,
    tokenizer=None,
    dataset_config: str | None = None,
    split: str = "train",
    text_field: str = "text",
    num_sequences: int = 500,
    seq_len: int = 1024,
    heldout_fraction: float = 0.0,
    refit: bool = True,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 64,
    statistics_dir: str | os.PathLike | None = None,
    statistics_device: torch.device | str | None = None,
    two_stage: bool = False,
    probe_tokens: int = 8192,
    mapper_type: str = "ridge",
    **config_kwargs: Any,
) -> KVMapper | dict[str, KVMapper]:
    """Fit a closed-form ridge mapper from `source`'s KV cache to `target`'s.

    One pass over the calibration tokens through both models collects sufficient statistics; the top-k
    source layers per target layer are picked by single-source R^2 and each target layer is solved in
    closed form. To try other `top_k` / `ridge_lambda` without running the models again, use
    `collect_statistics` + `solve_mapper` (or keep `statistics_dir` and `KVStatistics.load` it).

    Args:
        source, target: causal LMs of one family sharing a tokenizer.
        calibration_input_ids: `[num_sequences, seq_len]` token ids, an iterable of batches, or a dataset:
            a Hub dataset id (streamed) or a local `.txt`/`.jsonl`/`.parquet` file or directory, packed by
            `calibration.build_calibration` with `tokenizer` (required then), `dataset_config`, `split`,
            `text_field`, `num_sequences`, `seq_len`.
        top_k: source layers per target layer: an int, `"all"`, several (`"1,2,all"` or a list: returns a
            dict of mappers from one pass) or `"auto"` (pick by held-out R^2; needs `heldout_fraction`).
        ridge_lambda: ridge penalty (default 0.01, as in the paper), or `"auto"`.
        stride: use every `stride`-th token (default 4).
        heldout_fraction: share of the sequences held out for out-of-sample R^2 (and `"auto"`); with
            `refit=True` the final weights use all sequences.
        checkpoint_dir, checkpoint_every: save partial statistics every N sequences; a call with the same
            arguments resumes from them.
        statistics_dir: also save the final statistics there (`train/`, `heldout/`) for later refits.
        statistics_device: where the sums live (default: the target's GPU when they fit, else CPU).
        two_stage, probe_tokens: bounded-memory mode (see `accumulate_statistics`), keeping blocks for the
            largest integer `top_k` asked for.
        mapper_type: `"ridge"` (closed form) or `"mlp"`: `mlp.fit_mlp_mapper` with the MLP's hyper-parameters
            in `config_kwargs` (`hidden_size`, `epochs`, `lr`, `mlp_batch_size`, ...); it always holds out
            sequences for early stopping (`heldout_fraction`, default 0.1 there).

    Returns:
        A `KVMapper` (float32) with per-layer fit R^2 in `mapper.config`, or `{name: KVMapper}` when several
        `top_k` were given (names from `mapper_name`: `k1`, `kall`, ...).

    Example:
        ```python
        mapper = fit_mapper(source, target, calibration_ids, top_k=4)
        mapper.save_pretrained("mappers/small-to-large")
        mappers = fit_mapper(source, target, "corpus.txt", tokenizer=tok, num_sequences=64, seq_len=256,
                             top_k="1,2,all", heldout_fraction=0.1)
        ```
    """
    for which, model in (("source", source), ("target", target)):
        name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
        if name:
            config_kwargs.setdefault(f"{which}_model_id", name)
    calibration_info: dict[str, Any] = {}
    if isinstance(calibration_input_ids, (str, os.PathLike)):
        if tokenizer is None:
            raise ValueError("fitting from a dataset needs the models' tokenizer: pass tokenizer=")
        from .calibration import build_calibration

        calibration_input_ids, calibration_info = build_calibration(
            tokenizer, calibration_input_ids, dataset_config, split, text_field, num_sequences, seq_len
        )
    elif calibration_input_ids is None:
        raise ValueError("pass calibration data: token ids [num_sequences, seq_len] or a dataset id / local path")
    if mapper_type == "mlp":
        from .mlp import fit_mlp_mapper

        if checkpoint_dir is not None or statistics_dir is not None:
            raise ValueError("checkpoint_dir / statistics_dir are not supported with mapper_type='mlp'; drop them")
        if "mlp_batch_size" in config_kwargs:  # `batch_size` here is the calibration batch
            config_kwargs["batch_size"] = config_kwargs.pop("mlp_batch_size")
        config_kwargs.setdefault("calibration", calibration_info)
        return fit_mlp_mapper(
            source, target, calibration_input_ids, top_k=top_k, ridge_lambda=ridge_lambda, stride=stride,
            calibration_batch_size=batch_size, attention_mask=attention_mask, progress=progress,
            heldout_fraction=heldout_fraction or 0.1, **config_kwargs,
        )  # fmt: skip
    if mapper_type != "ridge":
        raise ValueError(f"mapper_type must be 'ridge' or 'mlp', got {mapper_type!r}")
    if calibration_info:
        calibration_info["stride"] = stride
    several = len(parse_top_k(top_k)) > 1 and "auto" not in parse_top_k(top_k)
    simple = (
        not isinstance(calibration_input_ids, torch.Tensor)
        or (
            heldout_fraction == 0 and checkpoint_dir is None and statistics_dir is None and statistics_device is None
            and not two_stage
        )
    )
    if simple and not isinstance(calibration_input_ids, torch.Tensor) and (heldout_fraction or checkpoint_dir):
        raise ValueError("heldout_fraction and checkpoint_dir need a token tensor or a dataset, not an iterable of batches")
    if simple:
        stats = collect_statistics(
            source, target, calibration_input_ids, attention_mask=attention_mask, stride=stride,
            batch_size=batch_size, progress=progress,
        )
        heldout = None
    else:
        ids = calibration_input_ids if calibration_input_ids.ndim == 2 else calibration_input_ids.unsqueeze(0)
        num_heldout = heldout_count(ids.shape[0], heldout_fraction)
        stats, heldout = accumulate_statistics(
            source, target, ids, attention_mask=attention_mask, stride=stride, batch_size=batch_size,
            num_heldout=num_heldout, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
            statistics_device=statistics_device, progress=progress,
            metadata={"calibration": calibration_info} if calibration_info else None,
            two_stage=two_stage, probe_tokens=probe_tokens,
            max_top_k=max([k for k in parse_top_k(top_k) if isinstance(k, int)] or [8]),
        )
        if statistics_dir is not None and _dist_info()[0] == 0:
            stats.save(Path(statistics_dir) / "train")
            if heldout is not None:
                heldout.save(Path(statistics_dir) / "heldout")
    if calibration_info:
        stats.metadata["calibration"] = calibration_info
    mappers = solve_mappers(stats, heldout, top_k=top_k, ridge_lambda=ridge_lambda, refit=refit, **config_kwargs)
    return mappers if several else next(iter(mappers.values()))


def heldout_count(num_sequences: int, heldout_fraction: float) -> int:
    """Sequences held out for a fraction: at least one when the fraction is positive, never all of them."""
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    if heldout_fraction == 0:
        return 0
    count = max(1, round(num_sequences * heldout_fraction))
    if count >= num_sequences:
        raise ValueError(f"heldout_fraction {heldout_fraction} leaves no sequence to fit on ({num_sequences} in all)")
    return count


# -- the `hf-kvtransfer fit` workflow: model ids in, mapper directories out ---------------------------------


def _init_distributed() -> tuple[int, int, int, bool]:
    """Join the process group torchrun / accelerate launch describe in the environment (gloo on CPU, nccl on GPU)."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world <= 1 or not dist.is_available():
        return 0, 1, local_rank, False
    created = False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
        created = True
    return dist.get_rank(), dist.get_world_size(), local_rank, created


def _parse_dtype(dtype: str | torch.dtype | None):
    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype or "auto"
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}  # fmt: skip
    if dtype not in names:
        raise ValueError(f"dtype must be one of auto, {', '.join(names)}; got {dtype!r}")
    return names[dtype]


def _load_tokenizer(name: str, which: str, revision, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises OSError/ValueError/EnvironmentError variants
        raise OSError(f"could not load the {which} tokenizer from {name!r}: {exc}") from exc


def _load_model(name: str, which: str, revision, dtype, device_map, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"revision": revision, "dtype": dtype, "trust_remote_code": trust_remote_code}
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except Exception as exc:
        raise OSError(f"could not load the {which} model from {name!r}: {exc}") from exc
    return model.eval()


def _available_memory(device: torch.device) -> int:
    """Free bytes where statistics would live (GPU free memory, or available RAM)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _replace_directory(tmp: Path, output: Path, overwrite: bool) -> None:
    """Move a finished temp directory into place; the old one (with `overwrite`) goes only after that."""
    if output.exists():
        if not overwrite:
            raise FileExistsError(f"{output} already exists; pass --overwrite (overwrite=True) or choose another --output")
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        os.rename(output, old)
        os.rename(tmp, output)
        import shutil

        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, output)


def _write_mappers(
    mappers: dict[str, KVMapper], output: Path, several: bool, overwrite: bool, push_to_hub: str | None, log
) -> list[tuple[Path, KVMapper]]:
    """Save mappers under `output` (one subdirectory each when `several`) all at once: written to a temp
    directory and renamed into place, so a failure leaves no half-written mapper. Optionally push the first."""
    import shutil

    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    results = []
    try:
        for name, mapper in mappers.items():
            mapper.save_pretrained(tmp / name if several else tmp, repo_id=push_to_hub)
            results.append((output / name if several else output, mapper))
        output.parent.mkdir(parents=True, exist_ok=True)
        _replace_directory(tmp, output, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if push_to_hub:
        url = results[0][1].push_to_hub(push_to_hub)
        log(f"pushed to {url}")
    return results


def _rank_kwargs(low_rank: str | int | None, mapper_type: str = "ridge") -> dict[str, Any]:
    """`solve_mapper` keywords for a `--rank` spec (an integer rank, energy=F or budget=F); {} for full rank."""
    if low_rank is None:
        return {}
    from .lowrank import parse_rank_spec

    kwargs = parse_rank_spec(str(low_rank))
    if "dtype" in kwargs or not kwargs:
        raise ValueError(f"rank {low_rank!r}: give an integer rank, energy=F or budget=F (the weight dtype is --mapper-dtype)")
    if mapper_type != "ridge":
        raise ValueError("a reduced rank applies to ridge mappers; drop --rank or --mapper mlp")
    return kwargs


def _mapper_dtype(mapper_dtype: str | torch.dtype) -> torch.dtype:
    dtype = _parse_dtype(mapper_dtype)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"mapper_dtype must be float32, bfloat16 or float16, got {mapper_dtype!r}")
    return dtype


def solve_and_save(
    stats_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    top_k: int | str | Sequence | None = 8,
    ridge_lambda: float | str | Sequence = 0.01,
    refit: bool = True,
    low_rank: str | int | None = None,
    mapper_dtype: str | torch.dtype = torch.float32,
    push_to_hub: str | None = None,
    overwrite: bool = False,
    log=None,
) -> list[tuple[Path, KVMapper]]:
    """What `hf-kvtransfer solve` does: mappers from statistics a fit kept (`--stats-dir`), without the models.

    Any k, lambda, rank or weight dtype is solved from `stats_dir/train` (and `stats_dir/heldout` when the fit
    held sequences out: held-out R^2 per layer, `"auto"`, and the refit on all sequences, as `fit` does).
    """
    log = log or logger.info
    stats_dir, output = Path(stats_dir), Path(output_dir)
    if not (stats_dir / "train").exists():
        raise FileNotFoundError(
            f"{stats_dir} holds no statistics ({stats_dir / 'train'} is missing); write them with "
            "`hf-kvtransfer fit ... --stats-dir DIR`"
        )
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite (overwrite=True) or choose another --output")
    ks = parse_top_k(top_k)
    parse_ridge_lambda(ridge_lambda)
    kwargs = _rank_kwargs(low_rank)
    dtype = _mapper_dtype(mapper_dtype)
    train = KVStatistics.load(stats_dir / "train")
    heldout = KVStatistics.load(stats_dir / "heldout") if (stats_dir / "heldout").exists() else None
    mappers = solve_mappers(train, heldout, top_k=top_k, ridge_lambda=ridge_lambda, refit=refit, dtype=dtype, **kwargs)
    several = len(ks) > 1 and "auto" not in ks
    return _write_mappers(mappers, output, several, overwrite, push_to_hub, log)


def fit_and_save(
    source: str | os.PathLike,
    target: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    dataset: str | os.PathLike | None = None,
    dataset_config: str | None = None,
    split: str = "train",
    text_field: str = "text",
    num_sequences: int = 500,
    seq_len: int = 1024,
    stride: int = 4,
    top_k: int | str | Sequence | None = 8,
    ridge_lambda: float | str | Sequence = 0.01,
    batch_size: int = 8,
    dtype: str | torch.dtype | None = "auto",
    device_map: str | dict | None = None,
    source_revision: str | None = None,
    target_revision: str | None = None,
    heldout_fraction: float = 0.1,
    refit: bool = True,
    stats_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 64,
    statistics_device: str | None = None,
    push_to_hub: str | None = None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    two_stage: bool | None = None,
    probe_tokens: int = 8192,
    max_statistics_memory: float | None = None,
    progress: bool = True,
    log=None,
    mapper_type: str = "ridge",
    mlp_kwargs: dict[str, Any] | None = None,
    low_rank: str | int | None = None,
    mapper_dtype: str | torch.dtype = torch.float32,
) -> list[tuple[Path, KVMapper]]:
    """What `hf-kvtransfer fit` does: load both models, pack calibration data, accumulate, solve, write.

    Defaults follow the paper (FineWeb-Edu sample-10BT, 500 x 1024 tokens, stride 4, k = 8, lambda = 0.01),
    plus a 10% held-out shard for out-of-sample R^2 (the final weights are refit on all sequences). Partial
    statistics are checkpointed in `stats_dir/checkpoints` (or a hidden directory next to `output_dir`), so
    rerunning the same call resumes; the mapper directory appears only when complete (temp dir + rename).
    Under torchrun / accelerate launch each rank takes a disjoint shard and rank 0 writes.

    Args:
        source, target: model ids or local directories (`AutoModelForCausalLM` / `AutoTokenizer`).
        output_dir: where the mapper goes; with several `top_k`, one subdirectory per k (`k1`, `kall`, ...).
        two_stage: bounded-memory mode (see `accumulate_statistics`); None = automatic, when the full
            statistics exceed `max_statistics_memory` GiB (default: half the free memory where they would live).
            It keeps blocks for the largest k asked for (8 for a bare 'auto'); 'all' needs the full mode.
        log: a callable taking one line of text for the few facts a person should see (default: logger.info).
        low_rank: a reduced-rank ridge mapper (`lowrank.py`): an integer rank, "energy=F" or "budget=F"
            (`hf-kvtransfer fit --rank`); None for full rank.
        mapper_dtype: the mapper's weight dtype (bfloat16 halves the file, and transfers then run bf16 GEMMs).

    Returns:
        `[(directory, mapper), ...]` on rank 0; `[]` on other ranks.
    """
    from .calibration import DEFAULT_DATASET, DEFAULT_DATASET_CONFIG, build_calibration

    log = log or logger.info
    if dataset is None:
        dataset, dataset_config = DEFAULT_DATASET, dataset_config or DEFAULT_DATASET_CONFIG
    output = Path(output_dir)
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite (overwrite=True) or choose another --output")
    ks = parse_top_k(top_k)
    parse_ridge_lambda(ridge_lambda)  # fail on a typo before loading any model
    mapper_dtype = _mapper_dtype(mapper_dtype)
    rank_kwargs = _rank_kwargs(low_rank, mapper_type)
    several = len(ks) > 1 and "auto" not in ks
    if push_to_hub and several:
        raise ValueError(f"--push-to-hub publishes one mapper, but top_k asks for {len(ks)}; give one k (or 'auto')")
    rank, world, local_rank, created = _init_distributed()
    try:
        if device_map is None and torch.cuda.is_available():
            device_map = {"": local_rank if world > 1 else torch.cuda.current_device()}
        torch_dtype = _parse_dtype(dtype)
        # Cheap checks first (tokenizers, data), so a typo fails before two large models are loaded.
        src_tok = _load_tokenizer(str(source), "source", source_revision, trust_remote_code)
        tgt_tok = _load_tokenizer(str(target), "target", target_revision, trust_remote_code)
        check_tokenizers(src_tok, tgt_tok)
        input_ids, info = build_calibration(src_tok, dataset, dataset_config, split, text_field, num_sequences, seq_len)
        info["stride"] = stride
        src_model = _load_model(str(source), "source", source_revision, torch_dtype, device_map, trust_remote_code)
        tgt_model = _load_model(str(target), "target", target_revision, torch_dtype, device_map, trust_remote_code)
        check_pair(src_model, tgt_model)
        num_source = text_config(src_model.config).num_hidden_layers
        for k in ks:
            if isinstance(k, int) and not 1 <= k <= num_source:
                raise ValueError(f"top_k {k} is out of range: the source has {num_source} layers (use 1..{num_source} or 'all')")
        num_heldout = heldout_count(input_ids.shape[0], heldout_fraction)
        src_layout, tgt_layout = KVLayout.from_config(src_model.config), KVLayout.from_config(tgt_model.config)
        nbytes = statistics_nbytes(src_layout, tgt_layout) * (2 if num_heldout else 1)
        device = torch.device(statistics_device) if statistics_device else _default_statistics_device(tgt_model, nbytes)
        budget = max_statistics_memory * 2**30 if max_statistics_memory else _available_memory(device) // 2
        ints = [k for k in ks if isinstance(k, int)]
        max_top_k = max(ints) if ints else 8
        if two_stage is None:
            two_stage = nbytes > budget and None not in ks
        if two_stage and None in ks:
            raise ValueError("top_k 'all' needs the full statistics; drop 'all' or run without two_stage")
        if rank == 0:
            log(
                f"calibration: {input_ids.shape[0]} x {seq_len} tokens from {dataset} "
                f"({num_heldout} held out; every {stride}th token used; {world} process{'es' if world > 1 else ''})"
            )
            log(statistics_memory_line(src_layout, tgt_layout, torch.float64, device, bool(num_heldout)))
            if nbytes > budget:
                log(f"full statistics exceed the budget of {budget / 2**30:.2g} GiB")
            if two_stage:
                blocks = block_statistics_nbytes(src_layout, tgt_layout, max_top_k) * (2 if num_heldout else 1)
                log(
                    f"two-stage mode: probe on {probe_tokens} tokens, then only the blocks of the top {max_top_k} "
                    f"source layers per target layer: at most {blocks / 2**20:,.1f} MiB"
                )
        checkpoint_dir = Path(stats_dir) / "checkpoints" if stats_dir else output.with_name(f".{output.name}.fit-checkpoint")
        metadata = {
            "calibration": info,
            "source_model_id": str(source),
            "target_model_id": str(target),
            "source_revision": source_revision,
            "target_revision": target_revision,
        }
        if mapper_type == "mlp":
            from .mlp import fit_mlp_mapper

            if world > 1:
                raise ValueError("the MLP mapper trains in one process: run `fit --mapper mlp` without torchrun")
            mlp_mapper = fit_mlp_mapper(
                src_model, tgt_model, input_ids, top_k=top_k, ridge_lambda=ridge_lambda, stride=stride,
                calibration_batch_size=batch_size, heldout_fraction=heldout_fraction or 0.1, progress=progress,
                **metadata, **(mlp_kwargs or {}),
            )  # fmt: skip
        else:
            train, heldout = accumulate_statistics(
                src_model, tgt_model, input_ids, stride=stride, batch_size=batch_size, num_heldout=num_heldout,
                checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, statistics_device=device,
                metadata=metadata, progress=progress, two_stage=bool(two_stage), probe_tokens=probe_tokens,
                max_top_k=max_top_k,
            )
        del src_model, tgt_model
        results: list[tuple[Path, KVMapper]] = []
        if rank == 0:
            if mapper_type == "mlp":
                mappers = {"mlp": mlp_mapper}
            else:
                if stats_dir:
                    train.save(Path(stats_dir) / "train")
                    if heldout is not None:
                        heldout.save(Path(stats_dir) / "heldout")
                mappers = solve_mappers(
                    train, heldout, top_k=top_k, ridge_lambda=ridge_lambda, refit=refit, dtype=mapper_dtype, **rank_kwargs
                )
            results = _write_mappers(mappers, output, several, overwrite, push_to_hub, log)
            remove_checkpoints(checkpoint_dir)
        if world > 1:
            import torch.distributed as dist

            dist.barrier()
        return results
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()
