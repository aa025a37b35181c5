"""Sufficient statistics and the closed-form solve of maps that also read the target's residual stream.

A consumer of the one calibration pass (`calibration_pass`): for each candidate `residual_layer` J it sums, in
float64, the Gram matrix of `[source K (resp. V) of every source layer, residual features entering target layer J]`
and its cross products with every target layer's keys (before the key norm, for a target that has one: Qwen3's
`k_norm`) and values. `solve_residual_mapper` then turns a source-only mapper into one whose layers after J read
both, for any J collected, from those sums alone (no second pass): the same top-k source selection, one ridge
solve per layer and kind on standardised inputs (`residual_lambda` is relative to unit-variance features), and
optionally one reduced-rank projection of the residual block shared by every layer (`residual_rank`: reduced-rank
regression, the combinations of the residual features that carry the most of what the full-rank maps predict).

Memory: per candidate J and kind, `(F_s + F_r)^2 + (F_s + F_r) * L_t * n_kv_t * d_t` float64 numbers, with
`F_s = L_s * n_kv_s * d_s` and `F_r = len(lags) * hidden_size` (`residual_statistics_nbytes`). With
`source_features=False` the sums hold the residual features alone (`F_s = 0`): enough for the maps that read no
source layer, and what the fit collects where a pair's source K/V would make the sums too large (a real pair's
`F_s` is tens of thousands of features). With `directions=r` the residual features enter the sums through
`len(lags) * r` directions instead (`F_r = len(lags) * r`): those that carry the most of what a ridge on the residual
predicts of the keys and values its maps predict (reduced-rank regression on the first calibration batch, one set
per residual layer, `_predictive_directions`). That lets a wide target's sums cover every candidate layer
(`residual_statistics_choice`); the maps then read the residual through that projection
(`ResidualStatistics.projection`).

Example:
    ```python
    stats = ResidualStatistics.for_models(source, target, layers=[0, 1])
    calibration_pass(source, target, ids, consumers=[accumulator, stats])
    mapper_j1 = solve_residual_mapper(mapper, stats, residual_layer=1)
    ```
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from ..core.key_norm import KeyNormConfig, KeyNormInput
from ..core.lowrank import rank_for_energy
from ..core.map_inputs import with_input
from ..core.mapper import KVMapper
from ..core.mapper_config import MapperConfig
from ..core.mapper_types import RIDGE
from ..core.residual import (
    DEFAULT_RESIDUAL_LAGS,
    ResidualConfig,
    ResidualInput,
    residual_config,
    residual_features,
    residual_readers,
)
from ..core.ridge import feature_index
from ..core.rope import text_config
from ..core.stats import KVLayout
from .budget import StatisticsBudget
from .calibration_pass import CalibrationBatch
from .fit_inputs import CandidateGroup, FitInput, register_fit_input

DEFAULT_RESIDUAL_LAMBDA = 0.01
# The fewest directions per position (times the lags in all) the residual sums are compressed to
# (`residual_statistics_choice`); below it the fit collects the shallowest residual layers whole instead.
MIN_DIRECTIONS_PER_POSITION = 16
# The reduced-rank candidate keeps this fraction of the full-rank maps' fitted variance (`residual_variants`).
RESIDUAL_RANK_ENERGY = 0.99
KINDS = ("key", "value")


def has_key_norm(model: PreTrainedModel) -> bool:
    """Whether the model's attention normalises each key head after its projection (Qwen3's `k_norm`)."""
    body = model.base_model if hasattr(model, "base_model") else model
    return getattr(body.layers[0].self_attn, "k_norm", None) is not None


def residual_statistics_nbytes(source: KVLayout, target: KVLayout, hidden_size: int, num_lags: int, num_candidates: int,
                               source_features: bool = True, directions: int | None = None) -> int:  # fmt: skip
    """Bytes of `ResidualStatistics` for `num_candidates` residual layers (float64, both kinds; with `directions`,
    each position's residual in that many directions, and the directions themselves)."""
    f = (source.total_dim if source_features else 0) + num_lags * (directions or hidden_size)
    basis = num_lags * directions * num_lags * hidden_size if directions else 0
    return 8 * num_candidates * (2 * (f * f + f * target.total_dim + f + 2 * target.total_dim) + basis)


def _flat(states: list[torch.Tensor]) -> torch.Tensor:
    # [(B, H, T, D)] per layer -> (B, T, layers * H * D), layer-major then head
    return torch.cat([s.permute(0, 2, 1, 3).flatten(2) for s in states], dim=-1)


class ResidualStatistics:
    """Calibration consumer: the sums `solve_residual_mapper` needs, for each candidate residual layer."""

    name = "residual"
    checkpointable = True
    ready = True  # every batch adds to the sums: a checkpoint can be written after any of them

    def __init__(
        self,
        source_layout: KVLayout,
        target_layout: KVLayout,
        hidden_size: int,
        layers: Sequence[int],
        lags: Sequence[int] = DEFAULT_RESIDUAL_LAGS,
        key_before_norm: bool = False,
        stride: int = 1,
        source_features: bool = True,
        directions: int | None = None,
        residual_lambda: float = DEFAULT_RESIDUAL_LAMBDA,
    ):
        self.source_layout, self.target_layout = source_layout, target_layout
        self.hidden_size, self.lags, self.stride = hidden_size, list(lags), stride
        self.key_before_norm = key_before_norm
        self.source_features = source_features  # False: the residual features alone (maps reading no source layer)
        if directions is not None and not 0 < directions <= hidden_size:
            raise ValueError(f"directions must be in [1, {hidden_size}] (the hidden size), got {directions}")
        self.directions = directions  # per position: len(lags) * directions in all (None: every feature)
        self.residual_lambda = residual_lambda  # the ridge whose predictions the directions keep
        self.basis: dict[int, torch.Tensor | None] = {j: None for j in layers}  # [residual_dim, F_r] per layer
        # What the calibration pass captures for this consumer.
        self.target_hidden_layers = tuple(layers)
        self.target_key_projections = key_before_norm
        f = self.source_dim + self.residual_dim
        out = target_layout.total_dim
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.float64)  # noqa: E731
        self.count = {j: 0 for j in layers}
        self.sums = {(j, kind): {"x": zeros(f), "gram": zeros(f, f), "y": zeros(out), "cross": zeros(f, out),
                                 "yy": zeros(out)} for j in layers for kind in KINDS}  # fmt: skip

    @property
    def source_dim(self) -> int:
        """The source features leading each row of the sums (0 without them)."""
        return self.source_layout.total_dim if self.source_features else 0

    @property
    def residual_dim(self) -> int:
        """The residual features closing each row of the sums: every feature, or the directions they enter by."""
        return len(self.lags) * (self.directions or self.hidden_size)

    def projection(self, residual_layer: int, down: torch.Tensor | None = None) -> torch.Tensor | None:
        """The shared projection `[rank, len(lags) * hidden]` a mapper solved from these sums reads the residual
        features through: `down` (a projection of the sums' residual features, e.g. `reduced_rank_projection`) after
        the sums' directions, those directions alone, or `down` itself where the sums hold every feature."""
        basis = self.basis[residual_layer]
        if basis is None:
            if self.directions is not None:
                raise ValueError(f"no directions for residual layer {residual_layer}: the pass saw no batch")
            return down
        return basis if down is None else down @ basis

    @property
    def basis_pending(self) -> bool:
        """Whether the directions are still to be fixed (before the pass's first batch)."""
        return any(b is None for b in self.basis.values())

    @classmethod
    def for_models(cls, source: PreTrainedModel, target: PreTrainedModel, layers: Sequence[int], **kwargs) -> "ResidualStatistics":
        kwargs.setdefault("key_before_norm", has_key_norm(target))
        return cls(KVLayout.from_config(source.config), KVLayout.from_config(target.config),
                   text_config(target.config).hidden_size, layers, **kwargs)  # fmt: skip

    def update(self, batch: CalibrationBatch) -> None:
        if batch.part != "train":  # the held-out shard is the probe's: the maps it scores must not have seen it
            return
        if batch.target_hidden is None or (self.key_before_norm and batch.target_key_projections is None):
            raise ValueError("ResidualStatistics needs the pass to capture the target's residual stream (calibration_pass does when it is a consumer)")
        batch_size, seq = batch.source_keys[0].shape[0], batch.source_keys[0].shape[2]
        keep = torch.zeros(batch_size, seq, dtype=torch.bool)
        keep[:, :: self.stride] = True
        if batch.attention_mask is not None:
            keep &= batch.attention_mask.bool().cpu()
        target_keys = batch.target_key_projections if self.key_before_norm else batch.target_keys
        targets = {"key": _flat(target_keys).cpu()[keep].double(), "value": _flat(batch.target_values).cpu()[keep].double()}
        sources = {"key": _flat(batch.source_keys).cpu()[keep].double(),
                   "value": _flat(batch.source_values).cpu()[keep].double()} if self.source_features else {}  # fmt: skip
        fixing = _DirectionSample(batch.rows, keep, targets, self.target_layout) if self.directions and self.basis_pending else None
        for j in sorted(self.target_hidden_layers):  # increasing: `_DirectionSample.directions`
            res = residual_features(batch.target_hidden[j], self.lags, batch.attention_mask).cpu()[keep].double()
            if fixing is not None and self.basis[j] is None:
                self.basis[j] = fixing.directions(j, res, self.residual_dim, self.residual_lambda)
            if self.basis[j] is not None:
                res = res @ self.basis[j].T
            self.count[j] += int(keep.sum())
            for kind in KINDS:
                x = torch.cat([sources[kind], res], dim=-1) if self.source_features else res
                y, s = targets[kind], self.sums[(j, kind)]
                s["x"] += x.sum(0)
                s["gram"] += x.T @ x
                s["y"] += y.sum(0)
                s["cross"] += x.T @ y
                s["yy"] += (y * y).sum(0)


    def run_key(self) -> dict:
        """What must match for a checkpoint of these sums to be resumed."""
        return {"residual": {"layers": list(self.target_hidden_layers), "lags": self.lags, "stride": self.stride,
                             "key_before_norm": self.key_before_norm,
                             **({} if self.source_features else {"source_features": False}),
                             **({} if self.directions is None else {"directions": self.directions,
                                                                    "directions_lambda": self.residual_lambda})}}  # fmt: skip

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors = {f"{j}.{kind}.{name}": t.contiguous() for (j, kind), sums in self.sums.items() for name, t in sums.items()}
        tensors.update({f"{j}.basis": b.contiguous() for j, b in self.basis.items() if b is not None})
        return tensors, {"count": {str(j): c for j, c in self.count.items()}}

    def load_checkpoint_state(self, tensors: dict[str, torch.Tensor], meta: dict, where: str) -> None:
        for (j, kind), sums in self.sums.items():
            for name, current in sums.items():
                saved = tensors.get(f"{j}.{kind}.{name}")
                if saved is None or saved.shape != current.shape:
                    raise ValueError(f"checkpoint {where}: residual statistics {j}.{kind}.{name} missing or mis-shaped")
                sums[name] = saved.to(torch.float64)
        self.count = {int(j): int(c) for j, c in meta["count"].items()}
        if self.directions is not None:
            self.basis = {j: _saved_basis(tensors, j, self.count[j], where) for j in self.basis}

    def finish(self) -> None:
        """Sum over `torch.distributed` ranks (each saw its shard of the sequences)."""
        if not _distributed():
            return
        import torch.distributed as dist

        for j in self.count:
            count = torch.tensor([self.count[j]], dtype=torch.float64)
            dist.all_reduce(count)
            self.count[j] = int(count.item())
        for sums in self.sums.values():
            for tensor in sums.values():
                dist.all_reduce(tensor)


