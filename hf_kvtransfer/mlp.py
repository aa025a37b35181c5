"""Nonlinear KV mapper: a small ReLU MLP per (target layer, K|V), by default as a residual on top of ridge.

The paper's MLP variant (two hidden layers of 1,024 ReLU units, Adam, MSE on the stripped targets) recovers
the pairs where the closed-form ridge map fails. Two changes make it safe to use everywhere:

- residual: `y = ridge(x) + mlp(x)` with the MLP's last layer zero-initialised, so training starts exactly at
  the ridge solution;
- early stopping on held-out calibration sequences, with the untrained (= ridge) state as a candidate, so the
  held-out error is never worse than ridge's. Both errors are recorded per layer in `config.mlp["heldout"]`.

Training needs the features themselves (not just sums, as ridge does), so they are captured once at a token
stride (`feature_stride`) and kept on the host; the memory a fit needs is logged before it starts and stored in
`config.mlp["memory_bytes"]`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from typing import Any

import torch
from huggingface_hub.utils import tqdm
from torch import nn
from transformers import PreTrainedModel

from .capture import capture_kv
from .layer_maps import DEFAULT_MLP_CONFIG, MLPKindMap
from .mapper import KVMapper, MapperConfig
from .ridge import _cholesky_solve, _feature_index, select_layers, single_source_r2, solve_layers
from .stats import KINDS, KVLayout, flatten_layers, statistics_nbytes, token_selection

logger = logging.getLogger(__name__)

# -- training one map from features ----------------------------------------------------------------------


def _ridge_from_features(x: torch.Tensor, y: torch.Tensor, ridge_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Centered ridge with the sum-Gram lambda (as `ridge.py`), from materialised features; float64."""
    x, y = x.double(), y.double()
    mean_x, mean_y = x.mean(0), y.mean(0)
    xc = x - mean_x
    weight = _cholesky_solve(xc.T @ xc, xc.T @ (y - mean_y), ridge_lambda)  # (F_in, F_out)
    return weight.T.contiguous(), mean_y - mean_x @ weight


@torch.no_grad()
def _apply_batched(fn, x: torch.Tensor, device, chunk: int = 8192) -> torch.Tensor:
    return torch.cat([fn(x[i : i + chunk].to(device)) for i in range(0, x.shape[0], chunk)]) if len(x) else x


@torch.no_grad()
def _errors(pred: torch.Tensor, y: torch.Tensor, num_heads: int) -> tuple[float, float]:
    """(MSE, head-averaged out-of-sample R^2) of `pred` against `y` `[N, heads * head_dim]`."""
    pred, y = pred.double(), y.double()
    sse = ((pred - y) ** 2).sum(0).reshape(num_heads, -1).sum(-1)
    sst = ((y - y.mean(0)) ** 2).sum(0).reshape(num_heads, -1).sum(-1)
    r2 = torch.where(sst > 0, 1 - sse / sst.clamp_min(1e-30), torch.ones_like(sst))
    return float(sse.sum() / y.numel()), float(r2.mean())


