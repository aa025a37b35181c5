"""Reduced-rank ridge mappers: the best rank-r map per target layer and K/V, from the same statistics.

A full-rank map of target layer t costs `F_out * F_in` multiply-adds per token, with `F_in = k * n_kv_s * d_s`.
Stored as two factors, `down` `[r, F_in]` then `up` `[F_out, r]` (+ bias), it costs `r * (F_in + F_out)`.

Which rank-r map? The one that minimises the same ridge objective under a rank constraint,
`||Yc - Xc B^T||^2 + lambda ||B||^2` subject to `rank(B) <= r`. Writing the penalty as extra rows
(`X* = [Xc; sqrt(lambda) I]`, `Y* = [Yc; 0]`) makes it plain reduced-rank regression, whose closed form is the
full ridge solution `W` projected on the top-r eigenvectors `U_r` of the fitted values' second moment
`M = W (G_c + lambda I) W^T` (`[F_out, F_out]`; Reinsel & Velu 1998, Mukherjee & Zhu 2011):

    W_r = U_r U_r^T W      ->  up = U_r,  down = U_r^T W,  bias_r = mean_y - W_r mean_x

so a rank needs nothing but the centered Gram of the selected inputs, which `KVStatistics` already holds: no
new pass over calibration data. `M`'s eigenvalues are the drop in the objective each direction buys, so the
"energy" of a rank is a fraction of explained fitted variance, comparable across layers once divided by the
layer's total variance (an R^2 unit).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from .mapper import KVMapper
from .mapper_config import MapperConfig
from .mapper_types import LOWRANK, RIDGE
from .ridge import (
    centered_statistics,
    feature_index,
    head_r2,
    head_system,
    heldout_head_r2,
    layer_slice,
    residual_sum_squares,
    solve_layers,
)
from .stats import KINDS, KVStatistics

logger = logging.getLogger(__name__)


def reduced_rank(
    weight: torch.Tensor, gram: torch.Tensor, ridge_lambda: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition behind the reduced-rank ridge solution of one map.

    Args:
        weight: full-rank ridge solution `[F_out, F_in]` (`y = x @ weight.T + bias`).
        gram: centered *sum* Gram matrix of the inputs `[F_in, F_in]` the weight was solved with.
        ridge_lambda: the ridge penalty the weight was solved with (the metric is `G_c + lambda I`).

    Returns:
        `(eigenvalues [F_out], eigenvectors [F_out, F_out])`, float64, eigenvalues descending. The rank-r map is
        `U[:, :r] @ (U[:, :r].T @ weight)`, and `eigenvalues[r:].sum()` is the increase of the ridge objective
        (sum of squared errors + penalty) over full rank.
    """
    weight, gram = weight.double(), gram.double()
    metric = gram + ridge_lambda * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    moment = weight @ metric @ weight.T
    moment = (moment + moment.T) / 2  # exact symmetry for eigh
    eigenvalues, eigenvectors = torch.linalg.eigh(moment)
    # eigh returns ascending order; round-off can make tiny eigenvalues negative.
    return eigenvalues.flip(0).clamp_min(0), eigenvectors.flip(1)


def rank_for_energy(eigenvalues: torch.Tensor, energy: float) -> int:
    """Smallest rank whose leading eigenvalues hold at least `energy` (0 < energy <= 1) of the total."""
    if not 0 < energy <= 1:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    total = float(eigenvalues.sum())
    if total <= 0:
        return 1
    cumulative = torch.cumsum(eigenvalues, 0) / total
    return min(int((cumulative < energy - 1e-12).sum()) + 1, eigenvalues.numel())


