"""Layer selection and the closed-form ridge solve, from `KVStatistics` alone (no model needed).

Ridge semantics follow the paper (and scikit-learn's `Ridge(alpha)`): on centered data,
`W = (Xc^T Xc + lambda I)^-1 Xc^T Yc` with the *sum* (not the mean) Gram matrix, and the bias
`b = mean(Y) - mean(X) W` is not penalised. All targets of one target layer share the same inputs
(all KV heads of the selected source layers), so the per-head solves are columns of one solve.
"""

from __future__ import annotations

import torch

from .stats import KINDS, BlockStatistics, KVStatistics

__all__ = [
    "cholesky_solve",
    "effective_top_k",
    "feature_index",
    "head_r2",
    "heldout_r2",
    "layer_scores",
    "layer_slice",
    "probe_single_source_r2",
    "residual_sum_squares",
    "select_layers",
    "single_source_r2",
    "solve_layer",
    "solve_layers",
    "sweep_heldout",
]


def cholesky_solve(gram: torch.Tensor, rhs: torch.Tensor, ridge_lambda: float) -> torch.Tensor:
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


def layer_slice(layer_idx: int, layer_dim: int) -> slice:
    return slice(layer_idx * layer_dim, (layer_idx + 1) * layer_dim)


def residual_sum_squares(gram_c, cross_c, var_y, weight):
    """Per-output SSE of a linear fit on centered data: Syy - 2 diag(W^T C) + diag(W^T G W)."""
    return var_y - 2 * (weight * cross_c).sum(0) + (weight * (gram_c @ weight)).sum(0)


def head_r2(sse: torch.Tensor, var_y: torch.Tensor, num_heads: int) -> torch.Tensor:
    """R^2 per head (`[..., heads]`) from per-dim SSE and variance `[..., heads * head_dim]`."""
    sse = sse.reshape(*sse.shape[:-1], num_heads, -1).sum(-1)
    sst = var_y.reshape(*var_y.shape[:-1], num_heads, -1).sum(-1)
    # A head with no variance (e.g. a dead layer) is perfectly predicted by its mean.
    return torch.where(sst > 0, 1 - sse / sst.clamp_min(1e-30), torch.ones_like(sst))


def _single_source_scores(blocks, num_source: int, num_target: int, num_heads: int, ridge_lambda: float):
    """`[L_s, L_t]` head-averaged R^2 from `blocks(s) -> (centered G_ss, C_s [F_s, L_t*F_t], var_y [L_t*F_t])`."""
    scores = torch.empty(num_source, num_target, dtype=torch.float64)
    for s in range(num_source):
        gram_ss, cross_s, var_y = (t.double() for t in blocks(s))
        weight = cholesky_solve(gram_ss, cross_s, ridge_lambda)  # (F_s, L_t * F_t)
        sse = residual_sum_squares(gram_ss, cross_s, var_y, weight)
        r2 = head_r2(sse.reshape(num_target, -1), var_y.reshape(num_target, -1), num_heads)
        scores[s] = r2.mean(-1).cpu()
    return scores


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

        def blocks(s, c=c):
            sl = layer_slice(s, src.layer_dim)
            return c["gram"][sl, sl], c["cross"][sl], c["var_y"]

        out[kind] = _single_source_scores(blocks, src.num_layers, tgt.num_layers, tgt.num_kv_heads, ridge_lambda)
    out["mean"] = (out["key"] + out["value"]) / 2
    return out


@torch.no_grad()
def probe_single_source_r2(
    features: dict[str, tuple[torch.Tensor, torch.Tensor]], source_layout, target_layout, ridge_lambda: float = 0.01
) -> dict[str, torch.Tensor]:
    """`single_source_r2` from materialised probe features `{kind: (x [n, L_s*F_s], y [n, L_t*F_t])}`.

    Memory: the features plus one source layer's `F_s x L_t*F_t` cross block at a time (no full Gram).
    """
    out = {}
    for kind in KINDS:
        x, y = (f.double() for f in features[kind])
        xc, yc = x - x.mean(0), y - y.mean(0)
        var_y = (yc * yc).sum(0)

        def blocks(s, xc=xc, yc=yc, var_y=var_y):
            xs = xc[:, layer_slice(s, source_layout.layer_dim)]
            return xs.T @ xs, xs.T @ yc, var_y

        out[kind] = _single_source_scores(
            blocks, source_layout.num_layers, target_layout.num_layers, target_layout.num_kv_heads, ridge_lambda
        )
    out["mean"] = (out["key"] + out["value"]) / 2
    return out