def train_mlp_map(
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_heldout: torch.Tensor | None = None,
    y_heldout: torch.Tensor | None = None,
    *,
    num_kv_heads: int = 1,
    ridge_weight: torch.Tensor | None = None,
    ridge_bias: torch.Tensor | None = None,
    ridge_lambda: float = 0.01,
    residual: bool = True,
    hidden_size: int = 1024,
    num_hidden_layers: int = 2,
    per_head: bool = False,
    epochs: int = 20,
    lr: float = 1e-3,
    batch_size: int = 256,
    patience: int | None = 5,
    seed: int = 0,
    device: torch.device | str | None = None,
    progress_bar=None,
    description: str = "",
) -> tuple[MLPKindMap, dict[str, Any]]:
    """Train one (target layer, K|V) MLP map on features: `x [N, F_in] -> y [N, num_kv_heads * head_dim]`.

    Inputs are standardised per dimension and targets scaled by one number (their RMS deviation), so the
    loss is the paper's plain MSE, reported as a fraction of the target variance. The scalings are folded
    into the first and last layers afterwards: the returned module maps raw features to raw targets.

    Args:
        x_train, y_train: training features and targets.
        x_heldout, y_heldout: held-out features and targets for early stopping; `None` trains all epochs.
        ridge_weight, ridge_bias: `[F_out, F_in]`, `[F_out]` ridge solution (the residual base and the
            baseline that is reported); solved here from the training features when not given.
        residual: learn `y - ridge(x)` with a zero-initialised last layer (starts at ridge).
        per_head: one MLP per target KV head (the paper) instead of one per layer and kind.
        patience: epochs without held-out improvement before stopping (`None`: never stop early).
        seed: seeds initialisation and shuffling (a private generator; the global RNG is untouched).
        progress_bar: a tqdm bar to advance by one per epoch (optional).

    Returns:
        `(module, report)`; `report` has `ridge_mse`, `mlp_mse`, `ridge_r2`, `mlp_r2` (held-out), `train_r2`,
        `best_epoch` (0 = the initial state, i.e. ridge for a residual map) and `epochs_run`.
    """
    device = torch.device(device) if device is not None else x_train.device
    n, in_features = x_train.shape
    out_features = y_train.shape[1]
    if n < 2:
        raise ValueError(f"need at least 2 training tokens to fit an MLP map, got {n}; feed more calibration data")
    if ridge_weight is None:
        ridge_weight, ridge_bias = _ridge_from_features(x_train, y_train, ridge_lambda)
    ridge_weight = ridge_weight.to(device, torch.float32)
    ridge_bias = ridge_bias.to(device, torch.float32)

    def ridge(x):
        return nn.functional.linear(x.float(), ridge_weight, ridge_bias)

    has_heldout = x_heldout is not None and len(x_heldout) > 0
    # -- normalisation (folded into the weights at the end)
    x32 = x_train.to(device, torch.float32)
    y32 = y_train.to(device, torch.float32)
    mean_x, std_x = x32.mean(0), x32.std(0)
    # Near-constant input dims (dead heads, padding dims) would blow up the standardisation.
    std_x = std_x.clamp_min(1e-3 * float(std_x.mean()) + 1e-12)
    mean_y = y32.mean(0)
    scale_y = float(((y32 - mean_y) ** 2).mean().sqrt()) or 1.0

    def prepare(x, y):
        x, y = x.to(device, torch.float32), y.to(device, torch.float32)
        base = _apply_batched(ridge, x, device) if residual else mean_y
        return (x - mean_x) / std_x, (y - base) / scale_y

    xn, rn = prepare(x32, y32)
    del x32
    if has_heldout:
        xn_h, rn_h = prepare(x_heldout, y_heldout)

    groups = num_kv_heads if per_head else 1
    core = MLPKindMap(in_features, out_features, hidden_size, num_hidden_layers, groups=groups, residual=False)
    generator = torch.Generator().manual_seed(seed)
    for i, layer in enumerate(core.mlp):
        layer.reset_parameters(generator, zero=residual and i == len(core.mlp) - 1)
    core.to(device)
    optimizer = torch.optim.Adam(core.parameters(), lr=lr)

    @torch.no_grad()
    def heldout_loss() -> float:
        core.eval()
        sq = sum(float(((core(xn_h[i : i + 8192]) - rn_h[i : i + 8192]) ** 2).sum()) for i in range(0, len(xn_h), 8192))
        core.train()
        return sq / rn_h.numel()

    best_loss = heldout_loss() if has_heldout else math.inf
    best_state = {k: v.detach().clone() for k, v in core.state_dict().items()}
    best_epoch, stale, epochs_run, train_loss = 0, 0, 0, None
    for epoch in range(1, epochs + 1):
        order = torch.randperm(n, generator=generator).to(device)
        total, count = torch.zeros((), device=device), 0
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            loss = nn.functional.mse_loss(core(xn.index_select(0, idx)), rn.index_select(0, idx))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(idx)  # no per-step host sync on GPU
            count += len(idx)
        train_loss, epochs_run = float(total) / count, epoch
        if has_heldout:
            loss_h = heldout_loss()
            if loss_h < best_loss:
                best_loss, best_epoch, stale = loss_h, epoch, 0
                best_state = {k: v.detach().clone() for k, v in core.state_dict().items()}
            else:
                stale += 1
        else:
            best_epoch, best_state = epoch, {k: v.detach().clone() for k, v in core.state_dict().items()}
        if progress_bar is not None:
            progress_bar.update(1)
            progress_bar.set_postfix_str(
                f"{description} epoch {epoch} train {train_loss:.4f} heldout "
                f"{loss_h if has_heldout else float('nan'):.4f} best {best_loss:.4f}@{best_epoch}",
                refresh=False,
            )
        if has_heldout and patience is not None and stale >= patience:
            break
    if progress_bar is not None and epochs_run < epochs:
        progress_bar.update(epochs - epochs_run)
    core.load_state_dict(best_state)

    # -- fold the normalisation into the first and last layers: raw features in, raw targets out
    module = MLPKindMap(in_features, out_features, hidden_size, num_hidden_layers, groups=groups, residual=residual)
    module.to(device)
    with torch.no_grad():
        first, last = core.mlp[0], core.mlp[-1]
        for src, dst in zip(core.mlp, module.mlp):
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias)
        w1 = first.weight.double()  # (G, in, h)
        inv_std = 1 / std_x.double()
        module.mlp[0].weight.copy_(w1 * inv_std[None, :, None])
        # (mean/std) @ W1 can be large against b1: fold in float64.
        module.mlp[0].bias.copy_(first.bias.double() - torch.einsum("i,gih->gh", mean_x.double() * inv_std, w1))
        # num_hidden_layers >= 1, so the first and the last layer are different modules.
        module.mlp[-1].weight.copy_(last.weight.double() * scale_y)
        bias = last.bias.double() * scale_y
        if not residual:
            bias = bias + mean_y.double().view(groups, -1)
        module.mlp[-1].bias.copy_(bias)
        if residual:
            module.linear.weight.copy_(ridge_weight)
            module.linear.bias.copy_(ridge_bias)
    module.eval()

    report: dict[str, Any] = {"best_epoch": best_epoch, "epochs_run": epochs_run, "train_loss": train_loss}
    train_pred = _apply_batched(module, x_train, device)
    report["train_mse"], report["train_r2"] = _errors(train_pred, y_train.to(device), num_kv_heads)
    if has_heldout:
        y_h = y_heldout.to(device)
        report["ridge_mse"], report["ridge_r2"] = _errors(_apply_batched(ridge, x_heldout, device), y_h, num_kv_heads)
        report["mlp_mse"], report["mlp_r2"] = _errors(_apply_batched(module, x_heldout, device), y_h, num_kv_heads)
    else:
        report.update(ridge_mse=None, ridge_r2=None, mlp_mse=None, mlp_r2=None)
    return module.cpu(), report


