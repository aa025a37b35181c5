"""Ridge sufficient statistics from the one calibration pass: full or two-stage, checkpointed, distributed.

`StatisticsAccumulator` is the `calibration_pass.calibration_pass` consumer both fitters use; `run_fit_pass` runs the
pass as a `FitConfig` describes it (held-out shard, device, two-stage decision, checkpoints, kept statistics),
`accumulate_statistics` / `collect_statistics` are the lower-level entry points.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from ..core.loading import model_device
from ..core.options import with_options
from ..core.ridge import probe_single_source_r2, select_layers
from ..core.rope import text_config
from ..core.stats import (
    KINDS,
    BlockStatistics,
    KVLayout,
    KVStatistics,
    block_statistics_nbytes,
    flatten_layers,
    statistics_from_state,
    statistics_nbytes,
    token_selection,
)
from .calibration_pass import (
    CalibrationBatch,
    CalibrationConsumer,
    as_token_tensor,
    calibration_pass,
    check_pair,
    dist_info,
    read_checkpoint_state,
)
from .budget import StatisticsBudget, statistics_budget
from .config import FitConfig, heldout_count

logger = logging.getLogger(__name__)


def statistics_memory_line(
    source_layout: KVLayout, target_layout: KVLayout, dtype: torch.dtype, device, heldout: bool = False
) -> str:
    """The line printed before a fit: the statistics' size and where they live.

    Per kind (K and V) the statistics hold (L_s n_s d_s)^2 + (L_s n_s d_s)(L_t n_t d_t) numbers: the source features'
    Gram matrix and their cross products with the target's (L layers, n KV heads of dim d).
    """
    ds, dt = source_layout.total_dim, target_layout.total_dim
    nbytes = statistics_nbytes(source_layout, target_layout, dtype) * (2 if heldout else 1)
    return (
        f"statistics: 2 x ({ds}^2 + {ds}x{dt} + {ds} + 2x{dt}) {str(dtype).replace('torch.', '')} "
        f"{'x 2 (fit + held-out shard) ' if heldout else ''}= {nbytes / 2**20:,.1f} MiB on {device}"
    )


def default_statistics_device(model: PreTrainedModel, nbytes: int) -> torch.device:
    """The model's GPU when the statistics take under half of its free memory, else the CPU."""
    device = model_device(model)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if nbytes < free // 2:
            return device
        logger.warning("statistics (%.1f GiB) do not fit next to the model on %s; accumulating on CPU", nbytes / 2**30, device)
    return torch.device("cpu")


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


