"""Nonlinear KV mapper: a small ReLU MLP per (target layer, K|V), by default as a residual on top of ridge.

The paper's MLP variant (two hidden layers of 1,024 ReLU units, Adam, MSE on the stripped targets) recovers
the pairs where the closed-form ridge map fails. Two changes make it safe to use everywhere:

- residual: `y = ridge(x) + mlp(x)` with the MLP's last layer zero-initialised, so training starts exactly at
  the ridge solution;
- early stopping on held-out calibration sequences, with the untrained (= ridge) state as a candidate, so the
  held-out error is never worse than ridge's. Both errors are recorded per layer in
  `mapper.report["mlp"]["heldout"]`.

Training needs the features themselves (not just sums, as ridge does): the one calibration pass
(`accumulate.run_fit_pass`, which also accumulates the ridge statistics) hands every batch to a
`FeatureCollector` that keeps the stripped features of every `feature_stride`-th token on the host. The memory a
fit needs is logged before it starts; the training log goes to `mapper.report["mlp"]`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ..core.layer_maps import DEFAULT_MLP_CONFIG, MLPKindMap
from ..core.loading import DTYPES, model_device
from ..core.mapper import KVMapper
from ..core.mapper_config import MapperConfig
from ..core.mapper_types import MLP
from ..core.progress import progress_bar
from ..core.ridge import cholesky_solve, effective_top_k, feature_index, layer_scores, select_layers, solve_layers
from ..core.stats import KINDS, KVLayout, KVStatistics, flatten_layers, statistics_nbytes, token_selection
from .accumulate import run_fit_pass
from .calibration_pass import CalibrationBatch
from .config import FitConfig, heldout_count

logger = logging.getLogger(__name__)

# -- training one map from features ----------------------------------------------------------------------


def _ridge_from_features(x: torch.Tensor, y: torch.Tensor, ridge_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Centered ridge with the sum-Gram lambda (as `ridge.py`), from materialised features; float64."""
    x, y = x.double(), y.double()
    mean_x, mean_y = x.mean(0), y.mean(0)
    xc = x - mean_x
    weight = cholesky_solve(xc.T @ xc, xc.T @ (y - mean_y), ridge_lambda)  # (F_in, F_out)
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


@dataclasses.dataclass(frozen=True)
class MLPTraining:
    """How one (target layer, K|V) MLP map is trained.

    Args:
        hidden_size / num_hidden_layers: the MLP's width and depth.
        per_head: one MLP per target KV head (the paper) instead of one per layer and kind.
        residual: learn `y - ridge(x)` with a zero-initialised last layer (starts at ridge).
        epochs / lr / batch_size: Adam's schedule.
        patience: epochs without held-out improvement before stopping (`None`: never stop early).
        seed: seeds initialisation and shuffling (a private generator; the global RNG is untouched).
        ridge_lambda: the ridge base's lambda, when it is solved here from the training features.
    """

    hidden_size: int = 1024
    num_hidden_layers: int = 2
    per_head: bool = False
    residual: bool = True
    epochs: int = 20
    lr: float = 1e-3
    batch_size: int = 256
    patience: int | None = 5
    seed: int = 0
    ridge_lambda: float = 0.01

    @classmethod
    def from_fit_config(cls, config: FitConfig, seed: int) -> MLPTraining:
        return cls(
            hidden_size=config.mlp_hidden_size, num_hidden_layers=config.mlp_num_hidden_layers,
            per_head=config.mlp_per_head, residual=config.mlp_residual, epochs=config.mlp_epochs, lr=config.mlp_lr,
            batch_size=config.mlp_batch_size, patience=config.mlp_patience, seed=seed,
            ridge_lambda=config.ridge_lambda[0],
        )  # fmt: skip


@dataclasses.dataclass
class _Scaling:
    """Inputs standardised per dimension, targets scaled by one number (their RMS deviation): the loss is the
    paper's plain MSE as a fraction of the target variance. Folded into the first and last layers at the end."""

    mean_x: torch.Tensor
    std_x: torch.Tensor
    mean_y: torch.Tensor
    scale_y: float

    @classmethod
    def of(cls, x: torch.Tensor, y: torch.Tensor) -> _Scaling:
        std_x = x.std(0)
        # Near-constant input dims (dead heads, padding dims) would blow up the standardisation.
        std_x = std_x.clamp_min(1e-3 * float(std_x.mean()) + 1e-12)
        mean_y = y.mean(0)
        return cls(x.mean(0), std_x, mean_y, float(((y - mean_y) ** 2).mean().sqrt()) or 1.0)

    def apply(self, x: torch.Tensor, y: torch.Tensor, base) -> tuple[torch.Tensor, torch.Tensor]:
        return (x - self.mean_x) / self.std_x, (y - base) / self.scale_y


