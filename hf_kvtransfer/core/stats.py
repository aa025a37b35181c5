"""Streaming sufficient statistics for the ridge mapper: one pass, mergeable by addition, savable.

For each of keys and values, per token: x = concat over source layers and KV heads of the stripped
states (dim `L_s * n_kv_s * d_s`), y likewise for the target. The fit needs only sums over tokens:
count N, S_x, S_y, the Gram matrix G = sum x x^T, the cross matrix C = sum x y^T and the per-dim
second moments of y (for R^2). Sums merge by addition across batches, processes and resumed runs, and
any top-k or lambda can be solved from them without running the models again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

KINDS = ("key", "value")
_STAT_NAMES = ("sum_x", "sum_y", "gram", "cross", "sq_y")


@dataclass(frozen=True)
class KVLayout:
    """Shape of one model's KV cache: `num_layers` layers of `num_kv_heads` heads of `head_dim`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def layer_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def total_dim(self) -> int:
        return self.num_layers * self.layer_dim

    @classmethod
    def from_config(cls, config) -> "KVLayout":
        from .rope import head_dim_of, text_config

        config = text_config(config)
        return cls(config.num_hidden_layers, config.num_key_value_heads, head_dim_of(config))


def statistics_nbytes(source: KVLayout, target: KVLayout, dtype: torch.dtype = torch.float64) -> int:
    """Bytes the full statistics take: (G + C + sums) for keys and values."""
    ds, dt = source.total_dim, target.total_dim
    per_kind = ds * ds + ds * dt + ds + 2 * dt
    return 2 * per_kind * torch.empty(0, dtype=dtype).element_size()