class StatisticsAccumulator:
    """Ridge sufficient statistics of the fit shard (and the held-out shard), full or two-stage.

    Two-stage (bounded memory): the first `probe_tokens` fit tokens are kept as features and rank
    source layers by single-source R^2 at *every* lambda in `ridge_lambdas` (the ones the solve may use); then
    only the Gram/cross blocks of each target layer's top-`max_top_k` layers under any of those rankings are
    accumulated (`BlockStatistics`). Under torch.distributed, rank 0's probe decides for all ranks.

    After the pass: `.train` and `.heldout` (None without a held-out shard) hold the statistics of the whole
    sample on every rank.
    """

    name = "statistics"
    checkpointable = True

    def __init__(
        self,
        source: PreTrainedModel,
        target: PreTrainedModel,
        *,
        stride: int = 4,
        heldout: bool = False,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float64,
        product_dtype: torch.dtype | None = None,
        metadata: dict[str, Any] | None = None,
        two_stage: bool = False,
        probe_tokens: int = 8192,
        max_top_k: int | None = 8,
        ridge_lambdas: Sequence[float] = (0.01,),
        statistics: KVStatistics | None = None,
        group=None,
    ):
        self.source_layout, self.target_layout = KVLayout.from_config(source.config), KVLayout.from_config(target.config)
        self.source_config, self.target_config = text_config(source.config).to_dict(), text_config(target.config).to_dict()
        self.stride, self.dtype, self.device = stride, dtype, torch.device(device)
        self.metadata = dict(metadata or {})
        self.two_stage, self.probe_tokens, self.group = two_stage, probe_tokens, group
        num_source = self.source_layout.num_layers
        self.max_top_k = num_source if max_top_k is None else min(max_top_k, num_source)
        self.ridge_lambdas = sorted({float(v) for v in ridge_lambdas})
        if two_stage and not self.ridge_lambdas:
            raise ValueError("a two-stage fit needs the ridge lambda(s) its layer ranking will be used with")
        # float64 GEMMs are slow on most GPUs: multiply per-batch centered float32 there (see KVStatistics._add).
        self.product_dtype = product_dtype or (torch.float32 if self.device.type == "cuda" else dtype)
        self.train: KVStatistics | None = None
        self.heldout: KVStatistics | None = None
        self._heldout_wanted = heldout
        self.probe: dict[str, tuple[list, list]] | None = None
        self.probe_count = 0
        if two_stage:
            self.probe = {kind: ([], []) for kind in KINDS}
        else:
            self.train = statistics if statistics is not None else self._fresh()
            self.heldout = self._fresh() if heldout else None
            self._prepare(self.train, self.heldout)

    def nbytes(self) -> int:
        """Upper bound of the statistics' bytes (both shards)."""
        if self.two_stage:
            one = block_statistics_nbytes(self.source_layout, self.target_layout, self.max_top_k, self.dtype)
            # selections chosen under several lambdas may keep more blocks than one ranking would
            one *= min(len(self.ridge_lambdas), max(1, self.source_layout.num_layers // self.max_top_k))
        else:
            one = statistics_nbytes(self.source_layout, self.target_layout, self.dtype)
        return one * (2 if self._heldout_wanted else 1)

    def _fresh(self) -> KVStatistics:
        return KVStatistics(
            self.source_layout, self.target_layout, self.source_config, self.target_config,
            metadata=self.metadata, dtype=self.dtype, device=self.device,
        )  # fmt: skip

    def _prepare(self, *stats: KVStatistics | None) -> None:
        for s in stats:
            if s is not None:
                s.metadata.update(self.metadata)
                s.metadata["stride"] = self.stride
                s.product_dtype = self.product_dtype

    def run_key(self) -> dict[str, Any]:
        """What must match for a checkpoint to be resumed."""
        return {
            "statistics_dtype": str(self.dtype),
            "two_stage": {"probe_tokens": self.probe_tokens, "max_top_k": self.max_top_k, "lambdas": self.ridge_lambdas}
            if self.two_stage
            else None,
        }

    @property
    def ready(self) -> bool:
        """False while the two-stage probe is still collecting tokens (nothing to checkpoint yet)."""
        return self.probe is None

    def update(self, batch: CalibrationBatch) -> None:
        if self.probe is not None and batch.part != "train":
            self.end_of_data()
        if self.probe is None:
            stats = self.train if batch.part == "train" else self.heldout
            stats.update(
                batch.source_keys, batch.source_values, batch.target_keys, batch.target_values,
                attention_mask=batch.attention_mask, stride=self.stride,
            )  # fmt: skip
            return
        sk = batch.source_keys
        index = token_selection(len(batch.rows), sk[0].shape[2], self.stride, batch.attention_mask, sk[0].device)
        for kind in KINDS:
            xs, ys = batch.states(kind)
            x, y = flatten_layers(xs, index), flatten_layers(ys, index.to(ys[0].device))
            if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
                raise ValueError(f"non-finite {kind} states in a calibration batch (NaN/inf from the model)")
            self.probe[kind][0].append(x.to(self.device))
            self.probe[kind][1].append(y.to(self.device))
        self.probe_count += int(index.numel())
        if self.probe_count >= self.probe_tokens:
            self.end_of_data()

    def end_of_data(self) -> None:
        """Close the two-stage probe (at the end of the fit shard, or once it has `probe_tokens` tokens)."""
        if self.probe is None:
            return
        rank, world = dist_info(self.group)
        features = {kind: (torch.cat(xs), torch.cat(ys)) if xs else None for kind, (xs, ys) in self.probe.items()}
        scores = None
        if rank == 0:
            if self.probe_count < 2:
                raise ValueError(f"the two-stage probe got {self.probe_count} tokens; raise probe_tokens or the data size")
            scores = {
                lam: probe_single_source_r2(features, self.source_layout, self.target_layout, lam)["mean"]
                for lam in self.ridge_lambdas
            }
        if world > 1:
            import torch.distributed as dist

            box = [scores]
            dist.broadcast_object_list(box, src=0, group=self.group)
            scores = box[0]
        # Keep the blocks every probed lambda's top-k needs, so each of them selects as the full statistics would.
        per_lambda = [select_layers(s, self.max_top_k) for s in scores.values()]
        selections = [sorted(set().union(*(sel[t] for sel in per_lambda))) for t in range(self.target_layout.num_layers)]

        def blocks() -> BlockStatistics:
            return BlockStatistics(
                self.source_layout, self.target_layout, selections, scores, self.source_config, self.target_config,
                metadata=self.metadata, dtype=self.dtype, device=self.device, max_top_k=self.max_top_k,
            )  # fmt: skip

        self.train = blocks()
        self.heldout = blocks() if self._heldout_wanted else None
        if self.probe_count:
            for kind, (x, y) in features.items():
                self.train.add_features(kind, x, y)
        self.train.count = self.probe_count
        self._prepare(self.train, self.heldout)
        for s in (self.train, self.heldout):
            if s is not None:
                s.metadata["two_stage"] = {"probe_tokens": self.probe_count, "max_top_k": self.max_top_k}
        self.probe = None
        logger.info(
            "two-stage probe on %d tokens chose blocks: %.1f MiB of statistics", self.probe_count, self.train.nbytes() / 2**20
        )

    def finish(self) -> None:
        """Sum over `torch.distributed` ranks (every rank then holds the statistics of the whole sample)."""
        _, world = dist_info(self.group)
        if world > 1:
            self.train.all_reduce(self.group)
            if self.heldout is not None:
                self.heldout.all_reduce(self.group)

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"train.{k}": v.detach().cpu().contiguous() for k, v in self.train.tensors.items()}
        if self.heldout is not None:
            tensors.update({f"heldout.{k}": v.detach().cpu().contiguous() for k, v in self.heldout.tensors.items()})
        meta = {"train": self.train.meta(), "heldout": self.heldout.meta() if self.heldout is not None else None}
        return tensors, meta

    def load_checkpoint_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], where: str) -> None:
        self.train, self.heldout = statistics_from_checkpoint(tensors, meta, where)
        self.probe = None
        self._prepare(self.train, self.heldout)