class _DirectionSample:
    """The tokens the sums' directions are fixed from: of a rank's first batch, those of the calibration sequences
    whose index is below the batch's size (the fewest rows of any rank's first batch under `torch.distributed`),
    gathered from every rank: the sequences one process's first batch holds, so that the directions do not depend on
    the world size. Holds their keys and values (each target layer's block of each kind scaled to unit total
    variance) and, per residual layer, fixes the residual's directions that carry the most of what a ridge on it
    predicts of those of the deeper layers (`directions`)."""

    def __init__(self, rows: list[int], keep: torch.Tensor, targets: dict[str, torch.Tensor], layout: KVLayout):
        size = torch.tensor([len(rows)], dtype=torch.float64)
        if _distributed():
            import torch.distributed as dist

            dist.all_reduce(size, op=dist.ReduceOp.MIN)
        leading = torch.tensor([r < size.item() for r in rows], dtype=torch.bool)
        self.rows = (keep & leading[:, None])[keep]  # of the kept tokens
        width = layout.layer_dim
        blocks = []
        for t in range(layout.num_layers):
            for kind in KINDS:
                y = _gathered(targets[kind][self.rows, t * width : (t + 1) * width])
                y = y - y.mean(0)
                blocks.append(y / y.pow(2).sum(0).sum().div(len(y)).sqrt().clamp_min(1e-30))
        self.blocks = blocks  # 2 per target layer, in layer order
        self.after, self.gram = -1, sum(b @ b.T for b in blocks)  # the outputs' Gram over the layers after `after`

    def directions(self, residual_layer: int, res: torch.Tensor, count: int, lam: float) -> torch.Tensor:
        """`_predictive_directions` of this sample's residual features `res` (every kept token of the batch) for the
        keys and values of the target layers after `residual_layer` (layers in increasing order)."""
        if residual_layer < self.after:
            raise ValueError("the residual layers' directions are fixed in increasing order")
        for t in range(self.after + 1, residual_layer + 1):
            self.gram = self.gram - sum(b @ b.T for b in self.blocks[2 * t : 2 * t + 2])
        self.after = residual_layer
        return _predictive_directions(_gathered(res[self.rows]), self.gram, count, lam)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _gathered(rows: torch.Tensor) -> torch.Tensor:
    """`rows` `[n, F]` of every `torch.distributed` rank, concatenated in rank order (this rank's alone without it)."""
    if not _distributed():
        return rows
    import torch.distributed as dist

    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([len(rows)]))
    most = int(max(c.item() for c in counts))
    padded = torch.cat([rows, rows.new_zeros(most - len(rows), *rows.shape[1:])])
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return torch.cat([part[: int(c.item())] for part, c in zip(parts, counts)])


