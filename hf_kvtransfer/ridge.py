"""Layer selection and the closed-form ridge solve, from `KVStatistics` alone (no model needed).

Ridge semantics follow the paper (and scikit-learn's `Ridge(alpha)`): on centered data,
`W = (Xc^T Xc + lambda I)^-1 Xc^T Yc` with the *sum* (not the mean) Gram matrix, and the bias
`b = mean(Y) - mean(X) W` is not penalised. All targets of one target layer share the same inputs
(all KV heads of the selected source layers), so the per-head solves are columns of one solve.
"""

from __future__ import annotations

import torch

from .stats import KINDS, KVStatistics


def _cholesky_solve(gram: torch.Tensor, rhs: torch.Tensor, ridge_lambda: float) -> torch.Tensor:
    """Solve `(gram + lambda I) W = rhs` in float64, adding jitter only if the factorisation fails."""
    gram = gram.double()
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    scale = float(gram.diagonal().abs().mean()) or 1.0
    jitter = 0.0
    for _ in range(8):
        factor, info = torch.linalg.cholesky_ex(gram + (ridge_lambda + jitter) * eye)
        if int(info) == 0:
            return torch.cholesky_solve(rhs.double(), factor)
        # Rank-deficient features (e.g. lambda=0 with constant dims): the smallest jitter that factors.
        jitter = scale * 1e-12 if jitter == 0.0 else jitter * 100
    raise ValueError("ridge system is not positive definite even with jitter; use a larger ridge_lambda")


def _layer_slice(layer_idx: int, layer_dim: int) -> slice:
    return slice(layer_idx * layer_dim, (layer_idx + 1) * layer_dim)


def _residual_sum_squares(gram_c, cross_c, var_y, weight):
    """Per-output SSE of a linear fit on centered data: Syy - 2 diag(W^T C) + diag(W^T G W)."""
    return var_y - 2 * (weight * cross_c).sum(0) + (weight * (gram_c @ weight)).sum(0)


def _head_r2(sse: torch.Tensor, var_y: torch.Tensor, num_heads: int) -> torch.Tensor:
    """R^2 per head (`[..., heads]`) from per-dim SSE and variance `[..., heads * head_dim]`."""
    sse = sse.reshape(*sse.shape[:-1], num_heads, -1).sum(-1)
    sst = var_y.reshape(*var_y.shape[:-1], num_heads, -1).sum(-1)
    # A head with no variance (e.g. a dead layer) is perfectly predicted by its mean.
    return torch.where(sst > 0, 1 - sse / sst.clamp_min(1e-30), torch.ones_like(sst))


@torch.no_grad()
def single_source_r2(stats: KVStatistics, ridge_lambda: float = 0.01) -> dict[str, torch.Tensor]:
    """Head-averaged in-sample R^2 of predicting each target layer from each single source layer.

    Returns:
        `{"key": [L_s, L_t], "value": [L_s, L_t], "mean": [L_s, L_t]}` (float64); `mean` averages keys and
        values and is the score the paper ranks source layers by.
    """
    src, tgt = stats.source_layout, stats.target_layout
    out = {}
    for kind in KINDS:
        c = stats.centered(kind)
        scores = torch.empty(src.num_layers, tgt.num_layers, dtype=torch.float64)
        for s in range(src.num_layers):
            sl = _layer_slice(s, src.layer_dim)
            gram_ss, cross_s = c["gram"][sl, sl], c["cross"][sl]
            weight = _cholesky_solve(gram_ss, cross_s, ridge_lambda)  # (F_s, L_t * F_t)
            sse = _residual_sum_squares(gram_ss.double(), cross_s.double(), c["var_y"].double(), weight)
            r2 = _head_r2(sse.reshape(tgt.num_layers, -1), c["var_y"].double().reshape(tgt.num_layers, -1), tgt.num_kv_heads)
            scores[s] = r2.mean(-1).cpu()
        out[kind] = scores
    out["mean"] = (out["key"] + out["value"]) / 2
    return out


def select_layers(scores: torch.Tensor, top_k: int | None) -> list[list[int]]:
    """Top-`top_k` source layers per target layer by score `[L_s, L_t]`, returned in ascending layer order.

    `top_k=None` selects all source layers.
    """
    num_source = scores.shape[0]
    if top_k is None:
        top_k = num_source
    if not 1 <= top_k <= num_source:
        raise ValueError(f"top_k must be between 1 and the source's {num_source} layers (or 'all'), got {top_k}")
    # Stable ordering: ties break towards the lower layer index.
    order = torch.argsort(-scores, dim=0, stable=True)[:top_k]
    return [sorted(order[:, t].tolist()) for t in range(scores.shape[1])]


def _feature_index(selected: list[int], layer_dim: int) -> torch.Tensor:
    return torch.cat([torch.arange(s * layer_dim, (s + 1) * layer_dim) for s in selected])


@torch.no_grad()
def solve_layer(
    stats: KVStatistics, kind: str, target_layer: int, selected: list[int], ridge_lambda: float = 0.01
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Ridge map for one target layer and kind from the selected source layers.

    Returns:
        `(weight [n_kv_t*d_t, k*n_kv_s*d_s], bias [n_kv_t*d_t], r2)`, float64; `r2` is the in-sample
        head-averaged R^2. `y = x @ weight.T + bias` with x the selected layers' stripped states side by side.
    """
    return solve_layers(stats, kind, {target_layer: selected}, ridge_lambda)[target_layer]


@torch.no_grad()
def solve_layers(
    stats: KVStatistics, kind: str, selections: dict[int, list[int]], ridge_lambda: float = 0.01
) -> dict[int, tuple[torch.Tensor, torch.Tensor, float]]:
    """`solve_layer` for several target layers, centering the statistics once."""
    src, tgt = stats.source_layout, stats.target_layout
    c = stats.centered(kind)
    out = {}
    for target_layer, selected in selections.items():
        idx = _feature_index(selected, src.layer_dim).to(c["gram"].device)
        tl = _layer_slice(target_layer, tgt.layer_dim)
        gram = c["gram"].index_select(0, idx).index_select(1, idx).double()
        cross = c["cross"][:, tl].index_select(0, idx).double()
        var_y = c["var_y"][tl].double()
        weight = _cholesky_solve(gram, cross, ridge_lambda)  # (F_in, F_out)
        bias = c["mean_y"][tl].double() - c["mean_x"].index_select(0, idx).double() @ weight
        sse = _residual_sum_squares(gram, cross, var_y, weight)
        r2 = float(_head_r2(sse, var_y, tgt.num_kv_heads).mean())
        out[target_layer] = (weight.T.contiguous(), bias, r2)
    return out