def statistics_from_checkpoint(tensors, meta, where) -> tuple[KVStatistics, KVStatistics | None]:
    train = statistics_from_state({k[6:]: v for k, v in tensors.items() if k.startswith("train.")}, meta["train"], where)
    heldout = None
    if meta.get("heldout") is not None:
        part = {k[8:]: v for k, v in tensors.items() if k.startswith("heldout.")}
        heldout = statistics_from_state(part, meta["heldout"], where)
    return train, heldout




def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """What a checkpoint of `calibration_pass` holds: `run` (the options it belongs to), `done` (sequences of
    this rank already through the pass) and, when a `StatisticsAccumulator` wrote it, `train` / `heldout`."""
    meta, tensors = read_checkpoint_state(path)
    out = {"run": meta["run"], "done": int(meta["done"])}
    if "statistics" in meta["consumers"]:
        prefix = "statistics/"
        state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        out["train"], out["heldout"] = statistics_from_checkpoint(state, meta["consumers"]["statistics"], str(path))
    return out


@dataclass(frozen=True)
class AccumulationOptions:
    """How `accumulate_statistics` runs its calibration pass and keeps its sums; each field is also accepted as a
    keyword of `accumulate_statistics`.

    Args:
        stride, batch_size, num_heldout, checkpoint_dir, checkpoint_every, progress: the pass (`calibration_pass`).
        statistics_device: where the sums live; default the model's GPU when they fit, else the CPU.
        statistics_dtype: dtype of the sums.
        product_dtype: dtype of the per-batch products; float32 = per-batch centering + float64 merge
            (default on CUDA), else exact products in `statistics_dtype` (default on CPU).
        metadata: recorded on the statistics.
        two_stage, probe_tokens, max_top_k, ridge_lambdas: bounded-memory mode (`StatisticsAccumulator`); any
            k <= max_top_k can then be solved, at any of `ridge_lambdas`.
    """

    stride: int = 4
    batch_size: int = 8
    num_heldout: int = 0
    checkpoint_dir: str | os.PathLike | None = None
    checkpoint_every: int = 64
    statistics_device: torch.device | str | None = None
    statistics_dtype: torch.dtype = torch.float64
    product_dtype: torch.dtype | None = None
    metadata: dict[str, Any] | None = None
    progress: bool = True
    two_stage: bool = False
    probe_tokens: int = 8192
    max_top_k: int | None = 8
    ridge_lambdas: Sequence[float] = (0.01,)