def _predictive_directions(x: torch.Tensor, output_gram: torch.Tensor, count: int, lam: float) -> torch.Tensor:
    """`[count, F]`: the `count` combinations of the (standardised) features `x` `[n, F]` that carry the most of what
    a ridge on them (penalty `lam` on their correlation matrix, as `_solve`'s) predicts of outputs whose centred Gram
    matrix `[n, n]` is `output_gram`: reduced-rank regression, as `reduced_rank_projection` finds it from whole sums,
    here in the n-by-n space of the tokens (`K = x_std x_std^T`; the ridge's fitted values are `H y` with
    `H = K (K + n lam)^-1`, and the fit's coefficients `x_std^T (K + n lam)^-1 y`), as rows applied to the raw
    features (each divided by its feature's deviation). Beyond the directions the sample gives, seeded random ones
    complete the set; each row's largest entry is positive (the same directions on every machine and every run)."""
    std = x.std(0, unbiased=False).clamp_min(1e-12)
    xs = (x - x.mean(0)) / std
    evals, evecs = torch.linalg.eigh(xs @ xs.T)
    evals = evals.clamp_min(0)
    shifted = evals + len(xs) * lam
    hat = (evecs * (evals / shifted)) @ evecs.T
    values, u = torch.linalg.eigh(hat @ output_gram @ hat)  # the fitted values' Gram: their principal directions
    values, u = values.flip(0), u.flip(1)
    kept = values > 1e-10 * values.max().clamp_min(1e-30)
    lead = u[:, kept][:, :count]
    found = xs.T @ ((evecs / shifted) @ (evecs.T @ (output_gram @ (hat @ lead))))  # the coefficients along them
    extra = torch.randn(x.shape[1], count, generator=torch.Generator().manual_seed(0), dtype=x.dtype)
    q = torch.linalg.qr(torch.cat([found / found.norm(dim=0).clamp_min(1e-30), extra], dim=1))[0][:, :count]
    q = q * torch.sign(q.gather(0, q.abs().argmax(0, keepdim=True)))
    return (q / std[:, None]).T.contiguous()