def allocate_ranks(
    gains: dict[tuple[int, str], torch.Tensor], costs: dict[tuple[int, str], int], budget: int
) -> dict[tuple[int, str], int]:
    """Split a parameter budget over maps: greedily keep the directions with the most gain per parameter.

    Args:
        gains: per map (e.g. `(target_layer, kind)`), the gain of each successive rank, descending (e.g.
            eigenvalues divided by the layer's total variance: R^2 per direction).
        costs: parameters one rank costs for that map (`F_in + F_out`).
        budget: parameters to spend on the factors (biases not counted); every map gets at least rank 1.

    Returns:
        The rank of each map.
    """
    ranks = {key: 1 for key in gains}
    spent = sum(costs[key] for key in gains)
    if spent > budget:
        raise ValueError(
            f"a budget of {budget:,} parameters cannot give every one of the {len(gains)} maps rank 1 "
            f"(needs {spent:,}); raise the budget"
        )
    # Gains are descending per map, so a merge of all candidates by gain per parameter is the greedy order.
    candidates = sorted(
        ((float(g[i]) / costs[key], key, i) for key, g in gains.items() for i in range(1, g.numel())),
        key=lambda c: -c[0],
    )
    for _, key, i in candidates:
        if ranks[key] == i and spent + costs[key] <= budget:
            ranks[key] += 1
            spent += costs[key]
    return ranks


@torch.no_grad()
def solve_reduced_rank(
    statistics: KVStatistics,
    selected_layers: list[list[int]],
    solutions: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]],
    ridge_lambda: float,
    rank: int | list[list[int]] | None = None,
    energy: float | None = None,
    size_budget: float | int | None = None,
) -> tuple[dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]], list[list[int]]]:
    """Reduced-rank versions of full-rank ridge solutions, choosing each map's rank one of three ways.

    Args:
        statistics: the statistics the full-rank solutions were solved from.
        selected_layers: source layers per target layer (as in `MapperConfig.selected_layers`).
        solutions: `{"key"|"value": {t: (weight [F_out, F_in], bias, r2)}}` from `ridge.solve_layers`.
        rank: one rank for every map, or `[[key_rank, value_rank], ...]` per target layer (capped at `F_out`).
        energy: per map, the smallest rank that keeps this fraction of the fitted variance (e.g. 0.99).
        size_budget: total parameters of the factors, as a count (> 1) or a fraction of full rank (<= 1);
            ranks are spread over layers and K/V where they buy the most R^2 per parameter.

    Returns:
        `(factors, ranks)`: `factors[kind][t] = (down [r, F_in], up [F_out, r], bias [F_out], r2)` (float64,
        in-sample head-averaged R^2 of the reduced map) and `ranks[t] = [key_rank, value_rank]`.
    """
    if sum(x is not None for x in (rank, energy, size_budget)) != 1:
        raise ValueError(
            f"give exactly one of rank, energy or size_budget, got rank={rank!r}, energy={energy!r}, "
            f"size_budget={size_budget!r}"
        )
    src, tgt = statistics.source_layout, statistics.target_layout
    num_target = len(selected_layers)
    decompositions, centered = {}, {}
    for kind in KINDS:
        c = centered[kind] = statistics.centered(kind)
        for t, selected in enumerate(selected_layers):
            idx = feature_index(selected, src.layer_dim).to(c["gram"].device)
            gram = c["gram"].index_select(0, idx).index_select(1, idx)
            decompositions[t, kind] = (idx, gram, *reduced_rank(solutions[kind][t][0], gram, ridge_lambda))

    ranks = _chosen_ranks(statistics, selected_layers, decompositions, centered, rank, energy, size_budget)
    factors: dict[str, dict[int, tuple]] = {kind: {} for kind in KINDS}
    for (t, kind), (idx, gram, _, vectors) in decompositions.items():
        c, r = centered[kind], ranks[t, kind]
        weight = solutions[kind][t][0].double()
        up = vectors[:, :r]  # (F_out, r)
        down = up.T @ weight  # (r, F_in)
        tl = layer_slice(t, tgt.layer_dim)
        bias = c["mean_y"][tl].double() - up @ (down @ c["mean_x"].index_select(0, idx).double())
        cross, var_y = c["cross"][:, tl].index_select(0, idx).double(), c["var_y"][tl].double()
        sse = residual_sum_squares(gram.double(), cross, var_y, (up @ down).T)
        factors[kind][t] = (down, up, bias, float(head_r2(sse, var_y, tgt.num_kv_heads).mean()))
    rank_list = [[ranks[t, kind] for kind in KINDS] for t in range(num_target)]
    full_params = sum(len(s) * src.layer_dim * tgt.layer_dim for s in selected_layers) * 2
    low_params = sum(r * (len(selected_layers[t]) * src.layer_dim + tgt.layer_dim) for t in range(num_target) for r in rank_list[t])
    logger.info(
        "reduced-rank mapper: ranks %s, %.1f%% of full-rank weights (%s -> %s parameters)",
        rank_list, 100 * low_params / max(full_params, 1), f"{full_params:,}", f"{low_params:,}",
    )
    return factors, rank_list