def accumulate_statistics(
    source: PreTrainedModel,
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    options: AccumulationOptions | None = None,
    *,
    group=None,
    consumers: Sequence[CalibrationConsumer] = (),
    statistics: KVStatistics | None = None,
    log: Callable[[str], None] | None = None,
    **keywords: Any,
) -> tuple[KVStatistics, KVStatistics | None]:
    """Fit (and held-out) statistics over a fixed token sample: `calibration_pass` with a `StatisticsAccumulator`
    (plus any other `consumers` riding along). Resumable and distributed, see `calibration_pass`.

    Args:
        options: `AccumulationOptions`; its fields may also be given as keywords (`stride=1`), which override it.
        group: the process group of a distributed pass.
        consumers: other calibration consumers riding the same pass.
        statistics: existing fit statistics to add to (full mode only).
        log: where the line with the statistics' memory goes (default: `logger.info`).

    Returns:
        `(fit_statistics, heldout_statistics or None)`.
    """
    o = with_options(AccumulationOptions, options, keywords, "accumulate_statistics")
    check_pair(source, target)
    src_layout, tgt_layout = KVLayout.from_config(source.config), KVLayout.from_config(target.config)
    heldout = bool(o.num_heldout)
    if statistics is not None:
        device = statistics.device
    elif o.statistics_device is not None:
        device = torch.device(o.statistics_device)
    else:
        nbytes = statistics_nbytes(src_layout, tgt_layout, o.statistics_dtype) * (2 if heldout else 1)
        device = default_statistics_device(target, nbytes)
    accumulator = StatisticsAccumulator(
        source, target, stride=o.stride, heldout=heldout, device=device, dtype=o.statistics_dtype,
        product_dtype=o.product_dtype, metadata=o.metadata, two_stage=o.two_stage, probe_tokens=o.probe_tokens,
        max_top_k=o.max_top_k, ridge_lambdas=o.ridge_lambdas, statistics=statistics, group=group,
    )  # fmt: skip
    (log or logger.info)(statistics_memory_line(src_layout, tgt_layout, o.statistics_dtype, device, heldout))
    calibration_pass(
        source, target, input_ids, attention_mask, [accumulator, *consumers], stride=o.stride,
        batch_size=o.batch_size, num_heldout=o.num_heldout, checkpoint_dir=o.checkpoint_dir,
        checkpoint_every=o.checkpoint_every, progress=o.progress, group=group,
    )  # fmt: skip
    return accumulator.train, accumulator.heldout


@dataclass(frozen=True)
class KVSumsPlan:
    """Where the fit's K/V sums live and how large they get, decided once before the calibration pass
    (`plan_kv_sums`): `run_fit_pass` accumulates them so, and the map inputs' sums get what they leave of the budget
    (`residual_budget`)."""

    device: torch.device
    full_bytes: int  # the full statistics, every set (fit + held-out)
    two_stage: bool
    max_top_k: int
    budget: StatisticsBudget
    bytes: int  # what they take: the full statistics, or the two-stage blocks and probe

    def residual_budget(self) -> StatisticsBudget:
        """The budget the map inputs' sums collect within, once these sums have taken theirs."""
        return self.budget.after_kv(self.bytes, self.device)


def kv_sums_bytes(source: KVLayout, target: KVLayout, sets: int, two_stage: bool, top_k: int,
                  probe_tokens: int) -> int:  # fmt: skip
    """Bytes of the fit's K/V sums (float64, `sets` of them): the full statistics, or two-stage blocks of `top_k`
    source layers per target layer plus the probe's features (`probe_tokens` tokens of keys and values, float32,
    and one kind at a time in float64 with its centered copy while layers are ranked: `ridge.probe_single_source_r2`)."""
    if not two_stage:
        return statistics_nbytes(source, target) * sets
    width = source.total_dim + target.total_dim
    return block_statistics_nbytes(source, target, top_k) * sets + 2 * probe_tokens * width * (4 + 8)


def plan_kv_sums(source: PreTrainedModel, target: PreTrainedModel, num_sequences: int, config: FitConfig) -> KVSumsPlan:
    """The K/V sums of a fit of `config` over `num_sequences` calibration sequences: device (`config.statistics_device`,
    else the target's GPU if they fit), full or two-stage (`config.two_stage`, else two-stage past the budget), within
    the one budget rule (`budget.statistics_budget`)."""
    src, tgt = KVLayout.from_config(source.config), KVLayout.from_config(target.config)
    sets = 2 if heldout_count(num_sequences, config.heldout_fraction) else 1
    full = statistics_nbytes(src, tgt) * sets
    device = torch.device(config.statistics_device) if config.statistics_device else default_statistics_device(target, full)
    budget = statistics_budget(config.max_statistics_memory, device=device)
    two_stage = config.two_stage if config.two_stage is not None else (budget.two_stage(full) and None not in config.top_k_values)
    max_top_k = min(config.max_top_k, src.num_layers)
    taken = kv_sums_bytes(src, tgt, sets, bool(two_stage), max_top_k, config.probe_tokens)
    return KVSumsPlan(device, full, bool(two_stage), max_top_k, budget, taken)