def _saved_basis(tensors: dict[str, torch.Tensor], j: int, count: int, where: str) -> torch.Tensor | None:
    """Residual layer `j`'s directions from a checkpoint: none before the pass's first batch."""
    saved = tensors.get(f"{j}.basis")
    if saved is None and count:
        raise ValueError(f"checkpoint {where}: residual statistics {j}.basis missing")
    return None if saved is None else saved.to(torch.float64)


def solve_residual_mapper(
    mapper: KVMapper,
    stats: ResidualStatistics,
    residual_layer: int,
    *,
    residual_lambda: float = DEFAULT_RESIDUAL_LAMBDA,
    residual_rank: int | None = None,
    residual_energy: float | None = None,
    readers: list[int] | None = None,
    sources: dict[int, list[int]] | None = None,
) -> KVMapper:
    """A copy of `mapper` whose target layers after `residual_layer` also read the target's residual stream entering
    that layer (ridge on standardised `[selected source K|V, residual features]`, one solve per layer and kind),
    recording its `ResidualConfig` (the layer, the lags, the rank, the readers), a `KeyNormConfig` when the maps
    predict keys before the target's key norm, and `num_exact_layers = residual_layer + 1` (the fewest exact layers
    that compute that residual) in its config. Layers up to
    `residual_layer` keep `mapper`'s maps. Only ridge mappers.

    Args:
        mapper: a source-only "ridge" mapper (its `selected_layers` are kept).
        stats: `ResidualStatistics` collected with `residual_layer` among its layers.
        residual_lambda: ridge penalty on the standardised inputs' correlation matrix.
        residual_rank: rank of one projection of the residual features shared by every layer (None: full).
        residual_energy: instead of `residual_rank`, the smallest rank keeping this fraction of what the full-rank
            maps predict (`reduced_rank_projection`).
        readers: the target layers after `residual_layer` that read the residual (None: all of them); the others
            keep `mapper`'s maps unless `sources` names them.
        sources: source layers of some target layers after `residual_layer`, replacing `mapper`'s selection (those
            layers are solved again from `stats`): `[]` = no source input, so a reader's map is the residual alone
            and another layer's the calibration mean of its keys and values.
    """
    sources = _checked_sources(mapper, stats, residual_layer, sources, residual_rank, residual_energy)
    selected = [list(sources.get(t, sel)) for t, sel in enumerate(mapper.config.selected_layers)]
    res = ResidualConfig(residual_layer, list(stats.lags), readers=list(readers) if readers is not None else None)
    inputs = {**mapper.config.map_inputs, ResidualInput.name: res}
    if stats.key_before_norm:
        inputs[KeyNormInput.name] = KeyNormConfig()
    config = dataclasses.replace(
        mapper.config, selected_layers=selected, map_inputs=inputs,
        num_exact_layers=max(mapper.config.num_exact_layers or 0, residual_layer + 1),
    )  # fmt: skip
    down = None  # a projection of the sums' residual features
    if residual_rank is not None or residual_energy is not None:
        down = reduced_rank_projection(stats, residual_layer, config, residual_lambda, rank=residual_rank, energy=residual_energy)
    shared = stats.projection(residual_layer, down)  # ... of the residual features the mapper computes
    if shared is not None:
        config = with_input(config, ResidualInput.name, dataclasses.replace(res, rank=shared.shape[0]))
    new = KVMapper(config, report=dict(mapper.report))
    for t, layer in enumerate(new.layers):
        if t not in sources:
            layer.load_state_dict(mapper.layers[t].state_dict())
    new = new.to(mapper.dtype)
    if shared is not None:
        new.residual.down.data.copy_(shared.to(new.residual.down.dtype))
    r2 = _solve_into(new, config, stats, residual_layer, sources, residual_lambda, down)
    # Held-out R^2 was measured for the source-only maps: not these.
    new.config = dataclasses.replace(new.config, fit_r2_key=r2["key"], fit_r2_value=r2["value"], heldout_r2_key=None,
                                     heldout_r2_value=None)  # fmt: skip
    return new


def _checked_sources(
    mapper: KVMapper, stats: ResidualStatistics, residual_layer: int, sources: dict[int, list[int]] | None,
    residual_rank: int | None, residual_energy: float | None,
) -> dict[int, list[int]]:
    """`solve_residual_mapper`'s `sources` as a dict, once its request is checked: a source-only ridge `mapper`,
    statistics of `residual_layer`, `sources` only after it, at most one of `residual_rank` and `residual_energy`."""
    if mapper.config.mapper_type != "ridge" or mapper.needs_exact_layers:
        raise ValueError(f"solve_residual_mapper extends a source-only 'ridge' mapper, got {mapper.config.mapper_type!r}")
    if residual_layer not in stats.count or stats.count[residual_layer] == 0:
        raise ValueError(f"no residual statistics for layer {residual_layer} (collected: {sorted(stats.count)})")
    sources = dict(sources or {})
    if any(t <= residual_layer for t in sources):
        raise ValueError(f"sources may only name target layers after residual_layer={residual_layer}, got {sorted(sources)}")
    if residual_rank is not None and residual_energy is not None:
        raise ValueError("give residual_rank or residual_energy, not both")
    return sources