# -- fitting a whole mapper from a model pair ------------------------------------------------------------


def mlp_fit_nbytes(
    source_layout: KVLayout,
    target_layout: KVLayout,
    num_train_tokens: int,
    num_heldout_tokens: int,
    top_k: int | None = None,
    hidden_size: int = 1024,
    num_hidden_layers: int = 2,
    per_head: bool = False,
    batch_size: int = 256,
    feature_dtype: torch.dtype = torch.float32,
) -> dict[str, int]:
    """Bytes an MLP fit needs: captured features (host), ridge statistics (host) and one map's training.

    Returns:
        `{"features", "statistics", "training", "mapper", "total"}`; `training` is the peak of one
        (target layer, K|V) map on the training device (standardised features and targets, parameters with
        gradients and Adam moments, activations).
    """
    tokens = num_train_tokens + num_heldout_tokens
    elt = torch.empty(0, dtype=feature_dtype).element_size()
    features = tokens * 2 * (source_layout.total_dim + target_layout.total_dim) * elt
    statistics = statistics_nbytes(source_layout, target_layout)
    k = top_k or source_layout.num_layers
    f_in, f_out = k * source_layout.layer_dim, target_layout.layer_dim
    groups = target_layout.num_kv_heads if per_head else 1
    sizes = [f_in] + [hidden_size] * num_hidden_layers + [f_out // groups]
    mlp_params = groups * sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
    map_params = mlp_params + f_in * f_out + f_out
    training = 4 * (
        2 * tokens * (f_in + f_out)  # raw copy + standardised features and targets
        + 4 * mlp_params  # weights, gradients, two Adam moments
        + 3 * batch_size * groups * hidden_size * num_hidden_layers  # activations and their gradients
    )
    mapper = 4 * 2 * target_layout.num_layers * map_params
    return {
        "features": features,
        "statistics": statistics,
        "training": training,
        "mapper": mapper,
        "total": features + statistics + training + mapper,
    }


def _split_rows(num_rows: int, heldout_fraction: float, seed: int) -> set[int]:
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    num_heldout = 0 if heldout_fraction == 0 else max(1, round(heldout_fraction * num_rows))
    if num_rows - num_heldout < 1:
        raise ValueError(
            f"{num_rows} calibration sequence(s) cannot be split into training and held-out sequences "
            f"(heldout_fraction={heldout_fraction}); pass more sequences"
        )
    # Whole sequences are held out: tokens of one sequence are too alike to test generalisation.
    return set(torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed))[:num_heldout].tolist())