def _chosen_ranks(
    statistics: KVStatistics,
    selected_layers: list[list[int]],
    decompositions: dict[tuple[int, str], tuple],
    centered: dict[str, dict[str, torch.Tensor]],
    rank: int | list[list[int]] | None,
    energy: float | None,
    size_budget: float | int | None,
) -> dict[tuple[int, str], int]:
    """`solve_reduced_rank`'s rank of each map `(t, kind)`, by whichever of `rank`, `energy` or `size_budget` is
    given, from the maps' `decompositions` (`(idx, gram, eigenvalues, eigenvectors)`, as `reduced_rank` gives
    them after the index and Gram matrix)."""
    src, tgt = statistics.source_layout, statistics.target_layout
    num_target = len(selected_layers)
    if isinstance(rank, int):
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        return {(t, kind): min(rank, tgt.layer_dim) for t in range(num_target) for kind in KINDS}
    if rank is not None:
        if len(rank) != num_target or any(len(r) != 2 or min(r) < 1 for r in rank):
            raise ValueError(f"rank must be an int or one [key_rank, value_rank] (each >= 1) per target layer, got {rank}")
        return {(t, kind): min(int(rank[t][i]), tgt.layer_dim) for t in range(num_target) for i, kind in enumerate(KINDS)}
    if energy is not None:
        return {key: rank_for_energy(d[2], energy) for key, d in decompositions.items()}
    costs = {(t, kind): len(selected_layers[t]) * src.layer_dim + tgt.layer_dim for t in range(num_target) for kind in KINDS}
    full = sum(len(selected_layers[t]) * src.layer_dim * tgt.layer_dim for t in range(num_target)) * len(KINDS)
    budget = int(size_budget * full) if size_budget <= 1 else int(size_budget)
    gains = {}
    for (t, kind), d in decompositions.items():
        total = float(centered[kind]["var_y"][layer_slice(t, tgt.layer_dim)].sum())
        gains[t, kind] = d[2] / max(total, 1e-30)
    return allocate_ranks(gains, costs, budget)


@torch.no_grad()
def reduced_rank_heldout_r2(
    train: KVStatistics,
    heldout: KVStatistics,
    selected_layers: list[list[int]],
    ridge_lambda: float,
    rank: int | list[list[int]] | None = None,
    energy: float | None = None,
    size_budget: float | int | None = None,
) -> dict[str, list[float]]:
    """Held-out head-averaged R^2 per target layer of the *reduced-rank* maps: full-rank ridge solved on `train`,
    reduced there (ranks chosen as `solve_reduced_rank` does), `W = up @ down` and its bias scored on `heldout`
    with the same formula as `ridge.heldout_r2`.

    Returns:
        `{"heldout_r2_key": [...], "heldout_r2_value": [...]}`, one value per target layer.
    """
    selections = dict(enumerate(selected_layers))
    solutions = {kind: solve_layers(train, kind, selections, ridge_lambda) for kind in KINDS}
    factors, _ = solve_reduced_rank(
        train, selected_layers, solutions, ridge_lambda, rank=rank, energy=energy, size_budget=size_budget
    )
    num_heads = train.target_layout.num_kv_heads
    out = {}
    for kind in KINDS:
        hc = centered_statistics(heldout, kind)
        out[f"heldout_r2_{kind}"] = [
            heldout_head_r2(head_system(heldout, hc, kind, t, selected_layers[t]), heldout.count, (up @ down).T, bias, num_heads)
            for t, (down, up, bias, _) in sorted(factors[kind].items())
        ]
    return out