def _solve_into(
    new: KVMapper, config: MapperConfig, stats: ResidualStatistics, residual_layer: int, sources: dict[int, list[int]],
    residual_lambda: float, down: torch.Tensor | None,
) -> dict[str, list[float]]:
    """Solve `new`'s layers that read the residual or whose `sources` were replaced, into its weights. Returns the
    in-sample R^2 of the new maps per kind and target layer (of the keys before the norm for the key-norm input);
    where the source-only fit recorded none, the source-only layers get none either (JSON has no NaN)."""
    fr = stats.residual_dim
    r2 = {kind: list(getattr(config, f"fit_r2_{kind}") or [0.0] * stats.target_layout.num_layers) for kind in KINDS}
    for kind in KINDS:
        for t in sorted(set(new.residual.layers) | set(sources)):
            reads = t in new.residual.layers
            weight, bias, r2[kind][t] = _solve(stats, residual_layer, kind, t, config.selected_layers[t], reads,
                                               residual_lambda, down)  # fmt: skip
            k = weight.shape[0] - (down.shape[0] if down is not None else fr) if reads else weight.shape[0]
            linear = getattr(new.layers[t], kind)
            linear.weight.data.copy_(weight[:k].T.to(linear.weight.dtype))
            linear.bias.data.copy_(bias.to(linear.bias.dtype))
            if reads:
                new.residual.weight(kind, t).data.copy_(weight[k:].T.to(new.residual.weight(kind, t).dtype))
    return r2


def _residual_covariance(stats: ResidualStatistics, residual_layer: int) -> torch.Tensor:
    """Covariance `[F_r, F_r]` of the residual features (from the key sums: the block is the same in both kinds')."""
    n, fr = stats.count[residual_layer], stats.residual_dim
    s = stats.sums[(residual_layer, "key")]
    mu = s["x"][-fr:] / n
    return s["gram"][-fr:, -fr:] / n - torch.outer(mu, mu)


def _prediction_spectrum(stats: ResidualStatistics, residual_layer: int, config, lam: float):
    """What the full-rank residual blocks of `config`'s readers predict, as one eigenproblem: `(eigenvalues,
    directions)` with `directions` `[F_r, m]` (descending) spanning the residual features' combinations that carry
    the most of the maps' fitted variance, each (layer, kind) block counted as a fraction of its target's variance."""
    n, fr = stats.count[residual_layer], stats.residual_dim
    cov = _residual_covariance(stats, residual_layer)
    width = stats.target_layout.layer_dim
    blocks = []
    for kind in KINDS:
        yy, y = stats.sums[(residual_layer, kind)]["yy"], stats.sums[(residual_layer, kind)]["y"]
        for t in residual_readers(config):
            weight = _solve(stats, residual_layer, kind, t, config.selected_layers[t], True, lam)[0][-fr:]
            out = slice(t * width, (t + 1) * width)
            var = (yy[out] / n - (y[out] / n) ** 2).sum().clamp_min(1e-30)
            blocks.append(weight / var.sqrt())
    w = torch.cat(blocks, dim=1)  # (F_r, sum out)
    if w.shape[1] <= fr:  # the right singular vectors of cov^1/2 W, from W^T cov W
        values, vecs = torch.linalg.eigh(w.T @ cov @ w)
        values, directions = values.flip(0), w @ vecs.flip(1)
    else:  # more outputs than features: the left singular vectors of cov^1/2 W
        evals, evecs = torch.linalg.eigh(cov)
        kept = evals > 1e-12 * evals.max()
        a = (evecs * evals.clamp_min(0).sqrt()).T @ w
        values, q = torch.linalg.eigh(a @ a.T)
        inv_root = evecs * torch.where(kept, evals.clamp_min(1e-30).rsqrt(), torch.zeros_like(evals))
        values, directions = values.flip(0), inv_root @ q.flip(1)
    keep = values > 1e-10 * values.max().clamp_min(1e-30)  # directions that predict nothing are dropped
    return values[keep], directions[:, keep]


def reduced_rank_projection(
    stats: ResidualStatistics, residual_layer: int, config, lam: float, *, rank: int | None = None, energy: float | None = None
) -> torch.Tensor:
    """The shared residual projection `[rank, F_r]` of a reduced-rank residual mapper: reduced-rank regression, the
    `rank` combinations of the residual features that carry the most of what the full-rank maps of every reader
    predict (both kinds, each layer's targets weighted by their variance); with `energy` instead, the smallest rank
    keeping that fraction of it. Principal directions of the features themselves would keep what varies most in the
    residual stream, not what the keys and values need from it."""
    values, directions = _prediction_spectrum(stats, residual_layer, config, lam)
    rank = rank if rank is not None else rank_for_energy(values, energy)
    directions = directions[:, :rank]
    if directions.shape[1] < rank:
        # More rank than the maps' outputs give directions: the rest from the features' own principal directions
        # (QR keeps the span of the predictive ones first), so a full rank spans every input again.
        principal = torch.linalg.eigh(_residual_covariance(stats, residual_layer))[1].flip(1)
        directions = torch.linalg.qr(torch.cat([directions, principal], dim=1))[0][:, :rank]
    return (directions / directions.norm(dim=0).clamp_min(1e-30)).T