def run_fit_pass(
    source: PreTrainedModel,
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    config: FitConfig,
    *,
    consumers: Sequence[CalibrationConsumer] = (),
    metadata: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
    group=None,
    kv: KVSumsPlan | None = None,
) -> tuple[KVStatistics, KVStatistics | None]:
    """The calibration pass as a `FitConfig` describes it: held-out shard (the last sequences), statistics device,
    full or two-stage statistics (automatic when the full ones exceed the memory budget), checkpoints in
    `config.checkpoint_dir`, statistics kept in `config.stats_dir`. Both fitters (ridge, MLP) run it; the MLP
    adds its feature collector to `consumers`. `kv`: the caller's `plan_kv_sums` (else made here).

    Returns:
        `(fit statistics, held-out statistics or None)`, summed over `torch.distributed` ranks.
    """
    log = log or logger.info
    rank, world = dist_info(group)
    num_heldout = heldout_count(input_ids.shape[0], config.heldout_fraction)
    kv = kv or plan_kv_sums(source, target, input_ids.shape[0], config)
    if rank == 0:
        if kv.budget.two_stage(kv.full_bytes):
            log(f"full statistics ({kv.full_bytes / 2**30:,.3g} GiB) exceed {kv.budget.describe('kv')}")
        if kv.two_stage:
            log(
                f"two-stage mode: probe on {config.probe_tokens} tokens, then only the blocks of the top {kv.max_top_k} "
                f"source layers per target layer: at most {kv.bytes / 2**20:,.1f} MiB with the probe's features"
            )
    train, heldout = accumulate_statistics(
        source, target, input_ids, attention_mask, stride=config.stride, batch_size=config.batch_size,
        num_heldout=num_heldout, checkpoint_dir=config.checkpoint_dir, checkpoint_every=config.checkpoint_every,
        statistics_device=kv.device, metadata=metadata, progress=config.progress, group=group, two_stage=kv.two_stage,
        probe_tokens=config.probe_tokens, max_top_k=kv.max_top_k, ridge_lambdas=config.probe_lambdas,
        consumers=consumers, log=log if rank == 0 else (lambda line: None),
    )  # fmt: skip
    if config.stats_dir and rank == 0:
        train.save(Path(config.stats_dir) / "train")
        if heldout is not None:
            heldout.save(Path(config.stats_dir) / "heldout")
    return train, heldout


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
    """Run both models over calibration tokens and accumulate `KVStatistics` (one pass, no held-out shard).

    Args:
        source, target: causal LMs of one family (same vocabulary).
        calibration_input_ids: `[num_sequences, seq_len]` ids, or an iterable of such batches (tensors or
            dicts with `input_ids` / `attention_mask`).
        stride: use every `stride`-th token of each sequence (paper: 4).
        statistics: existing statistics to add to (e.g. a resumed run); a new object otherwise.

    Returns:
        The statistics; pass them to `solve_mapper` for any `top_k` / `ridge_lambda`.

    Example:
        ```python
        stats = collect_statistics(source, target, calibration_ids, stride=4)
        mapper = solve_mapper(stats, top_k=4)
        ```
    """
    ids, mask = as_token_tensor(calibration_input_ids, attention_mask)
    train, _ = accumulate_statistics(
        source, target, ids, mask, stride=stride, batch_size=batch_size, progress=progress, statistics=statistics,
        statistics_device="cpu" if statistics is None else None,
    )  # fmt: skip
    return train


__all__ = [
    "AccumulationOptions",
    "KVSumsPlan",
    "StatisticsAccumulator",
    "accumulate_statistics",
    "collect_statistics",
    "default_statistics_device",
    "kv_sums_bytes",
    "new_statistics",
    "plan_kv_sums",
    "read_checkpoint",
    "run_fit_pass",
    "statistics_from_checkpoint",
    "statistics_memory_line",
]