def layer_scores(stats: KVStatistics, ridge_lambda: float = 0.01) -> torch.Tensor:
    """The `[L_s, L_t]` ranking scores at `ridge_lambda`: in-sample single-source R^2, or the two-stage probe's
    (made at the same lambda) for block statistics."""
    if isinstance(stats, BlockStatistics):
        return stats.scores_at(ridge_lambda)
    return single_source_r2(stats, ridge_lambda)["mean"]


def effective_top_k(top_k: int | None, num_source: int) -> int | None:
    """A top_k at or above the source's depth means every source layer (None): the default 8 on a shallow source."""
    return None if top_k is not None and top_k >= num_source else top_k


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


def feature_index(selected: list[int], layer_dim: int) -> torch.Tensor:
    """Indices of the selected source layers' features in the side-by-side layout (empty for no layer)."""
    if not selected:
        return torch.zeros(0, dtype=torch.long)
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


# Largest batch of stacked Gram matrices factorised at once (bytes): bounds solve memory for big pairs.
_SOLVE_BATCH_BYTES = 2**30


def _solve_batch(grams: torch.Tensor, rhs: torch.Tensor, ridge_lambda: float) -> torch.Tensor:
    """Batched `(G_b + lambda I) W_b = R_b` (float64, one Cholesky call); per-item jitter fallback on failure."""
    eye = torch.eye(grams.shape[-1], dtype=grams.dtype, device=grams.device)
    factor, info = torch.linalg.cholesky_ex(grams + ridge_lambda * eye)
    out = torch.cholesky_solve(rhs, factor)
    for b in (info != 0).nonzero().flatten().tolist():
        out[b] = cholesky_solve(grams[b], rhs[b], ridge_lambda)
    return out


def centered_statistics(stats: KVStatistics, kind: str):
    """The centered statistics of one kind, computed once for many `head_system` calls (None for two-stage
    `BlockStatistics`, which center per system)."""
    return None if isinstance(stats, BlockStatistics) else stats.centered(kind)


def head_system(stats: KVStatistics, c, kind: str, target_layer: int, selected: list[int]):
    """Centered `(gram, cross, var_y, mean_x, mean_y)` of one target layer's ridge problem (float64)."""
    if isinstance(stats, BlockStatistics):
        return stats.system(kind, target_layer, selected)
    src, tgt = stats.source_layout, stats.target_layout
    idx = feature_index(selected, src.layer_dim).to(c["gram"].device)
    tl = layer_slice(target_layer, tgt.layer_dim)
    gram = c["gram"].index_select(0, idx).index_select(1, idx).double()
    cross = c["cross"][:, tl].index_select(0, idx).double()
    return gram, cross, c["var_y"][tl].double(), c["mean_x"].index_select(0, idx).double(), c["mean_y"][tl].double()


