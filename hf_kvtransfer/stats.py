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
            x = flatten_layers(xs, index).to(self.device, self.dtype)
            y = flatten_layers(ys, index.to(ys[0].device)).to(self.device, self.dtype)
            if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
                raise ValueError(
                    f"non-finite {kind} states in a calibration batch (NaN/inf from the model); check the model "
                    "dtype (fp16 overflows are common; use bf16 or fp32) and the input ids"
                )
            self.tensors[f"{kind}.sum_x"] += x.sum(0)
            self.tensors[f"{kind}.sum_y"] += y.sum(0)
            self.tensors[f"{kind}.gram"].addmm_(x.T, x)
            self.tensors[f"{kind}.cross"].addmm_(x.T, y)
            self.tensors[f"{kind}.sq_y"] += (y * y).sum(0)
        self.count += int(index.numel())
        return int(index.numel())

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
        new = KVStatistics.__new__(KVStatistics)
        new.__dict__.update(self.__dict__)
        new.metadata = dict(self.metadata)
        new.tensors = {k: v.clone() for k, v in self.tensors.items()}
        return new

    def all_reduce(self, group=None) -> "KVStatistics":
        """Sum the statistics over all ranks of `torch.distributed` (in place)."""
        import torch.distributed as dist

        count = torch.tensor([float(self.count)], dtype=torch.float64, device=self.device)
        dist.all_reduce(count, group=group)
        for tensor in self.tensors.values():
            dist.all_reduce(tensor, group=group)
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
    def save(self, save_directory: str | os.PathLike) -> None:
        """Write `statistics.safetensors` + `statistics.json` atomically (temp files, then rename)."""
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        meta = {
            "count": self.count,
            "source_layout": vars(self.source_layout),
            "target_layout": vars(self.target_layout),
            "source_config": self.source_config,
            "target_config": self.target_config,
            "metadata": self.metadata,
        }
        tmp_tensors, tmp_meta = path / ".statistics.safetensors.tmp", path / ".statistics.json.tmp"
        save_file({k: v.detach().cpu().contiguous() for k, v in self.tensors.items()}, str(tmp_tensors))
        tmp_meta.write_text(json.dumps(meta, indent=2, sort_keys=True))
        # The tensors land first: a crash between the two renames leaves the old json, which a load detects.
        os.replace(tmp_tensors, path / "statistics.safetensors")
        os.replace(tmp_meta, path / "statistics.json")

    @classmethod
    def load(cls, save_directory: str | os.PathLike, device: torch.device | str = "cpu") -> "KVStatistics":
        path = Path(save_directory)
        meta_path, tensor_path = path / "statistics.json", path / "statistics.safetensors"
        if not meta_path.is_file() or not tensor_path.is_file():
            raise FileNotFoundError(f"no statistics in {path}: expected statistics.json and statistics.safetensors")
        meta = json.loads(meta_path.read_text())
        tensors = load_file(str(tensor_path), device=str(device))
        stats = cls(
            KVLayout(**meta["source_layout"]),
            KVLayout(**meta["target_layout"]),
            meta.get("source_config"),
            meta.get("target_config"),
            meta.get("metadata"),
            dtype=tensors["key.gram"].dtype,
            device=device,
        )
        expected = {name: t.shape for name, t in stats.tensors.items()}
        got = {name: t.shape for name, t in tensors.items()}
        if expected != got:
            raise ValueError(f"statistics in {path} do not match their layout: expected {expected}, got {got}")
        stats.tensors = tensors
        stats.count = int(meta["count"])
        return stats

    def __repr__(self) -> str:
        return (
            f"KVStatistics(tokens={self.count}, source={self.source_layout}, target={self.target_layout}, "
            f"{self.nbytes() / 2**20:.1f} MiB {self.dtype})"
        )