@dataclasses.dataclass
class _Progress:
    bar: Any = None
    description: str = ""

    def epoch(self, epoch: int, train_loss: float, heldout: float, best: float, best_epoch: int) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(
                f"{self.description} epoch {epoch} train {train_loss:.4f} heldout {heldout:.4f} "
                f"best {best:.4f}@{best_epoch}",
                refresh=False,
            )

    def finish(self, epochs_run: int, epochs: int) -> None:
        if self.bar is not None and epochs_run < epochs:
            self.bar.update(epochs - epochs_run)


def _heldout_loss(core: nn.Module, heldout: tuple[torch.Tensor, torch.Tensor] | None) -> float:
    if heldout is None:
        return math.inf
    xn_h, rn_h = heldout
    core.eval()
    with torch.no_grad():
        sq = sum(float(((core(xn_h[i : i + 8192]) - rn_h[i : i + 8192]) ** 2).sum()) for i in range(0, len(xn_h), 8192))
    core.train()
    return sq / rn_h.numel()


def _one_epoch(core, optimizer, xn, rn, order, batch_size: int) -> float:
    total, count = torch.zeros((), device=xn.device), 0
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        loss = nn.functional.mse_loss(core(xn.index_select(0, idx)), rn.index_select(0, idx))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += loss.detach() * len(idx)  # no per-step host sync on GPU
        count += len(idx)
    return float(total) / count


def _train_core(core, xn, rn, heldout, training: MLPTraining, generator, progress: _Progress) -> dict[str, Any]:
    """Adam on the MSE, keeping the state with the best held-out loss (the initial one included); loads it."""
    optimizer = torch.optim.Adam(core.parameters(), lr=training.lr)
    best_loss = _heldout_loss(core, heldout)
    best_state = {k: v.detach().clone() for k, v in core.state_dict().items()}
    best_epoch, stale, epochs_run, train_loss = 0, 0, 0, None
    for epoch in range(1, training.epochs + 1):
        order = torch.randperm(len(xn), generator=generator).to(xn.device)
        train_loss, epochs_run = _one_epoch(core, optimizer, xn, rn, order, training.batch_size), epoch
        loss_h = _heldout_loss(core, heldout)
        if heldout is None or loss_h < best_loss:
            best_loss, best_epoch, stale = loss_h, epoch, 0
            best_state = {k: v.detach().clone() for k, v in core.state_dict().items()}
        else:
            stale += 1
        progress.epoch(epoch, train_loss, loss_h if heldout is not None else float("nan"), best_loss, best_epoch)
        if heldout is not None and training.patience is not None and stale >= training.patience:
            break
    progress.finish(epochs_run, training.epochs)
    core.load_state_dict(best_state)
    return {"best_epoch": best_epoch, "epochs_run": epochs_run, "train_loss": train_loss}


@torch.no_grad()
def _fold(core: MLPKindMap, scaling: _Scaling, training: MLPTraining, ridge: tuple[torch.Tensor, torch.Tensor]):
    """The trained core with its scalings folded in: raw features in, raw targets out (plus the ridge base)."""
    first, last = core.mlp[0], core.mlp[-1]
    groups, (out_features, in_features) = first.weight.shape[0], ridge[0].shape
    module = MLPKindMap(
        in_features, out_features, training.hidden_size, training.num_hidden_layers, groups=groups,
        residual=training.residual,
    ).to(first.weight.device)  # fmt: skip
    for src, dst in zip(core.mlp, module.mlp):
        dst.weight.copy_(src.weight)
        dst.bias.copy_(src.bias)
    w1 = first.weight.double()  # (G, in, h)
    inv_std = 1 / scaling.std_x.double()
    module.mlp[0].weight.copy_(w1 * inv_std[None, :, None])
    # (mean/std) @ W1 can be large against b1: fold in float64.
    module.mlp[0].bias.copy_(first.bias.double() - torch.einsum("i,gih->gh", scaling.mean_x.double() * inv_std, w1))
    # num_hidden_layers >= 1, so the first and the last layer are different modules.
    module.mlp[-1].weight.copy_(last.weight.double() * scaling.scale_y)
    bias = last.bias.double() * scaling.scale_y
    if not training.residual:
        bias = bias + scaling.mean_y.double().view(groups, -1)
    module.mlp[-1].bias.copy_(bias)
    if training.residual:
        module.linear.weight.copy_(ridge[0])
        module.linear.bias.copy_(ridge[1])
    return module.eval()