def flatten_layers(states: list[torch.Tensor], token_index: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, H, T, D]` per layer -> `[tokens, L * H * D]`, keeping the tokens `token_index` selects in `[B*T]`."""
    # (B, H, T, D) -> (B, T, H*D) per layer, layers side by side.
    rows = torch.cat([s.transpose(1, 2).reshape(s.shape[0], s.shape[2], -1) for s in states], dim=-1)
    rows = rows.reshape(-1, rows.shape[-1])
    return rows if token_index is None else rows.index_select(0, token_index)


def token_selection(
    batch_size: int, seq_len: int, stride: int, attention_mask: torch.Tensor | None, device
) -> torch.Tensor:
    """Flat indices into `[B*T]` of the tokens used for statistics: every `stride`-th real token of a row."""
    if attention_mask is None:
        keep = torch.zeros(batch_size, seq_len, dtype=torch.bool, device=device)
        keep[:, ::stride] = True
    else:
        mask = attention_mask[:, :seq_len].to(device).bool()
        # Count positions from the first real token so padded and unpadded rows pick the same tokens.
        position = mask.long().cumsum(-1) - 1
        keep = mask & (position % stride == 0)
    return keep.reshape(-1).nonzero().squeeze(-1)


class KVStatistics:
    """Sufficient statistics of (source KV, target KV) pairs, for keys and values.

    Accumulate with `update`, combine with `merge` (or `+`), `all_reduce` across `torch.distributed`
    ranks, `save`/`load` to a directory. Accumulation is float64 by default: the plain sum of squares in
    float32 loses the centered signal at ~1e5 tokens.

    Args:
        source_layout, target_layout: `KVLayout` of the two models.
        source_config, target_config: the models' config dicts (kept so a mapper can be built later
            without loading either model).
        metadata: free-form JSON-serialisable facts (model ids, calibration data, stride, ...).
        dtype, device: where and in which precision the sums live.
    """

    def __init__(
        self,
        source_layout: KVLayout,
        target_layout: KVLayout,
        source_config: dict[str, Any] | None = None,
        target_config: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
    ):
        self.source_layout = source_layout
        self.target_layout = target_layout
        self.source_config = source_config or {}
        self.target_config = target_config or {}
        self.metadata = dict(metadata or {})
        self.count = 0
        ds, dt = source_layout.total_dim, target_layout.total_dim
        self.tensors: dict[str, torch.Tensor] = {}
        for kind in KINDS:
            self.tensors[f"{kind}.sum_x"] = torch.zeros(ds, dtype=dtype, device=device)
            self.tensors[f"{kind}.sum_y"] = torch.zeros(dt, dtype=dtype, device=device)
            self.tensors[f"{kind}.gram"] = torch.zeros(ds, ds, dtype=dtype, device=device)
            self.tensors[f"{kind}.cross"] = torch.zeros(ds, dt, dtype=dtype, device=device)
            self.tensors[f"{kind}.sq_y"] = torch.zeros(dt, dtype=dtype, device=device)

    # -- accumulation -------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.tensors["key.gram"].dtype

    @property
    def device(self) -> torch.device:
        return self.tensors["key.gram"].device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @torch.no_grad()
    def update(
        self,
        source_keys: list[torch.Tensor],
        source_values: list[torch.Tensor],
        target_keys: list[torch.Tensor],
        target_values: list[torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        stride: int = 4,
    ) -> int:
        """Add one batch of stripped states (lists of `[batch, kv_heads, seq, head_dim]`, one per layer).

        Returns:
            The number of tokens added (every `stride`-th real token of each row).
        """
        self._check_states(source_keys, self.source_layout, "source")
        self._check_states(target_keys, self.target_layout, "target")
        batch_size, _, seq_len, _ = source_keys[0].shape
        index = token_selection(batch_size, seq_len, stride, attention_mask, source_keys[0].device)
        for kind, xs, ys in (("key", source_keys, target_keys), ("value", source_values, target_values)):
            x = flatten_layers(xs, index).to(self.device)
            y = flatten_layers(ys, index.to(ys[0].device)).to(self.device)
            if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
                raise ValueError(
                    f"non-finite {kind} states in a calibration batch (NaN/inf from the model); check the model "
                    "dtype (fp16 overflows are common; use bf16 or fp32) and the input ids"
                )
            self._add(kind, x, y)
        self.count += int(index.numel())
        return int(index.numel())

    def _add(self, kind: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add features `x [n, D_s]`, `y [n, D_t]` to the raw sums of `kind`.

        With `product_dtype = torch.float32` (set on the object; the default on CUDA in
        `fit.accumulate_statistics`), float32 features go into float64 sums with the products in float32 on
        per-batch centered data and the mean part added back in float64 (Chan-style merge): half the CPU cost
        and far less on GPUs with slow float64, with errors ~1e-6 relative to the centered signal (not to the
        much larger raw second moments). The default multiplies in the sums' dtype (exact float64).
        """
        t = self.tensors
        fast = getattr(self, "product_dtype", self.dtype) == torch.float32
        if not (fast and self.dtype == torch.float64 and x.dtype == torch.float32 and y.dtype == torch.float32):
            x, y = x.to(self.dtype), y.to(self.dtype)
            t[f"{kind}.sum_x"] += x.sum(0)
            t[f"{kind}.sum_y"] += y.sum(0)
            t[f"{kind}.gram"].addmm_(x.T, x)
            t[f"{kind}.cross"].addmm_(x.T, y)
            t[f"{kind}.sq_y"] += (y * y).sum(0)
            return
        # sum x x^T = Xc^T Xc + s m^T + m s^T + n m m^T with Xc = X - m, s = sum(Xc): exact for any shift m.
        n = x.shape[0]
        mx, my = x.mean(0), y.mean(0)  # float32 shifts
        xc, yc = x - mx, y - my
        sx, sy = xc.sum(0, dtype=torch.float64), yc.sum(0, dtype=torch.float64)
        mx64, my64 = mx.double(), my.double()
        t[f"{kind}.sum_x"] += sx + n * mx64
        t[f"{kind}.sum_y"] += sy + n * my64
        t[f"{kind}.gram"] += (xc.T @ xc).double() + torch.outer(sx, mx64) + torch.outer(mx64, sx) + n * torch.outer(mx64, mx64)
        t[f"{kind}.cross"] += (xc.T @ yc).double() + torch.outer(sx, my64) + torch.outer(mx64, sy) + n * torch.outer(mx64, my64)
        t[f"{kind}.sq_y"] += (yc * yc).sum(0, dtype=torch.float64) + 2 * sy * my64 + n * my64 * my64

    def _check_states(self, states: list[torch.Tensor], layout: KVLayout, which: str) -> None:
        if len(states) != layout.num_layers:
            raise ValueError(f"expected {layout.num_layers} {which} layers, got {len(states)}")
        for layer_idx, s in enumerate(states):
            if s.ndim != 4 or s.shape[1] != layout.num_kv_heads or s.shape[3] != layout.head_dim:
                raise ValueError(
                    f"{which} layer {layer_idx}: expected [batch, {layout.num_kv_heads}, seq, {layout.head_dim}], "
                    f"got {list(s.shape)}"
                )

    # -- combination --------------------------------------------------------------------------------
    def _check_mergeable(self, other: "KVStatistics") -> None:
        if (self.source_layout, self.target_layout) != (other.source_layout, other.target_layout):
            raise ValueError(
                f"cannot merge statistics of different model pairs: {self.source_layout}->{self.target_layout} vs "
                f"{other.source_layout}->{other.target_layout}"
            )

    def merge(self, other: "KVStatistics") -> "KVStatistics":
        """Add `other`'s sums into this object (in place) and return it."""
        self._check_mergeable(other)
        for name, tensor in self.tensors.items():
            tensor += other.tensors[name].to(tensor.device, tensor.dtype)
        self.count += other.count
        return self

    def __add__(self, other: "KVStatistics") -> "KVStatistics":
        return self.copy().merge(other)

    def copy(self) -> "KVStatistics":
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.metadata = dict(self.metadata)
        new.tensors = {k: v.clone() for k, v in self.tensors.items()}
        return new

    def all_reduce(self, group=None) -> "KVStatistics":
        """Sum the statistics over all ranks of `torch.distributed` (in place)."""
        import torch.distributed as dist

        # NCCL reduces only CUDA tensors: CPU-resident sums travel through this rank's GPU.
        device = self.device
        if dist.get_backend(group) == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        count = torch.tensor([float(self.count)], dtype=torch.float64, device=device)
        dist.all_reduce(count, group=group)
        for name, tensor in self.tensors.items():
            reduced = tensor.to(device)
            dist.all_reduce(reduced, group=group)
            self.tensors[name] = reduced.to(self.device) if reduced is not tensor else tensor
        self.count = int(count.item())
        return self

    # -- views used by the solver -------------------------------------------------------------------
    def centered(self, kind: str) -> dict[str, torch.Tensor]:
        """Centered second moments of `kind` ('key' or 'value'): G_c, C_c, diag(Syy_c) and the means."""
        if self.count < 2:
            raise ValueError(f"statistics hold {self.count} tokens; need at least 2 (feed more calibration data)")
        n = float(self.count)
        t = {name: self.tensors[f"{kind}.{name}"] for name in _STAT_NAMES}
        mean_x, mean_y = t["sum_x"] / n, t["sum_y"] / n
        return {
            "gram": t["gram"] - torch.outer(t["sum_x"], mean_x),
            "cross": t["cross"] - torch.outer(t["sum_x"], mean_y),
            "var_y": t["sq_y"] - t["sum_y"] * mean_y,
            "mean_x": mean_x,
            "mean_y": mean_y,
        }

    # -- persistence --------------------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "source_layout": vars(self.source_layout),
            "target_layout": vars(self.target_layout),
            "source_config": self.source_config,
            "target_config": self.target_config,
            "metadata": self.metadata,
        }

    @classmethod
    def _from_state(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any], where: str) -> "KVStatistics":
        stats = cls(
            KVLayout(**meta["source_layout"]),
            KVLayout(**meta["target_layout"]),
            meta.get("source_config"),
            meta.get("target_config"),
            meta.get("metadata"),
            dtype=tensors["key.gram"].dtype,
            device="meta",
        )
        expected = {name: tuple(t.shape) for name, t in stats.tensors.items()}
        got = {name: tuple(t.shape) for name, t in tensors.items()}
        if expected != got:
            raise ValueError(f"statistics in {where} do not match their layout: expected {expected}, got {got}")
        stats.tensors = tensors
        stats.count = int(meta["count"])
        return stats

    def save(self, save_directory: str | os.PathLike) -> None:
        """Write `statistics.safetensors` (+ a readable `statistics.json`) atomically.

        The safetensors header carries the metadata too, and it is written to a temp file and renamed in
        one step, so a crash at any moment leaves either the old or the new statistics, never a mix.
        """
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        meta = json.dumps(self.meta(), indent=2, sort_keys=True)
        tmp_tensors, tmp_meta = path / ".statistics.safetensors.tmp", path / ".statistics.json.tmp"
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.tensors.items()}
        save_file(tensors, str(tmp_tensors), metadata={"statistics": meta})
        tmp_meta.write_text(meta)
        os.replace(tmp_tensors, path / "statistics.safetensors")
        os.replace(tmp_meta, path / "statistics.json")

    @classmethod
    def load(cls, save_directory: str | os.PathLike, device: torch.device | str = "cpu") -> "KVStatistics":
        """Load statistics written by `save` (the metadata is read from the safetensors header)."""
        from safetensors import safe_open

        path = Path(save_directory)
        tensor_path = path / "statistics.safetensors"
        if not tensor_path.is_file():
            raise FileNotFoundError(f"no statistics in {path}: expected statistics.safetensors (written by save())")
        with safe_open(str(tensor_path), framework="pt") as f:
            header = (f.metadata() or {}).get("statistics")
        if header is None:  # written by an older version: metadata only in the json side file
            meta_path = path / "statistics.json"
            if not meta_path.is_file():
                raise FileNotFoundError(f"no statistics metadata in {path}: statistics.json is missing")
            header = meta_path.read_text()
        tensors = load_file(str(tensor_path), device=str(device))
        return statistics_from_state(tensors, json.loads(header), str(path))

    def __repr__(self) -> str:
        return (
            f"KVStatistics(tokens={self.count}, source={self.source_layout}, target={self.target_layout}, "
            f"{self.nbytes() / 2**20:.1f} MiB {self.dtype})"
        )


class BlockStatistics(KVStatistics):
    """Bounded-memory statistics: only the Gram and cross blocks that fixed layer selections need.

    The second stage of the two-stage fit: once a probe has chosen, for each target layer t, the
    source layers `selections[t]` it may read, the fit needs only G[s, s'] for s, s' in one selection and
    C[s, t] for s in selections[t] (plus the small sums). Memory is then about
    `L_t * (k^2 F_s^2 + k F_s F_t)` numbers per kind instead of `(L_s F_s)^2 + L_s F_s L_t F_t`. Any k up to
    the selections' size can be solved (top-k is nested in the probe ranking `scores`).

    Args:
        selections: per target layer, the source layers to keep blocks for (the union of the probe's
            top-`max_top_k` under each probed lambda).
        scores: the probe's `[L_s, L_t]` single-source R^2 used to rank layers at solve time, per ridge lambda
            (`{lambda: scores}`; a bare tensor is the ranking at lambda 0.01). A solve at a lambda the probe did
            not rank with is refused (the ranking depends on lambda).
        max_top_k: the largest k every lambda's selection is complete for (default: the smallest selection).
    """

    def __init__(
        self,
        source_layout: KVLayout,
        target_layout: KVLayout,
        selections: list[list[int]],
        scores: torch.Tensor,
        source_config: dict[str, Any] | None = None,
        target_config: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
        max_top_k: int | None = None,
    ):
        if len(selections) != target_layout.num_layers:
            raise ValueError(f"need one selection per target layer ({target_layout.num_layers}), got {len(selections)}")
        self.source_layout, self.target_layout = source_layout, target_layout
        self.source_config, self.target_config = source_config or {}, target_config or {}
        self.metadata = dict(metadata or {})
        self.count = 0
        self.selections = [sorted(int(s) for s in sel) for sel in selections]
        if not isinstance(scores, dict):
            scores = {0.01: scores}
        self.scores = {float(lam): torch.as_tensor(v, dtype=torch.float64).cpu() for lam, v in scores.items()}
        self._max_top_k = max_top_k
        self.gram_pairs = sorted({(a, b) for sel in self.selections for a in sel for b in sel if a <= b})
        self.cross_pairs = sorted({(s, t) for t, sel in enumerate(self.selections) for s in sel})
        fs, ft = source_layout.layer_dim, target_layout.layer_dim
        self.tensors = {}
        for kind in KINDS:
            self.tensors[f"{kind}.sum_x"] = torch.zeros(source_layout.total_dim, dtype=dtype, device=device)
            self.tensors[f"{kind}.sum_y"] = torch.zeros(target_layout.total_dim, dtype=dtype, device=device)
            self.tensors[f"{kind}.sq_y"] = torch.zeros(target_layout.total_dim, dtype=dtype, device=device)
            for a, b in self.gram_pairs:
                self.tensors[f"{kind}.gram.{a}.{b}"] = torch.zeros(fs, fs, dtype=dtype, device=device)
            for s, t in self.cross_pairs:
                self.tensors[f"{kind}.cross.{s}.{t}"] = torch.zeros(fs, ft, dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors["key.sum_x"].dtype

    @property
    def device(self) -> torch.device:
        return self.tensors["key.sum_x"].device

    @property
    def max_top_k(self) -> int:
        return self._max_top_k if self._max_top_k is not None else min(len(sel) for sel in self.selections)

    def scores_at(self, ridge_lambda: float) -> torch.Tensor:
        """The probe's `[L_s, L_t]` ranking scores at `ridge_lambda` (refused for a lambda it was not run with)."""
        for lam, scores in self.scores.items():
            if abs(lam - float(ridge_lambda)) <= 1e-12 * max(1.0, abs(lam)):
                return scores
        raise ValueError(
            f"the two-stage probe ranked layers at ridge_lambda {sorted(self.scores)}, not at {ridge_lambda}: the "
            "ranking depends on lambda; solve with one of those, or refit listing every lambda you want"
        )

    def _check_mergeable(self, other: "KVStatistics") -> None:
        super()._check_mergeable(other)
        if getattr(other, "selections", None) != self.selections:
            raise ValueError("cannot merge block statistics kept for different layer selections")

    @torch.no_grad()
    def add_features(self, kind: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add materialised features `x [tokens, L_s*F_s]`, `y [tokens, L_t*F_t]` of one kind (no count change)."""
        fs, ft = self.source_layout.layer_dim, self.target_layout.layer_dim
        x, y = x.to(self.device, self.dtype), y.to(self.device, self.dtype)
        t = self.tensors
        t[f"{kind}.sum_x"] += x.sum(0)
        t[f"{kind}.sum_y"] += y.sum(0)
        t[f"{kind}.sq_y"] += (y * y).sum(0)
        for a, b in self.gram_pairs:
            t[f"{kind}.gram.{a}.{b}"].addmm_(x[:, a * fs : (a + 1) * fs].T, x[:, b * fs : (b + 1) * fs])
        for s, tl in self.cross_pairs:
            t[f"{kind}.cross.{s}.{tl}"].addmm_(x[:, s * fs : (s + 1) * fs].T, y[:, tl * ft : (tl + 1) * ft])

    @torch.no_grad()
    def update(self, source_keys, source_values, target_keys, target_values, attention_mask=None, stride: int = 4) -> int:
        self._check_states(source_keys, self.source_layout, "source")
        self._check_states(target_keys, self.target_layout, "target")
        batch_size, _, seq_len, _ = source_keys[0].shape
        index = token_selection(batch_size, seq_len, stride, attention_mask, source_keys[0].device)
        for kind, xs, ys in (("key", source_keys, target_keys), ("value", source_values, target_values)):
            x, y = flatten_layers(xs, index), flatten_layers(ys, index.to(ys[0].device))
            if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
                raise ValueError(f"non-finite {kind} states in a calibration batch (NaN/inf from the model)")
            self.add_features(kind, x, y)
        self.count += int(index.numel())
        return int(index.numel())

    def centered(self, kind: str):
        raise NotImplementedError("block statistics hold no full Gram matrix; use system(kind, target_layer, selected)")

    def system(self, kind: str, target_layer: int, selected: list[int]):
        """Centered `(gram [n, n], cross [n, F_t], var_y [F_t], mean_x [n], mean_y [F_t])` for one target layer."""
        if self.count < 2:
            raise ValueError(f"statistics hold {self.count} tokens; need at least 2 (feed more calibration data)")
        missing = sorted(set(selected) - set(self.selections[target_layer]))
        if missing:
            raise ValueError(
                f"target layer {target_layer}: source layers {missing} were not kept by the two-stage probe "
                f"(kept {self.selections[target_layer]}); ask for top_k <= {self.max_top_k} or run the full mode"
            )
        fs, ft = self.source_layout.layer_dim, self.target_layout.layer_dim
        t, n = self.tensors, float(self.count)
        sel = sorted(selected)
        mean_x = torch.cat([t[f"{kind}.sum_x"][s * fs : (s + 1) * fs] for s in sel]).double() / n
        tl = slice(target_layer * ft, (target_layer + 1) * ft)
        sum_y, sq_y = t[f"{kind}.sum_y"][tl].double(), t[f"{kind}.sq_y"][tl].double()
        mean_y = sum_y / n
        rows = []
        for a in sel:
            rows.append(torch.cat([
                t[f"{kind}.gram.{a}.{b}"] if a <= b else t[f"{kind}.gram.{b}.{a}"].T for b in sel
            ], dim=1))  # fmt: skip
        gram = torch.cat(rows, dim=0).double() - n * torch.outer(mean_x, mean_x)
        cross = torch.cat([t[f"{kind}.cross.{s}.{target_layer}"] for s in sel]).double() - n * torch.outer(mean_x, mean_y)
        return gram, cross, sq_y - sum_y * mean_y, mean_x, mean_y

    def meta(self) -> dict[str, Any]:
        return {
            **super().meta(),
            "selections": self.selections,
            "scores": {repr(lam): v.tolist() for lam, v in self.scores.items()},
            "max_top_k": self.max_top_k,
        }

    @classmethod
    def _from_state(cls, tensors, meta, where: str) -> "BlockStatistics":
        scores = meta["scores"]  # {lambda: [L_s, L_t]}; a bare list (older files) was ranked at lambda 0.01
        scores = {float(k): torch.tensor(v) for k, v in scores.items()} if isinstance(scores, dict) else torch.tensor(scores)
        stats = cls(
            KVLayout(**meta["source_layout"]), KVLayout(**meta["target_layout"]), meta["selections"], scores,
            meta.get("source_config"), meta.get("target_config"), meta.get("metadata"),
            dtype=tensors["key.sum_x"].dtype, device="meta", max_top_k=meta.get("max_top_k"),
        )  # fmt: skip
        expected = {name: tuple(t.shape) for name, t in stats.tensors.items()}
        if expected != {name: tuple(t.shape) for name, t in tensors.items()}:
            raise ValueError(f"block statistics in {where} do not match their selections")
        stats.tensors, stats.count = tensors, int(meta["count"])
        return stats


def statistics_from_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any], where: str) -> KVStatistics:
    """`KVStatistics` or `BlockStatistics`, whichever `meta` describes."""
    cls = BlockStatistics if "selections" in meta else KVStatistics
    return cls._from_state(tensors, meta, where)


def block_statistics_nbytes(source: KVLayout, target: KVLayout, max_top_k: int, dtype=torch.float64) -> int:
    """Upper bound on `BlockStatistics` bytes for selections of `max_top_k` layers (disjoint worst case)."""
    fs, ft, k = source.layer_dim, target.layer_dim, min(max_top_k, source.num_layers)
    pairs = min(target.num_layers * k * (k + 1) // 2, source.num_layers * (source.num_layers + 1) // 2)
    per_kind = pairs * fs * fs + min(target.num_layers * k, source.num_layers * target.num_layers) * fs * ft
    per_kind += source.total_dim + 2 * target.total_dim
    return 2 * per_kind * torch.empty(0, dtype=dtype).element_size()