def _gather(chunks: list[torch.Tensor], columns: torch.Tensor | slice) -> torch.Tensor:
    if isinstance(columns, slice):
        return torch.cat([c[:, columns] for c in chunks]) if chunks else torch.empty(0)
    return torch.cat([c.index_select(1, columns) for c in chunks]) if chunks else torch.empty(0)


def fit_mlp_mapper(
    source: PreTrainedModel,
    target: PreTrainedModel,
    calibration_input_ids: torch.Tensor | Iterable,
    top_k: int | str | None = 4,
    ridge_lambda: float = 0.01,
    residual: bool = True,
    hidden_size: int = 1024,
    num_hidden_layers: int = 2,
    per_head: bool = False,
    epochs: int = 20,
    lr: float = 1e-3,
    batch_size: int = 256,
    patience: int | None = 5,
    heldout_fraction: float = 0.1,
    seed: int = 0,
    stride: int = 4,
    feature_stride: int | None = None,
    feature_dtype: torch.dtype = torch.float32,
    calibration_batch_size: int = 8,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    progress: bool = True,
    **config_kwargs: Any,
) -> KVMapper:
    """Fit an MLP `KVMapper` from `source`'s KV cache to `target`'s (the paper's nonlinear variant).

    One pass over the calibration data through both models accumulates the ridge statistics (training
    sequences, every `stride`-th token) and keeps the stripped features of every `feature_stride`-th token.
    Source layers are selected and the ridge maps solved as in `fit_mapper`; then, per target layer and K|V,
    an MLP is trained with Adam on the MSE — by default as a residual on the ridge map, stopped early on the
    held-out sequences, so its held-out error is never worse than ridge's.

    Args:
        source, target: causal LMs of one family sharing a tokenizer.
        calibration_input_ids: `[num_sequences, seq_len]` ids (or an iterable of batches, see `fit_mapper`).
        top_k, ridge_lambda: layer selection and the ridge base, as in `fit_mapper`.
        residual: learn `y = ridge(x) + mlp(x)` (default) rather than the paper's plain `y = mlp(x)`.
        hidden_size, num_hidden_layers: MLP shape (paper: 2 x 1024 ReLU).
        per_head: one MLP per target KV head (the paper) instead of one per target layer and K|V.
        epochs, lr, batch_size, patience: Adam training of each map; `batch_size` is in tokens.
        heldout_fraction: share of the calibration *sequences* held out for early stopping and the reported
            held-out errors (they do not enter the ridge statistics either).
        seed: makes the split, initialisation and shuffling deterministic.
        stride: token stride of the ridge statistics (paper: 4).
        feature_stride: token stride of the features the MLP trains on (default: `stride`); raise it to bound
            memory, which is logged before the pass starts.
        feature_dtype: dtype the captured features are kept in on the host (`torch.bfloat16` halves memory).
        calibration_batch_size: sequences per forward pass of the models.
        device: where the MLPs train (default: the source model's device).
        config_kwargs: extra `MapperConfig` fields (model ids, calibration description, ...).

    Returns:
        A float32 `KVMapper` with `config.mapper_type == "mlp"`; `config.mlp` holds the hyper-parameters, the
        per-layer held-out MSE and R^2 of ridge and of the MLP (`heldout`), timings and `memory_bytes`;
        `config.fit_r2_*` are the MLP's R^2 on its training tokens, `config.heldout_r2_*` on the held-out ones
        (which also chose the stopping epoch, so they are slightly optimistic: evaluate on other text).

    Example:
        ```python
        mapper = fit_mlp_mapper(source, target, calibration_ids, top_k=4, epochs=10)
        print(mapper.config.mlp["heldout"]["value"]["ridge_r2"], mapper.config.heldout_r2_value)
        mapper.save_pretrained("mappers/small-to-large-mlp")
        ```
    """
    from .fit import _batches, _model_device, check_pair, new_statistics

    check_pair(source, target)
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    feature_stride = stride if feature_stride is None else feature_stride
    if feature_stride < 1:
        raise ValueError(f"feature_stride must be >= 1, got {feature_stride}")
    if isinstance(top_k, str) and top_k.isdigit():  # CLI strings
        top_k = int(top_k)
    if isinstance(ridge_lambda, str):
        try:
            ridge_lambda = float(ridge_lambda)
        except ValueError:
            pass  # reported below
    if not (top_k is None or top_k == "all" or isinstance(top_k, int)) or isinstance(ridge_lambda, (str, list, tuple)):
        raise ValueError(
            f"the MLP mapper is fit for one top_k (an int or 'all') and one ridge_lambda, got top_k={top_k!r}, "
            f"ridge_lambda={ridge_lambda!r}; pick them with a ridge fit first (fit_mapper(top_k='auto', ...))"
        )
    if top_k == "all":
        top_k = None
    device = torch.device(device) if device is not None else _model_device(source)
    started = time.perf_counter()

    # Token ids are small: materialise the batches to split whole sequences and size the features up front.
    batches = list(_batches(calibration_input_ids, attention_mask, calibration_batch_size))
    num_rows = sum(ids.shape[0] for ids, _ in batches)
    heldout_rows = _split_rows(num_rows, heldout_fraction, seed)
    stats = new_statistics(source, target)
    src_layout, tgt_layout = stats.source_layout, stats.target_layout
    num_tokens = {"train": 0, "heldout": 0}
    row = 0
    for ids, mask in batches:
        held = torch.tensor([row + i in heldout_rows for i in range(ids.shape[0])])
        row += ids.shape[0]
        for part, rows in (("train", ~held), ("heldout", held)):
            part_mask = mask[rows] if mask is not None else None
            num_tokens[part] += token_selection(int(rows.sum()), ids.shape[1], feature_stride, part_mask, "cpu").numel()
    memory = mlp_fit_nbytes(
        src_layout, tgt_layout, num_tokens["train"], num_tokens["heldout"], top_k, hidden_size,
        num_hidden_layers, per_head, batch_size, feature_dtype,
    )  # fmt: skip
    logger.info(
        "MLP fit needs ~%.1f MiB: features %.1f MiB (%d train + %d held-out tokens, stride %d, %s), statistics "
        "%.1f MiB, training one map %.1f MiB on %s, mapper %.1f MiB",
        memory["total"] / 2**20, memory["features"] / 2**20, num_tokens["train"], num_tokens["heldout"],
        feature_stride, feature_dtype, memory["statistics"] / 2**20, memory["training"] / 2**20, device,
        memory["mapper"] / 2**20,
    )  # fmt: skip

    # -- one pass: ridge statistics on training sequences, features of every sequence
    features: dict[str, dict[str, list[torch.Tensor]]] = {
        part: {f"{kind}.{side}": [] for kind in KINDS for side in ("x", "y")} for part in ("train", "heldout")
    }
    bar = tqdm(total=num_rows, desc="calibration", unit="seq", disable=not progress)
    row = 0
    with torch.no_grad():
        for ids, mask in batches:
            held = torch.tensor([row + i in heldout_rows for i in range(ids.shape[0])])
            row += ids.shape[0]
            src_k, src_v = capture_kv(source, ids, mask)
            tgt_k, tgt_v = capture_kv(target, ids, mask)
            states = {"key": (src_k, tgt_k), "value": (src_v, tgt_v)}
            for part, rows in (("train", ~held), ("heldout", held)):
                if not rows.any():
                    continue
                part_mask = mask[rows] if mask is not None else None
                select = {kind: ([s[rows.to(s.device)] for s in xs], [s[rows.to(s.device)] for s in ys])
                          for kind, (xs, ys) in states.items()}  # fmt: skip
                if part == "train":
                    (xk, yk), (xv, yv) = select["key"], select["value"]
                    stats.update(xk, xv, yk, yv, attention_mask=part_mask, stride=stride)
                index = token_selection(int(rows.sum()), ids.shape[1], feature_stride, part_mask, src_k[0].device)
                for kind, (xs, ys) in select.items():
                    features[part][f"{kind}.x"].append(flatten_layers(xs, index).to("cpu", feature_dtype))
                    features[part][f"{kind}.y"].append(
                        flatten_layers(ys, index.to(ys[0].device)).to("cpu", feature_dtype)
                    )
            bar.update(ids.shape[0])
    bar.close()
    capture_seconds = time.perf_counter() - started

    # -- ridge: layer selection and the residual base, from the training statistics
    scores = single_source_r2(stats, ridge_lambda)["mean"]
    selected = select_layers(scores, top_k)
    selections = dict(enumerate(selected))
    solutions = {kind: solve_layers(stats, kind, selections, ridge_lambda) for kind in KINDS}

    settings = {
        **DEFAULT_MLP_CONFIG,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "residual": residual,
        "per_head": per_head,
        "epochs": epochs,
        "lr": lr,
        "batch_size": batch_size,
        "patience": patience,
        "heldout_fraction": heldout_fraction,
        "seed": seed,
        "feature_stride": feature_stride,
        "train_tokens": num_tokens["train"],
        "heldout_tokens": num_tokens["heldout"],
        "heldout_sequences": sorted(heldout_rows),
        "memory_bytes": memory,
    }
    for which, model in (("source", source), ("target", target)):
        name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
        if name:
            config_kwargs.setdefault(f"{which}_model_id", name)
    calibration = dict(config_kwargs.pop("calibration", None) or {})
    calibration.setdefault("num_sequences", num_rows)
    # num_tokens: the ridge base's training tokens; the MLP's are in config.mlp (train_tokens / heldout_tokens).
    calibration.update(stride=stride, num_tokens=stats.count, num_heldout_sequences=len(heldout_rows))
    config = MapperConfig(
        source_config=stats.source_config,
        target_config=stats.target_config,
        selected_layers=selected,
        mapper_type="mlp",
        top_k=top_k if top_k is not None else src_layout.num_layers,
        ridge_lambda=ridge_lambda,
        mlp=settings,
        calibration=calibration,
        **config_kwargs,
    )
    mapper = KVMapper(config)

    # -- train each (target layer, K|V) map
    report: dict[str, dict[str, list]] = {kind: {} for kind in KINDS}
    bar = tqdm(total=tgt_layout.num_layers * 2 * epochs, desc="mlp", unit="epoch", disable=not progress)
    for t, sel in enumerate(selected):
        columns = _feature_index(sel, src_layout.layer_dim)
        target_columns = slice(t * tgt_layout.layer_dim, (t + 1) * tgt_layout.layer_dim)
        for kind in KINDS:
            weight, bias, _ = solutions[kind][t]
            x_train = _gather(features["train"][f"{kind}.x"], columns)
            y_train = _gather(features["train"][f"{kind}.y"], target_columns)
            x_held = _gather(features["heldout"][f"{kind}.x"], columns) if heldout_rows else None
            y_held = _gather(features["heldout"][f"{kind}.y"], target_columns) if heldout_rows else None
            module, layer_report = train_mlp_map(
                x_train.float(), y_train.float(),
                x_held.float() if x_held is not None else None,
                y_held.float() if y_held is not None else None,
                num_kv_heads=tgt_layout.num_kv_heads, ridge_weight=weight, ridge_bias=bias, residual=residual,
                hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, per_head=per_head, epochs=epochs,
                lr=lr, batch_size=batch_size, patience=patience, seed=seed + 2 * t + (kind == "value"),
                device=device, progress_bar=bar, description=f"layer {t} {kind}",
            )  # fmt: skip
            getattr(mapper.layers[t], kind).load_state_dict(module.state_dict())
            for name, value in layer_report.items():
                report[kind].setdefault(name, []).append(value)
            del x_train, y_train, x_held, y_held
    bar.close()

    settings["heldout"] = report
    settings["capture_seconds"] = round(capture_seconds, 3)
    settings["fit_seconds"] = round(time.perf_counter() - started, 3)
    config.fit_r2_key, config.fit_r2_value = report["key"]["train_r2"], report["value"]["train_r2"]
    if heldout_rows:
        config.heldout_r2_key, config.heldout_r2_value = report["key"]["mlp_r2"], report["value"]["mlp_r2"]
        logger.info(
            "MLP mapper: held-out R^2 key %.4f (ridge %.4f), value %.4f (ridge %.4f), mean over target layers; "
            "%.1f s",
            *(sum(report[k][m]) / len(report[k][m]) for k in KINDS for m in ("mlp_r2", "ridge_r2")),
            settings["fit_seconds"],
        )
    config.num_parameters = mapper.num_parameters()
    return mapper


__all__ = ["fit_mlp_mapper", "mlp_fit_nbytes", "train_mlp_map"]