def _solve(
    stats: ResidualStatistics, layer: int, kind: str, t: int, selected: list[int], reads: bool, lam: float,
    down: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Ridge on standardised inputs for target layer `t` and `kind` from the sums of residual layer `layer`: the
    selected source layers' features, then (when `reads`) the residual block, through `down` when given. Returns
    `(weight [F, out], bias [out], in-sample R^2)`; no inputs at all give the calibration mean (R^2 0)."""
    n, s = stats.count[layer], stats.sums[(layer, kind)]
    fs, fr = stats.source_dim, stats.residual_dim
    if selected and not stats.source_features:
        raise ValueError(f"these residual statistics hold no source features: target layer {t} cannot read source "
                         f"layers {selected} (solve with sources=[] for it)")  # fmt: skip
    idx = feature_index(selected, stats.source_layout.layer_dim)
    idx = torch.cat([idx, torch.arange(fs, fs + fr)]) if reads else idx
    width = stats.target_layout.layer_dim
    out = slice(t * width, (t + 1) * width)
    mu, gram = s["x"][idx] / n, s["gram"][idx][:, idx] / n
    muy, cross, yy = s["y"][out] / n, s["cross"][idx, out] / n, s["yy"][out] / n
    cov, cov_xy = gram - torch.outer(mu, mu), cross - torch.outer(mu, muy)
    if down is not None and reads:  # [selected, residual] -> [selected, down @ residual]
        proj = torch.block_diag(torch.eye(len(idx) - fr, dtype=down.dtype), down)
        mu, cov, cov_xy = proj @ mu, proj @ cov @ proj.T, proj @ cov_xy
    if len(mu):
        scale = cov.diagonal().clamp_min(1e-12).sqrt()
        corr = cov / torch.outer(scale, scale)
        corr.diagonal().add_(lam)
        weight = torch.linalg.solve(corr, cov_xy / scale[:, None]) / scale[:, None]  # (F, out)
    else:  # no inputs: the calibration mean
        weight = cov_xy
    bias = muy - mu @ weight
    var_y = yy - muy * muy
    sse = var_y - 2 * (weight * cov_xy).sum(0) + (weight * (cov @ weight)).sum(0)
    return weight, bias, float(1 - sse.sum() / var_y.sum().clamp_min(1e-30))


def residual_r2_gain(mapper: KVMapper, stats: ResidualStatistics, residual_layer: int, *,
                     residual_lambda: float = DEFAULT_RESIDUAL_LAMBDA) -> dict[int, float]:
    """For each target layer after `residual_layer`: how much the residual adds to its maps' in-sample R^2 (keys
    and values averaged) over `mapper`'s source-only maps, both solved from `stats`. The layer whose maps gain
    most is where the source's K/V lack what the target's first layers computed (on the bundled family: the
    copying layer)."""
    num_layers = stats.target_layout.num_layers
    gain = {}
    for t in range(residual_layer + 1, num_layers):
        selected = mapper.config.selected_layers[t]
        gain[t] = sum(_solve(stats, residual_layer, kind, t, selected, True, residual_lambda)[2]
                      - _solve(stats, residual_layer, kind, t, selected, False, residual_lambda)[2]
                      for kind in KINDS) / len(KINDS)  # fmt: skip
    return gain


def residual_variants(
    mapper: KVMapper, stats: ResidualStatistics, residual_layer: int, *,
    residual_lambda: float = DEFAULT_RESIDUAL_LAMBDA, residual_rank: int | None = None,
) -> list[KVMapper]:
    """The residual-reading mappers the fit's probe tries for one residual layer, the fullest first:

    1. every mapped layer reads the residual next to `mapper`'s source layers;
    2. only the layer whose maps gain most from the residual (`residual_r2_gain`) reads it, the others keep
       `mapper`'s source-only maps;
    3. every mapped layer reads the residual and the last source layer only;
    4. every mapped layer reads the residual alone (no source K/V: the fewest multiply-adds and bytes read);
    5. without `residual_rank`: the same through one shared reduced-rank projection, at the rank that keeps
       `RESIDUAL_RANK_ENERGY` of what the full-rank maps predict (`reduced_rank_projection`), where that cuts the
       maps' multiply-adds at least in half (the projection once per token, then a small map per layer).

    Statistics without source features (`source_features=False`) give 4 and 5 only.

    Which of them keeps the content is the probe's question (`exact_layers.choose_configuration`), not this one's.
    """
    mapped = range(residual_layer + 1, stats.target_layout.num_layers)
    kwargs = {"residual_lambda": residual_lambda, "residual_rank": residual_rank}
    variants = _with_source_variants(mapper, stats, residual_layer, kwargs) if stats.source_features else []
    variants.append(solve_residual_mapper(mapper, stats, residual_layer, sources={t: [] for t in mapped}, **kwargs))
    if residual_rank is None and len(mapped):
        low = solve_residual_mapper(mapper, stats, residual_layer, sources={t: [] for t in mapped},
                                    residual_lambda=residual_lambda, residual_energy=RESIDUAL_RANK_ENERGY)  # fmt: skip
        features, outputs = len(stats.lags) * stats.hidden_size, 2 * len(mapped) * stats.target_layout.layer_dim
        full = features * outputs if stats.directions is None else stats.residual_dim * (features + outputs)
        if residual_config(low.config).rank * (features + outputs) <= full / 2:
            variants.append(low)
    unique: dict[tuple, KVMapper] = {}  # e.g. one mapped layer: "only the copy layer" is the first variant again
    for v in variants:
        unique.setdefault((repr(v.config.selected_layers), repr(residual_readers(v.config)), residual_config(v.config).rank), v)
    return list(unique.values())


def _with_source_variants(mapper: KVMapper, stats: ResidualStatistics, residual_layer: int, kwargs: dict) -> list[KVMapper]:
    """`residual_variants` 1-3: the maps that read source layers besides the residual."""
    mapped = range(residual_layer + 1, stats.target_layout.num_layers)
    last = [stats.source_layout.num_layers - 1]
    gain = residual_r2_gain(mapper, stats, residual_layer, residual_lambda=kwargs["residual_lambda"])
    copy_layer = max(gain, key=gain.get)
    return [
        solve_residual_mapper(mapper, stats, residual_layer, **kwargs),
        solve_residual_mapper(mapper, stats, residual_layer, readers=[copy_layer], **kwargs),
        solve_residual_mapper(mapper, stats, residual_layer, sources={t: last for t in mapped}, **kwargs),
    ]


# -- the residual input's fit side: statistics in the one calibration pass, candidates for the probe -----------------

@dataclasses.dataclass(frozen=True)
class ResidualStatisticsChoice:
    """Which residual-input sums a fit collects within its budget (`residual_statistics_choice`): the shallowest
    `layers` of the `candidates`, with the source's K/V among the features (`source_features`) unless the residual
    features alone cover more of them; or every candidate, the residual features through `num_lags * directions`
    directions.
    `per_layer` and `within`: bytes per residual layer and layers within the budget, with (True) and without (False)
    the source's K/V, every feature kept."""

    layers: tuple[int, ...]
    source_features: bool
    per_layer: dict[bool, int]
    within: dict[bool, int]
    candidates: int
    directions: int | None = None
    hidden_size: int = 0
    num_lags: int = 0
    directions_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """What the chosen sums take."""
        if self.directions is None:
            return len(self.layers) * self.per_layer[self.source_features]
        return self.directions_bytes