def train_mlp_map(
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_heldout: torch.Tensor | None = None,
    y_heldout: torch.Tensor | None = None,
    *,
    num_kv_heads: int = 1,
    training: MLPTraining = MLPTraining(),
    ridge: tuple[torch.Tensor, torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    progress_bar=None,
    description: str = "",
) -> tuple[MLPKindMap, dict[str, Any]]:
    """Train one (target layer, K|V) MLP map on features: `x [N, F_in] -> y [N, num_kv_heads * head_dim]`.

    Args:
        x_train, y_train: training features and targets.
        x_heldout, y_heldout: held-out features and targets for early stopping; `None` trains all epochs.
        training: the MLP's architecture and schedule (`MLPTraining`).
        ridge: `([F_out, F_in], [F_out])` ridge solution (the residual base and the baseline that is reported);
            solved here from the training features (`training.ridge_lambda`) when not given.
        progress_bar / description: a tqdm bar to advance by one per epoch (optional) and its label.

    Returns:
        `(module, report)`; the module maps raw features to raw targets; `report` has `ridge_mse`, `mlp_mse`,
        `ridge_r2`, `mlp_r2` (held-out), `train_r2`, `best_epoch` (0 = the initial state, i.e. ridge for a residual
        map) and `epochs_run`.
    """
    device = torch.device(device) if device is not None else x_train.device
    if x_train.shape[0] < 2:
        raise ValueError(
            f"need at least 2 training tokens to fit an MLP map, got {x_train.shape[0]}; feed more calibration data"
        )
    weight, bias = ridge if ridge is not None else _ridge_from_features(x_train, y_train, training.ridge_lambda)
    ridge = (weight.to(device, torch.float32), bias.to(device, torch.float32))

    def ridge_map(x):
        return nn.functional.linear(x.float(), *ridge)

    x32, y32 = x_train.to(device, torch.float32), y_train.to(device, torch.float32)
    scaling = _Scaling.of(x32, y32)

    def prepare(x, y):
        x, y = x.to(device, torch.float32), y.to(device, torch.float32)
        return scaling.apply(x, y, _apply_batched(ridge_map, x, device) if training.residual else scaling.mean_y)

    xn, rn = prepare(x32, y32)
    del x32, y32
    has_heldout = x_heldout is not None and len(x_heldout) > 0
    heldout = prepare(x_heldout, y_heldout) if has_heldout else None
    core, generator = _new_core(xn.shape[1], rn.shape[1], num_kv_heads, training)
    report = _train_core(core.to(device), xn, rn, heldout, training, generator, _Progress(progress_bar, description))
    module = _fold(core, scaling, training, ridge)
    report["train_mse"], report["train_r2"] = _errors(_apply_batched(module, x_train, device), y_train.to(device), num_kv_heads)
    report.update(ridge_mse=None, ridge_r2=None, mlp_mse=None, mlp_r2=None)
    if has_heldout:
        report.update(_heldout_errors({"ridge": ridge_map, "mlp": module}, x_heldout, y_heldout, device, num_kv_heads))
    return module.cpu(), report


def _new_core(f_in: int, f_out: int, num_kv_heads: int, training: MLPTraining) -> tuple[MLPKindMap, torch.Generator]:
    """`train_mlp_map`'s MLP on standardised features, initialised from `training.seed` (its last layer zero for a
    residual map), and the generator that then shuffles its batches."""
    groups = num_kv_heads if training.per_head else 1
    core = MLPKindMap(f_in, f_out, training.hidden_size, training.num_hidden_layers, groups=groups, residual=False)
    generator = torch.Generator().manual_seed(training.seed)
    for i, layer in enumerate(core.mlp):
        layer.reset_parameters(generator, zero=training.residual and i == len(core.mlp) - 1)
    return core, generator


def _heldout_errors(maps: dict[str, Any], x: torch.Tensor, y: torch.Tensor, device, num_kv_heads: int) -> dict[str, float]:
    """`{name}_mse` and `{name}_r2` of each of `maps` on the held-out features `x` and targets `y`."""
    y = y.to(device)
    errors = {}
    for name, fn in maps.items():
        errors[f"{name}_mse"], errors[f"{name}_r2"] = _errors(_apply_batched(fn, x, device), y, num_kv_heads)
    return errors


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


class FeatureCollector:
    """A `calibration_pass` consumer keeping the stripped features of every `feature_stride`-th real token of each
    sequence, per shard and kind: `features[part]["key.x"]` is a list of `[tokens, L_s * F_s]` chunks (host)."""

    name = "mlp-features"
    checkpointable = False

    def __init__(self, feature_stride: int, dtype: torch.dtype = torch.float32):
        self.feature_stride, self.dtype = feature_stride, dtype
        self.features: dict[str, dict[str, list[torch.Tensor]]] = {
            part: {f"{kind}.{side}": [] for kind in KINDS for side in ("x", "y")} for part in ("train", "heldout")
        }

    def update(self, batch: CalibrationBatch) -> None:
        sk = batch.source_keys
        index = token_selection(len(batch.rows), sk[0].shape[2], self.feature_stride, batch.attention_mask, sk[0].device)
        for kind in KINDS:
            xs, ys = batch.states(kind)
            part = self.features[batch.part]
            part[f"{kind}.x"].append(flatten_layers(xs, index).to("cpu", self.dtype))
            part[f"{kind}.y"].append(flatten_layers(ys, index.to(ys[0].device)).to("cpu", self.dtype))

    def gather(self, part: str, name: str, columns: torch.Tensor | slice) -> torch.Tensor | None:
        """The `columns` of one feature matrix (`"key.x"`, ...) of a shard, all tokens, as float32."""
        chunks = self.features[part][name]
        if not chunks:
            return None
        if isinstance(columns, slice):
            return torch.cat([c[:, columns] for c in chunks]).float()
        return torch.cat([c.index_select(1, columns) for c in chunks]).float()


def _count_tokens(num_rows: int, seq_len: int, stride: int, mask: torch.Tensor | None) -> int:
    return int(token_selection(num_rows, seq_len, stride, mask, "cpu").numel()) if num_rows else 0


def _token_counts(input_ids, attention_mask, config: FitConfig) -> tuple[dict[str, int], int]:
    """The MLP's training and held-out token counts (every `feature_stride`-th real token), and the held-out rows."""
    stride = config.mlp_feature_stride or config.stride
    num_rows, seq_len = input_ids.shape
    num_heldout = heldout_count(num_rows, config.heldout_fraction)
    num_train, mask = num_rows - num_heldout, attention_mask
    counts = {
        "train": _count_tokens(num_train, seq_len, stride, mask[:num_train] if mask is not None else None),
        "heldout": _count_tokens(num_heldout, seq_len, stride, mask[num_train:] if mask is not None else None),
    }
    return counts, num_heldout


def _fit_memory(layouts, num_tokens: dict[str, int], top_k: int | None, config: FitConfig, device) -> dict[str, int]:
    """`mlp_fit_nbytes` of this fit, logged."""
    memory = mlp_fit_nbytes(
        *layouts, num_tokens["train"], num_tokens["heldout"], top_k, config.mlp_hidden_size,
        config.mlp_num_hidden_layers, config.mlp_per_head, config.mlp_batch_size, DTYPES[config.mlp_feature_dtype],
    )  # fmt: skip
    logger.info(
        "MLP fit needs ~%.1f MiB: features %.1f MiB (%d train + %d held-out tokens, stride %d, %s), statistics "
        "%.1f MiB, training one map %.1f MiB on %s, mapper %.1f MiB",
        memory["total"] / 2**20, memory["features"] / 2**20, num_tokens["train"], num_tokens["heldout"],
        config.mlp_feature_stride or config.stride, DTYPES[config.mlp_feature_dtype], memory["statistics"] / 2**20,
        memory["training"] / 2**20, device, memory["mapper"] / 2**20,
    )  # fmt: skip
    return memory


def _refuse_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("the MLP mapper trains in one process: run it without torchrun")


def _train_maps(collector, solutions, selected, layouts, config: FitConfig, device):
    """Train every (target layer, K|V) map on the collected features: `(state_dict, per-kind report lists)`."""
    src_layout, tgt_layout = layouts
    report: dict[str, dict[str, list]] = {kind: {} for kind in KINDS}
    state: dict[str, torch.Tensor] = {}
    bar = progress_bar(total=tgt_layout.num_layers * 2 * config.mlp_epochs, desc="mlp", unit="epoch", enabled=config.progress)
    for t, sel in enumerate(selected):
        columns = feature_index(sel, src_layout.layer_dim)
        target_columns = slice(t * tgt_layout.layer_dim, (t + 1) * tgt_layout.layer_dim)
        for kind in KINDS:
            weight, bias, _ = solutions[kind][t]
            module, layer_report = train_mlp_map(
                collector.gather("train", f"{kind}.x", columns), collector.gather("train", f"{kind}.y", target_columns),
                collector.gather("heldout", f"{kind}.x", columns),
                collector.gather("heldout", f"{kind}.y", target_columns),
                num_kv_heads=tgt_layout.num_kv_heads, ridge=(weight, bias),
                training=MLPTraining.from_fit_config(config, seed=config.seed + 2 * t + (kind == "value")),
                device=device, progress_bar=bar, description=f"layer {t} {kind}",
            )  # fmt: skip
            state.update({f"layers.{t}.{kind}.{name}": v for name, v in module.state_dict().items()})
            for name, value in layer_report.items():
                report[kind].setdefault(name, []).append(value)
    bar.close()
    return state, report


def _training_report(config: FitConfig, num_tokens, heldout_rows: list[int], memory, report) -> dict[str, Any]:
    return {
        "epochs": config.mlp_epochs,
        "lr": config.mlp_lr,
        "batch_size": config.mlp_batch_size,
        "patience": config.mlp_patience,
        "heldout_fraction": config.heldout_fraction,
        "seed": config.seed,
        "feature_stride": config.mlp_feature_stride or config.stride,
        "train_tokens": num_tokens["train"],
        "heldout_tokens": num_tokens["heldout"],
        "heldout_sequences": heldout_rows,
        "memory_bytes": memory,
        "heldout": report,
    }


def _record_calibration(
    calibration: dict[str, Any], num_rows: int, num_heldout: int, config: FitConfig, train: KVStatistics
) -> None:
    """Complete the mapper's calibration record: sequences, stride, the ridge base's training tokens (the MLP's are
    in `mapper.report["mlp"]`: `train_tokens`, ...) and held-out sequences."""
    calibration.setdefault("num_sequences", num_rows)
    calibration.update(stride=config.stride, num_tokens=train.count, num_heldout_sequences=num_heldout)


def _mlp_mapper_config(
    train: KVStatistics, selected: list[list[int]], top_k: int, ridge_lambda: float, config: FitConfig,
    calibration: dict[str, Any], **mapper_kwargs: Any,
) -> MapperConfig:
    """The MLP mapper's config: `config`'s architecture on the `selected` layers of the fit statistics' pair
    (`top_k`: as recorded, the source's depth for every layer). Made before training: a bad setting is refused
    before the work."""
    architecture = {
        **DEFAULT_MLP_CONFIG, "hidden_size": config.mlp_hidden_size, "num_hidden_layers": config.mlp_num_hidden_layers,
        "residual": config.mlp_residual, "per_head": config.mlp_per_head,
    }  # fmt: skip
    return MapperConfig(
        source_config=train.source_config, target_config=train.target_config, selected_layers=selected,
        mapper_type=MLP, top_k=top_k, ridge_lambda=ridge_lambda,
        mlp=architecture, calibration=calibration, **mapper_kwargs,
    )  # fmt: skip


def _r2_fields(report, num_heldout: int, seconds: float) -> dict[str, list[float]]:
    r2 = {"fit_r2_key": report["key"]["train_r2"], "fit_r2_value": report["value"]["train_r2"]}
    if num_heldout:
        r2.update(heldout_r2_key=report["key"]["mlp_r2"], heldout_r2_value=report["value"]["mlp_r2"])
        logger.info(
            "MLP mapper: held-out R^2 key %.4f (ridge %.4f), value %.4f (ridge %.4f), mean over target layers; "
            "%.1f s",
            *(sum(report[k][m]) / len(report[k][m]) for k in KINDS for m in ("mlp_r2", "ridge_r2")), seconds,
        )  # fmt: skip
    return r2


def fit_mlp(
    source: PreTrainedModel,
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    config: FitConfig,
    log=None,
    **mapper_kwargs: Any,
) -> KVMapper:
    """Fit an MLP `KVMapper` (`config.mapper_type == "mlp"`; use it through `fit_mapper` / `fit_mlp_mapper`).

    The one calibration pass accumulates the ridge statistics (fit shard: layer selection and the residual
    base) and, through a `FeatureCollector`, keeps the features of every `config.mlp_feature_stride`-th token
    (default: `config.stride`) of every sequence. Then, per target layer and K|V, an MLP is trained with Adam on
    the MSE — by default as a residual on the ridge map, stopped early on the held-out sequences (the last
    `heldout_fraction` of them), so its held-out error is never worse than ridge's.

    Returns:
        A float32 `KVMapper` with `config.mapper_type == "mlp"` and `config.mlp` its architecture;
        `config.fit_r2_*` are the MLP's R^2 on its training tokens, `config.heldout_r2_*` on the held-out ones
        (which also chose the stopping epoch, so they are slightly optimistic: evaluate on other text).
        `mapper.report["mlp"]` holds the training settings, the per-layer held-out MSE and R^2 of ridge and of
        the MLP (`heldout`), token counts, `heldout_sequences`, `memory_bytes` and timings.
    """
    started = time.perf_counter()
    device = torch.device(config.mlp_device) if config.mlp_device else model_device(source)
    (top_k,), (ridge_lambda,) = config.top_k_values, config.ridge_lambda
    num_tokens, num_heldout = _token_counts(input_ids, attention_mask, config)
    layouts = KVLayout.from_config(source.config), KVLayout.from_config(target.config)
    top_k = effective_top_k(top_k, layouts[0].num_layers)  # as for ridge (`fit.solve_mappers`)
    memory = _fit_memory(layouts, num_tokens, top_k, config, device)
    _refuse_distributed()

    # -- the one pass: ridge statistics (both shards) and the features of every sequence
    collector = FeatureCollector(config.mlp_feature_stride or config.stride, DTYPES[config.mlp_feature_dtype])
    calibration = dict(mapper_kwargs.pop("calibration", None) or {})
    train, _ = run_fit_pass(
        source, target, input_ids, attention_mask, config, consumers=[collector],
        metadata={"calibration": calibration} if calibration else None, log=log,
    )  # fmt: skip
    capture_seconds = time.perf_counter() - started

    # -- ridge: layer selection and the residual base, from the fit shard's statistics
    selected = select_layers(layer_scores(train, ridge_lambda), top_k)
    solutions = {kind: solve_layers(train, kind, dict(enumerate(selected)), ridge_lambda) for kind in KINDS}
    num_rows = input_ids.shape[0]
    _record_calibration(calibration, num_rows, num_heldout, config, train)
    recorded_top_k = top_k if top_k is not None else layouts[0].num_layers
    mapper_config = _mlp_mapper_config(train, selected, recorded_top_k, ridge_lambda, config, calibration, **mapper_kwargs)
    state, report = _train_maps(collector, solutions, selected, layouts, config, device)
    del collector

    fit_seconds = round(time.perf_counter() - started, 3)
    mapper = KVMapper(dataclasses.replace(mapper_config, **_r2_fields(report, num_heldout, fit_seconds)))
    mapper.load_state_dict(state)
    mapper.report = {
        "mlp": _training_report(config, num_tokens, list(range(num_rows - num_heldout, num_rows)), memory, report),
        "timings": {"calibration_seconds": round(capture_seconds, 3), "fit_seconds": fit_seconds},
    }
    return mapper.float()


__all__ = ["FeatureCollector", "MLPTraining", "fit_mlp", "mlp_fit_nbytes", "train_mlp_map"]