# A reduced-rank mapper's type (`layer_maps` registry); its maps store `down` then `up` factors.
LOWRANK_MAPPER_TYPE = LOWRANK  # kept for callers of earlier versions


def lowrank_mapper(
    statistics: KVStatistics,
    config: MapperConfig,
    solutions: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]],
    rank: int | list[list[int]] | None = None,
    energy: float | None = None,
    size_budget: float | int | None = None,
    dtype: torch.dtype = torch.float32,
) -> KVMapper:
    """A reduced-rank `KVMapper` from full-rank solutions: a copy of `config` (never changed) with
    `mapper_type="lowrank"`, the chosen `rank` and the reduced maps' fit R^2, and the factors as its weights."""
    factors, ranks = solve_reduced_rank(
        statistics, config.selected_layers, solutions, config.ridge_lambda, rank=rank, energy=energy,
        size_budget=size_budget,
    )  # fmt: skip
    num_target = len(config.selected_layers)
    config = dataclasses.replace(
        config,
        mapper_type=LOWRANK_MAPPER_TYPE,
        rank=ranks,
        fit_r2_key=[factors["key"][t][3] for t in range(num_target)],
        fit_r2_value=[factors["value"][t][3] for t in range(num_target)],
    )
    state = {}
    for t in range(num_target):
        for kind in KINDS:
            down, up, bias, _ = factors[kind][t]
            # float64 factors land unrounded; one cast to `dtype` at the end
            state.update({
                f"layers.{t}.{kind}.down.weight": down, f"layers.{t}.{kind}.up.weight": up, f"layers.{t}.{kind}.up.bias": bias,
            })  # fmt: skip
    mapper = KVMapper(config).double()
    mapper.load_state_dict(state)
    return mapper.to(dtype)


def reduce_mapper_rank(
    mapper: KVMapper,
    statistics: KVStatistics,
    rank: int | list[list[int]] | None = None,
    energy: float | None = None,
    size_budget: float | int | None = None,
    dtype: torch.dtype | None = None,
) -> KVMapper:
    """Reduced-rank copy of a full-rank ridge `KVMapper`, using the statistics it was solved from.

    Example:
        ```python
        small = reduce_mapper_rank(mapper, stats, energy=0.99)   # or rank=16, or size_budget=0.25
        small.save_pretrained("mappers/small-to-large-r")
        ```
    """
    if mapper.config.mapper_type != RIDGE:
        raise ValueError(
            f"reduce_mapper_rank needs a full-rank ridge mapper, got mapper_type={mapper.config.mapper_type!r}"
        )
    if (statistics.source_layout, statistics.target_layout) != (mapper.source_layout, mapper.target_layout):
        raise ValueError(
            f"statistics are for {statistics.source_layout}->{statistics.target_layout}, the mapper for "
            f"{mapper.source_layout}->{mapper.target_layout}; pass the statistics the mapper was solved from"
        )
    state = mapper.state_dict()
    solutions = {
        kind: {
            t: (state[f"layers.{t}.{kind}.weight"].double().cpu(), state[f"layers.{t}.{kind}.bias"].double().cpu(), 0.0)
            for t in range(len(mapper.config.selected_layers))
        }
        for kind in KINDS
    }
    dtype = dtype or next(mapper.parameters()).dtype
    reduced = lowrank_mapper(statistics, mapper.config, solutions, rank, energy, size_budget, dtype=dtype)
    reduced.report = dict(getattr(mapper, "report", {}) or {})
    return reduced


__all__ = [
    "LOWRANK_MAPPER_TYPE",
    "allocate_ranks",
    "lowrank_mapper",
    "rank_for_energy",
    "reduce_mapper_rank",
    "reduced_rank",
    "reduced_rank_heldout_r2",
    "solve_reduced_rank",
]