def residual_statistics_choice(source: KVLayout, target: KVLayout, hidden_size: int, num_lags: int,
                               budget: int) -> ResidualStatisticsChoice:  # fmt: skip
    """The residual-input sums that fit in `budget` bytes: as many of the shallowest candidate residual layers as fit
    (they leave most of the target to map), with the source's K/V unless that costs residual layers (a tie keeps
    them). No layer (`layers == ()`, `source_features` False) when even one layer's sums without the source exceed
    the budget."""
    candidates = residual_candidates(target.num_layers)
    per_layer = {with_source: residual_statistics_nbytes(source, target, hidden_size, num_lags, 1, with_source)
                 for with_source in (True, False)}  # fmt: skip
    within = {with_source: min(len(candidates), int(budget // n)) for with_source, n in per_layer.items()}
    with_source = within[True] >= within[False] and within[True] > 0
    choice = ResidualStatisticsChoice(tuple(candidates[: within[with_source]]), with_source, per_layer, within,
                                      len(candidates), hidden_size=hidden_size, num_lags=num_lags)  # fmt: skip
    if within[with_source] == len(candidates):
        return choice
    directions = _most_directions(source, target, hidden_size, num_lags, len(candidates), budget)
    if directions < MIN_DIRECTIONS_PER_POSITION:
        return choice
    nbytes = residual_statistics_nbytes(source, target, hidden_size, num_lags, len(candidates), False, directions)
    return dataclasses.replace(choice, layers=tuple(candidates), source_features=False, directions=directions,
                               directions_bytes=nbytes)  # fmt: skip


def _most_directions(source: KVLayout, target: KVLayout, hidden_size: int, num_lags: int, num_candidates: int,
                      budget: int) -> int:  # fmt: skip
    """The most directions per position (below `hidden_size`; `num_lags` times as many in all) for which the sums of
    `num_candidates` residual layers without the source's K/V fit in `budget` bytes (0 when not even one does)."""
    lo, hi = 0, hidden_size - 1
    while lo < hi:  # the sums grow with the directions: the largest count that fits
        mid = (lo + hi + 1) // 2
        fits = residual_statistics_nbytes(source, target, hidden_size, num_lags, num_candidates, False, mid) <= budget
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return lo


def _statistics_line(choice: ResidualStatisticsChoice, budget: StatisticsBudget) -> str:
    """The fit log's line on the residual-input statistics it collects (or why it collects none)."""
    per_layer = choice.per_layer
    if not choice.layers:
        return (f"residual-input maps: not tried, their statistics would need {per_layer[False] / 2**20:,.1f} MiB per "
                f"residual layer (float64, CPU), over {budget.describe('residual')}; source K/V maps only")  # fmt: skip
    layers = list(choice.layers)
    named = f"{layers[0]}-{layers[-1]}" if len(layers) > 4 and layers == list(range(layers[0], layers[-1] + 1)) else layers
    line = f"residual-input statistics for residual layers {named}: {choice.nbytes / 2**20:,.1f} MiB (float64, CPU)"
    if choice.directions is not None:
        return line + (f", the residual features alone through {choice.num_lags * choice.directions} of their "
                       f"{choice.num_lags * choice.hidden_size} dimensions (those that carry most of what a ridge on "
                       "them predicts of the deeper layers' keys and values on the first calibration batch), so that every candidate layer "
                       f"fits {budget.describe('residual')}: whole, they would need {per_layer[False] / 2**20:,.1f} MiB "
                       "per layer; only maps reading no source layer, through those directions, are tried")  # fmt: skip
    if not choice.source_features:
        line += (f", the residual features alone: with the source's K/V they would need {per_layer[True] / 2**20:,.1f} MiB per "
                 f"layer ({choice.within[True]} within the budget), so only maps reading no source layer are tried")  # fmt: skip
    if len(layers) < choice.candidates:
        line += f"; {choice.candidates - len(layers)} deeper residual layers over {budget.describe('residual')}"
    return line


def residual_candidates(num_layers: int) -> list[int]:
    """Candidate `residual_layer`s J (J + 1 exact layers) for a target of `num_layers` layers: every one that leaves a
    target layer to map (the probe skips those with more exact layers than the source-only answer needs)."""
    return list(range(0, max(1, num_layers - 1)))


@register_fit_input
class ResidualFit(FitInput):
    """The fit's search over maps reading the target's residual stream (`core/residual.py`): `ResidualStatistics` for
    the shallowest residual layers whose sums fit in the budget the fit hands it (`residual_statistics_choice` within
    what the K/V sums leave: `budget.StatisticsBudget.after_kv`), then `residual_variants` of each. The sums hold the source's K/V too unless the
    residual features alone cover more of the candidate layers (a real pair: its source K/V are tens of thousands of
    features); then only the maps of the residual alone are tried. Searched with `residual_inputs="auto"` and
    `num_exact_layers="auto"` (the defaults) on a full-rank ridge fit."""

    name, tag = ResidualInput.name, "res"

    def statistics(self, source: PreTrainedModel, target: PreTrainedModel, config: Any, budget: StatisticsBudget,
                   log: Callable[[str], None]) -> ResidualStatistics | None:  # fmt: skip
        if config.residual_inputs != "auto" or config.num_exact_layers != "auto":
            return None
        if config.mapper_type != RIDGE or config.rank is not None:
            kind = "an MLP" if config.mapper_type != RIDGE else "a reduced-rank"
            log(f"residual-input maps: not tried for {kind} mapper (they extend a full-rank ridge map; "
                "--residual-rank reduces theirs); source K/V maps only")  # fmt: skip
            return None
        choice = residual_statistics_choice(KVLayout.from_config(source.config), KVLayout.from_config(target.config),
                                            text_config(target.config).hidden_size, len(config.residual_lags),
                                            budget.residual_bytes)  # fmt: skip
        log(_statistics_line(choice, budget))
        if not choice.layers:
            return None
        return ResidualStatistics.for_models(source, target, choice.layers, lags=config.residual_lags,
                                             stride=config.residual_stride or config.stride,
                                             source_features=choice.source_features, directions=choice.directions,
                                             residual_lambda=config.residual_lambda)  # fmt: skip

    def candidates(self, mapper: KVMapper, statistics: ResidualStatistics, config: Any) -> list[CandidateGroup]:
        """`residual_variants` of each residual layer J, a group needing J + 1 exact layers (the cache computes the
        residual entering layer J in its exact pass: `ResidualConfig.exact_layers_needed`)."""
        return [CandidateGroup(self.name, layer + 1, {"inputs": f"target residual entering layer {layer} (maps not solved)",
                                           "residual_layer": layer},
                               functools.partial(residual_variants, mapper, statistics, layer,
                                                 residual_lambda=config.residual_lambda,
                                                 residual_rank=config.residual_rank))
                for layer in statistics.target_hidden_layers]  # fmt: skip

    def describe(self, mapper: KVMapper) -> dict[str, Any]:
        return {"residual_layer": residual_config(mapper.config).layer, "readers": residual_readers(mapper.config)}

    def twin(self, mapper: KVMapper) -> tuple[Hashable, bool]:
        res = residual_config(mapper.config)
        return (res.layer, repr(mapper.config.selected_layers), repr(residual_readers(mapper.config))), res.rank is not None

    def planned_statistics(self, source: KVLayout, target: KVLayout, hidden_size: int, positions: int,
                           budget: StatisticsBudget) -> dict[str, Any]:  # fmt: skip
        choice = residual_statistics_choice(source, target, hidden_size, positions, budget.residual_bytes)
        return {"layers": list(choice.layers), "candidates": choice.candidates, "source_features": choice.source_features,
                "directions": choice.directions, "shared_rank": positions * choice.directions if choice.directions else None,
                "bytes": choice.nbytes,
                "bytes_per_layer": choice.per_layer[True], "bytes_per_layer_residual_alone": choice.per_layer[False],
                "budget_bytes": budget.residual_bytes, "line": _statistics_line(choice, budget)}  # fmt: skip


__all__ = [
    "DEFAULT_RESIDUAL_LAGS",
    "DEFAULT_RESIDUAL_LAMBDA",
    "MIN_DIRECTIONS_PER_POSITION",
    "RESIDUAL_RANK_ENERGY",
    "ResidualStatisticsChoice",
    "ResidualFit",
    "ResidualStatistics",
    "has_key_norm",
    "reduced_rank_projection",
    "residual_candidates",
    "residual_r2_gain",
    "residual_statistics_choice",
    "residual_statistics_nbytes",
    "residual_variants",
    "solve_residual_mapper",
]