@torch.no_grad()
def solve_layers(
    stats: KVStatistics, kind: str, selections: dict[int, list[int]], ridge_lambda: float = 0.01
) -> dict[int, tuple[torch.Tensor, torch.Tensor, float]]:
    """`solve_layer` for several target layers, centering the statistics once.

    Target layers with the same number of inputs are solved as one batched Cholesky (in chunks of at most
    ~1 GiB of stacked Gram matrices), on the device the statistics live on. Works on `KVStatistics` and on
    two-stage `BlockStatistics`.
    """
    src, tgt = stats.source_layout, stats.target_layout
    c = centered_statistics(stats, kind)
    out = {}
    groups: dict[int, list[int]] = {}
    for target_layer, selected in selections.items():
        groups.setdefault(len(selected), []).append(target_layer)
    for k, layers in groups.items():
        n_in = k * src.layer_dim
        chunk = max(1, _SOLVE_BATCH_BYTES // (8 * n_in * (n_in + tgt.layer_dim)))
        for start in range(0, len(layers), chunk):
            part = layers[start : start + chunk]
            systems = [head_system(stats, c, kind, t, selections[t]) for t in part]
            grams = torch.stack([g[0] for g in systems])  # (B, F_in, F_in)
            crosses = torch.stack([g[1] for g in systems])  # (B, F_in, F_out)
            weights = _solve_batch(grams, crosses, ridge_lambda)  # (B, F_in, F_out)
            for b, t in enumerate(part):
                _, _, var_y, mean_x, mean_y = systems[b]
                weight = weights[b]
                bias = mean_y - mean_x @ weight
                sse = residual_sum_squares(grams[b], crosses[b], var_y, weight)
                r2 = float(head_r2(sse, var_y, tgt.num_kv_heads).mean())
                out[t] = (weight.T.contiguous(), bias, r2)
    return dict(sorted(out.items()))


def heldout_head_r2(system, count: int, weight: torch.Tensor, bias: torch.Tensor, num_heads: int) -> float:
    """Head-averaged R^2 of `y = x W + b` on a held-out centered system; W `[F_in, F_out]`."""
    gram, cross, var_y, mean_x, mean_y = system
    weight, bias = weight.to(gram.device), bias.to(gram.device)
    # Error around the held-out means plus the offset between held-out means and the prediction of them.
    offset = mean_y - mean_x @ weight - bias
    sse = residual_sum_squares(gram, cross, var_y, weight) + count * offset**2
    return float(head_r2(sse, var_y, num_heads).mean())


@torch.no_grad()
def heldout_r2(
    train: KVStatistics, heldout: KVStatistics, kind: str, selections: dict[int, list[int]], ridge_lambda: float = 0.01
) -> list[float]:
    """Out-of-sample head-averaged R^2 per target layer: fit on `train`, score on `heldout` statistics."""
    solutions = solve_layers(train, kind, selections, ridge_lambda)
    hc = centered_statistics(heldout, kind)
    num_heads = train.target_layout.num_kv_heads
    return [
        heldout_head_r2(head_system(heldout, hc, kind, t, selections[t]), heldout.count, weight.T, bias, num_heads)
        for t, (weight, bias, _) in solutions.items()
    ]


@torch.no_grad()
def sweep_heldout(
    train: KVStatistics, heldout: KVStatistics, top_ks: list[int | None], ridge_lambdas: list[float]
) -> list[dict]:
    """Held-out R^2 for every (top_k, ridge_lambda) candidate, from statistics alone.

    Layers are ranked on `train` (single-source R^2 with the candidate lambda, or the two-stage probe's
    ranking); each target layer is fit on `train` and scored on `heldout`. One eigendecomposition per
    (selection, target layer, kind) serves every lambda: `W(lambda) = Q diag(1 / (e + lambda)) Q^T C`.

    Returns:
        One dict per candidate: `top_k` (None = all), `ridge_lambda`, `selected_layers`, per-layer
        `heldout_r2_key` / `heldout_r2_value` lists, and `heldout_r2` (mean over layers of K and V).
    """
    tgt = train.target_layout
    centered = {kind: centered_statistics(train, kind) for kind in KINDS}
    held = {kind: centered_statistics(heldout, kind) for kind in KINDS}
    scores = {lam: layer_scores(train, lam) for lam in ridge_lambdas}
    eig_cache: dict = {}
    results = []
    for top_k in top_ks:
        for lam in ridge_lambdas:
            selected = select_layers(scores[lam], top_k)
            row = {"top_k": top_k, "ridge_lambda": lam, "selected_layers": selected}
            for kind in KINDS:
                per_layer = []
                for t, sel in enumerate(selected):
                    key = (kind, t, tuple(sel))
                    if key not in eig_cache:
                        gram, cross, _, mean_x, mean_y = head_system(train, centered[kind], kind, t, sel)
                        evals, evecs = torch.linalg.eigh(gram)
                        hsys = head_system(heldout, held[kind], kind, t, sel)
                        eig_cache[key] = (evals.clamp_min(0), evecs, evecs.T @ cross, mean_x, mean_y, hsys)
                    evals, evecs, proj, mean_x, mean_y, hsys = eig_cache[key]
                    weight = evecs @ (proj / (evals + lam).clamp_min(1e-300).unsqueeze(-1))
                    bias = mean_y - mean_x @ weight
                    per_layer.append(heldout_head_r2(hsys, heldout.count, weight, bias, tgt.num_kv_heads))
                row[f"heldout_r2_{kind}"] = per_layer
            row["heldout_r2"] = (sum(row["heldout_r2_key"]) + sum(row["heldout_r2_value"])) / (2 * tgt.num_layers)
            results.append(row)
    return results
