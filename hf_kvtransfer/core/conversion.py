"""How a `TransferredCache` converts its pending target layers: which layers are mapped together, and the state
held for them until they are (the source layers still read, RoPE tables, features shared by several layers, layers
computed ahead), with the one conversion path of a layer: strip source RoPE -> map -> apply target RoPE."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .layer_maps import LinearParts
from .map_inputs import map_state, writable
from .mapper import KVMapper
from .rope import rotary_cos_sin, rotate_, rotate_into

# Affine maps of target layers that read the same source layers run as one GEMM of up to this many output features
# per kind: on CPU one wide product beats several skinny ones, which are dominated by packing the shared input
# (`hf-kvtransfer bench` times the grouped transfer). Big models' layers (n_kv * d >= 1024) map one at a time, so what is
# computed ahead of the layers asking for it stays at most about one layer's KV.
GROUP_OUT_FEATURES = 1024

# A group's weights are concatenated for its one GEMM (a transient copy, freed when the group is done) only up to
# this size; past it each layer's GEMM writes its columns of the group output instead. Nothing derived from the
# mapper outlives a conversion: a transfer holds no second copy of the mapper.
STACK_BYTES = 64 * 2**20

# Reduced-rank maps whose dense weight has at most this many entries are applied densely: there the factored
# path's fixed costs (two skinny GEMMs per layer) outweigh the multiply-adds it saves.
SMALL_MAP_ENTRIES = 2**18


def take_densely(parts: list[LinearParts], tokens: int) -> bool:
    """Whether a group's maps run as dense products (one wide GEMM) rather than factored, for `tokens` rows: always
    for full-rank maps; for reduced-rank ones when small (`SMALL_MAP_ENTRIES`) or when forming `up @ down` and
    applying it costs at most twice the factors' multiply-adds (two skinny GEMMs and a strided write per layer run
    at about half the speed of one wide GEMM on CPU)."""
    if all(p.down is None for p in parts):
        return True
    if all(p.in_features * p.out_features <= SMALL_MAP_ENTRIES for p in parts):
        return True
    return sum(p.macs(tokens, dense=True) for p in parts) <= 2 * sum(p.macs(tokens, dense=False) for p in parts)


def plan_group(mapper: KVMapper, layer_idx: int, pending: Iterable[int], tokens: int) -> tuple[tuple[int, ...], bool]:
    """The target layers converted together with `layer_idx` (it first), and whether their maps run densely on
    `tokens` rows.

    Affine maps of the same type reading the same source layers are grouped, up to `GROUP_OUT_FEATURES` outputs;
    other maps (MLP) run one layer at a time (the flag is then False).
    """
    layer_map = mapper.layers[layer_idx]
    parts = layer_map.linear_parts("key")
    if parts is None:
        return (layer_idx,), False
    selections = mapper.config.selected_layers
    same = [
        t for t in sorted(pending)
        if t >= layer_idx and selections[t] == selections[layer_idx] and type(mapper.layers[t]) is type(layer_map)
    ]  # fmt: skip
    group = tuple(same[: max(1, GROUP_OUT_FEATURES // parts.out_features)])
    dense = take_densely([mapper.layers[t].linear_parts(kind) for t in group for kind in ("key", "value")], tokens)
    return group, dense


def conversion_groups(mapper: KVMapper, tokens: int, num_exact_layers: int = 0) -> list[tuple[tuple[int, ...], bool]]:
    """How `TransferredCache` maps the target layers after its first `num_exact_layers` (which the target computes
    itself) for a cache of `tokens` tokens (batch x length), converted in order as a forward does: `(layers mapped
    together, taken densely)` per group; the flag is False for factored reduced-rank maps and for nonlinear (MLP)
    maps, which are mapped one layer at a time."""
    pending = set(range(num_exact_layers, len(mapper.layers)))
    groups = []
    while pending:
        group, dense = plan_group(mapper, min(pending), pending, tokens)
        pending.difference_update(group)
        groups.append((group, dense))
    return groups


# -- the state of a transfer that is not finished yet, and its conversion ------------------------------------------


@dataclass
class SourceLayer:
    """One source layer the mapper reads, until every target layer reading it is converted."""

    keys: torch.Tensor  # (B, H_s, T, D_s), the transferred tokens only; the caller's tensors, never written
    values: torch.Tensor
    readers: set[int]  # target layers still to convert that read this layer
    stripped: tuple[torch.Tensor, torch.Tensor] | None = None  # (B, T, H_s * D_s) features, shared by selections

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.keys, self.values, self.stripped = fn(self.keys), fn(self.values), None


@dataclass
class RopeTables:
    """cos/sin `[batch, 1, seq, rotary_dim]` at the transferred positions, computed once per (table, device, dtype).

    For the source ("strip") the inverse rotation is folded in: `(cos, -sin) / (cos^2 + sin^2)`, so stripping is the
    same multiply-add as applying RoPE (`rope.rotate_into`) and removes the rope type's attention scaling.
    """

    rotary: Callable[[str, torch.device], nn.Module]  # ("source" | "target", device) -> rotary module (`KVMapper.rotary`)
    position_ids: torch.Tensor  # (B, T)
    tables: dict[tuple[str, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def get(self, which: str, device: torch.device, dtype: torch.dtype = torch.float32):
        key = (which, torch.device(device), dtype)
        if key not in self.tables:
            if dtype != torch.float32:  # computed in float32, as the models' own rotary modules do, then cast
                self.tables[key] = tuple(t.to(dtype) for t in self.get(which, device))
            else:
                rotary = self.rotary("source" if which == "strip" else "target", key[1])
                cos, sin = rotary_cos_sin(rotary, self.position_ids.to(device), device)
                if which == "strip":
                    norm = cos * cos + sin * sin
                    cos, sin = cos / norm, -sin / norm
                self.tables[key] = (cos, sin)
        return self.tables[key]

    def map_positions(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.position_ids = fn(self.position_ids)
        self.tables.clear()


@dataclass
class PendingTransfer:
    """Everything a `TransferredCache` holds for target layers not converted yet, and how they are converted (strip
    source RoPE -> map -> apply target RoPE); dropped when the last one is."""

    mapper: KVMapper
    sources: dict[int, SourceLayer]
    rope: RopeTables
    length: int  # transferred tokens
    batch_size: int
    attention_mask: torch.Tensor | None  # (B, T) of the transferred tokens, when the source prefill had one
    # Side-by-side features of a multi-layer selection, shared by the target layers that read it.
    features: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Finished target K/V of group members computed together with an earlier layer of their group.
    ahead: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Non-finite flags of stripped source layers on accelerators, checked once after the last layer (no host sync).
    nonfinite: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # Each map input's state for this transfer, by name (`map_inputs.py`): a tensor that follows the batch and length
    # operations (the residual features `[B, T, F]`, rows of ids `[B, T, lags]`) or the target's modules.
    inputs: dict[str, Any] = field(default_factory=dict)

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch or length operation (beam reorder, crop, ...) to what is not converted yet."""
        for layer in self.sources.values():
            layer.map_tensors(fn)
        self.rope.map_positions(fn)
        self.attention_mask = fn(self.attention_mask) if self.attention_mask is not None else None
        self.features.clear()
        # Finished layers waiting to be stored (the exact pass's own K/V, the rest of a mapped group) follow the
        # operation: the exact layers' sources are gone, and a row or length operation commutes with the maps.
        self.ahead = {t: (fn(k), fn(v)) for t, (k, v) in self.ahead.items()}
        self.inputs = {name: map_state(state, fn) for name, state in self.inputs.items()}
        if self.sources:
            self.batch_size = next(iter(self.sources.values())).keys.shape[0]
        elif self._rows() is not None:  # maps without source inputs: an input's state holds the rows
            self.batch_size = self._rows().shape[0]
        elif self.ahead:  # or only finished layers (the exact pass's) hold them
            self.batch_size = next(iter(self.ahead.values()))[0].shape[0]

    # The cache operations of transformers' cache layers (`CacheLayerMixin`), for what is not converted yet: a
    # `TransferredCache` hands each to this state, as transformers' `Cache` hands it to each of its layers.
    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"`crop` takes a negative number of tokens to remove, got {tokens_to_remove} (as DynamicCache)")
        self.length -= min(-tokens_to_remove, self.length)
        keep = self.length
        self.map_tensors(lambda t: t[..., :keep, :] if t.ndim == 4 else t[:, :keep])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        rows = beam_idx.numel()
        if rows != self.batch_size and rows % self.batch_size == 0:  # beam search's first reorder: rows expanded
            self.batch_repeat_interleave(rows // self.batch_size)
        self.map_tensors(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.map_tensors(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.map_tensors(lambda t: t[indices.to(t.device)])

    def _rows(self) -> torch.Tensor | None:
        """An input's `[B, T, ...]` state, for maps without source inputs (None when no input holds one)."""
        return next((s for s in self.inputs.values() if isinstance(s, torch.Tensor)), None)

    def nbytes(self) -> int:
        tensors = [t for layer in self.sources.values() for t in (layer.keys, layer.values, *(layer.stripped or ()))]
        tensors += [t for pair in (*self.features.values(), *self.ahead.values(), *self.rope.tables.values()) for t in pair]
        tensors += [t for t in self.inputs.values() if isinstance(t, torch.Tensor)]
        # Views share storage (the caller's tensors, buffers of a selection): count each storage once.
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    def _feature_dtype(self, source_dtype: torch.dtype) -> torch.dtype:
        # The wider of the source's and the mapper's dtype: a bf16 source is stripped at a float32 mapper's
        # precision, and a float32 source for a bf16 mapper is stripped in float32 and cast once by the map
        # (writing RoPE results into a narrower buffer takes PyTorch's mixed-dtype path, slow on CPU).
        return torch.promote_types(source_dtype, self.mapper.dtype)

    def _strip_into(self, s: int, key_out: torch.Tensor, value_out: torch.Tensor) -> None:
        """Write stripped source layer `s` into `[batch, seq, heads, head_dim]` buffers (any dtype)."""
        layer = self.sources[s]
        keys, values = layer.keys, layer.values
        cos, sin = self.rope.get("strip", keys.device)
        # (B, H, T, D) -> (B, T, H, D) by writing through a transposed view: the transpose costs no extra pass.
        rotate_into(keys, cos, sin, key_out.transpose(1, 2))
        value_out.transpose(1, 2).copy_(values)
        # One reduction over the (contiguous) source tensors instead of isfinite().all(): NaN and inf survive a
        # float32 sum, and reading the source is cheaper than reading strided output slots.
        bad = ~torch.isfinite(keys.sum(dtype=torch.float32) + values.sum(dtype=torch.float32))
        if keys.device.type == "cpu":
            if bool(bad):
                raise ValueError(f"source cache layer {s} has non-finite values (NaN/inf); check the source model's dtype")
        else:
            self.nonfinite.append((s, bad))

    def _stripped_source(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE-stripped source layer `s` as `[batch, seq, heads * head_dim]` (see `_feature_dtype`), once per layer."""
        layer = self.sources[s]
        if layer.stripped is None:
            batch, heads, seq, dim = layer.keys.shape
            dtype = self._feature_dtype(layer.keys.dtype)
            out = [torch.empty(batch, seq, heads, dim, dtype=dtype, device=layer.keys.device) for _ in "kv"]
            self._strip_into(s, *out)
            layer.stripped = tuple(o.view(batch, seq, heads * dim) for o in out)
        return layer.stripped

    def _selection_features(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stripped features of target layer `layer_idx`'s source layers side by side: `[batch, seq, k * H * D]`.

        Target layers that read the same source layers share one buffer, and each source layer is stripped
        straight into its slot, so the common case (every target layer reads the same layers) costs no copy.
        """
        selected = tuple(self.mapper.config.selected_layers[layer_idx])
        if not selected:  # a map without source inputs (the residual alone, or the calibration mean)
            # Rows and tokens as the residual holds them (it follows beam reorders and crops like the sources do).
            rows = self._rows()
            batch, seq = rows.shape[:2] if rows is not None else (self.batch_size, self.length)
            empty = torch.empty(batch, seq, 0, dtype=self.mapper.dtype)
            return empty, empty
        if len(selected) == 1:
            return self._stripped_source(selected[0])
        transfer = self
        if selected not in transfer.features:
            ref = transfer.sources[selected[0]].keys  # a pending layer's sources are never freed
            batch, seq = ref.shape[0], ref.shape[2]
            layout = self.mapper.source_layout
            shape = (batch, seq, len(selected), layout.num_kv_heads, layout.head_dim)
            buffers = [torch.empty(shape, dtype=self._feature_dtype(ref.dtype), device=ref.device) for _ in "kv"]
            for j, s in enumerate(selected):
                layer = transfer.sources[s]
                if layer.stripped is not None:  # stripped before for another selection: one copy, as a cat would do
                    for buf, feats in zip(buffers, layer.stripped):
                        buf[:, :, j].copy_(feats.view(batch, seq, layout.num_kv_heads, layout.head_dim))
                    continue
                self._strip_into(s, buffers[0][:, :, j], buffers[1][:, :, j])
                selections = {tuple(self.mapper.config.selected_layers[t]) for t in layer.readers}
                if len(selections) > 1:  # another selection reads this layer too: keep a view (no copy) for it
                    layer.stripped = tuple(b[:, :, j].reshape(batch, seq, -1) for b in buffers)
            transfer.features[selected] = tuple(b.view(batch, seq, -1) for b in buffers)
        return transfer.features[selected]

    def _affine_rows(self, group: tuple[int, ...], kind: str, x: torch.Tensor, dense: bool) -> torch.Tensor:
        """`[B, T, len(group) * F_out]`: the group's affine maps of `kind` applied to features `x` `[B, T, F_in]`,
        target layers side by side in (layer, head, dim) order."""
        parts = [self.mapper.layers[t].linear_parts(kind) for t in group]
        if x.shape[-1] == 0:  # maps that read no source layer (only other inputs): their bias, broadcast, not copied
            bias = torch.cat([p.bias for p in parts]) if len(parts) > 1 else parts[0].bias
            return bias.to(x.device).expand(*x.shape[:-1], -1)
        x2 = x.flatten(0, -2)  # (B*T, F_in)
        width = parts[0].out_features
        if dense:
            weights = [p.dense_weight() for p in parts]
            if len(parts) == 1 or sum(w.numel() * w.element_size() for w in weights) <= STACK_BYTES:
                weight, bias = (torch.cat(ts) if len(ts) > 1 else ts[0] for ts in (weights, [p.bias for p in parts]))
                out = nn.functional.linear(x2.to(weight.dtype), weight.to(x.device), bias.to(x.device))
                return out.view(*x.shape[:-1], -1)
            inputs = [x2.to(weights[0].dtype)] * len(parts)
            mats = [(w, p.bias) for w, p in zip(weights, parts)]
        else:
            # Factored: the group's `down` projections in one GEMM, then each layer's `up` into its columns.
            down = torch.cat([p.down for p in parts]) if len(parts) > 1 else parts[0].down
            codes = nn.functional.linear(x2.to(down.dtype), down.to(x.device))  # (B*T, sum r)
            inputs = list(codes.split([p.down.shape[0] for p in parts], dim=1))
            mats = [(p.up, p.bias) for p in parts]
        out = torch.empty(x2.shape[0], len(parts) * width, dtype=inputs[0].dtype, device=x.device)
        for i, (inp, (weight, bias)) in enumerate(zip(inputs, mats)):
            torch.addmm(bias.to(x.device), inp, weight.to(x.device).T, out=out[:, i * width : (i + 1) * width])
        return out.view(*x.shape[:-1], -1)

    def _finish(self, key_rows: torch.Tensor, value_rows: torch.Tensor, num_layers: int, like: torch.Tensor,
                owned: bool = True):
        """Target K/V of `num_layers` layers from their mapped outputs: RoPE applied, in `like`'s dtype and device.

        Args:
            key_rows / value_rows: `[B, T, num_layers * n_kv * d]` stripped keys / values, (layer, head, dim) order.
            owned: whether the key rows are this transfer's to overwrite (the maps' output; a broadcast view is
                copied first), else they are left as they are.

        Returns:
            `(keys, values)`, each `[num_layers, B, n_kv, T, d]`: views of `[B, T, layers, n_kv, d]` buffers in the
            rows' own order, so no pass transposes them. The first forward over the cache concatenates its new
            tokens onto each layer (transformers' `DynamicLayer.update`), a copy it makes anyway, and that copy lays
            the layer out contiguously; attention reads the strided views as they are.
        """
        tgt = self.mapper.target_layout
        batch, seq = key_rows.shape[:2]
        dtype = like.dtype
        rows_shape = (batch, seq, num_layers, tgt.num_kv_heads, tgt.head_dim)
        # RoPE runs in the cache dtype, or in the map's when that is wider (a float32 map into a bf16 cache is
        # rounded once, at the end). Narrower map outputs are widened first, in one contiguous pass: mixed-dtype
        # elementwise kernels are several times slower on CPU.
        rope_dtype = torch.promote_types(key_rows.dtype, dtype)
        rows = key_rows.to(device=like.device, dtype=rope_dtype)
        # (B, 1, T, rotary) -> (B, T, 1, 1, rotary): broadcast over layers and heads
        cos, sin = (t.transpose(1, 2).unsqueeze(2) for t in self.rope.get("apply", like.device, rope_dtype))
        # in place in rows the maps made (a broadcast bias copied), else in a copy
        keys = rotate_((writable(rows) if owned else rows.clone()).view(rows_shape), cos, sin)
        values = writable(value_rows.to(device=like.device, dtype=dtype)).view(rows_shape)  # a broadcast bias: copied
        return tuple(t.to(dtype).permute(2, 0, 3, 1, 4) for t in (keys, values))

    @torch.no_grad()
    def own_first_layer(self, rows: tuple[torch.Tensor, torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's own layer-0 keys and values `[B, n_kv, T, d]` from their RoPE-free rows `[B, T, n_kv * d]`
        (looked up per token id by a map input: `MapInput.first_layer_rows`), the target's RoPE applied; in `like`'s
        dtype."""
        keys, values = self._finish(*rows, 1, like, owned=False)
        return keys[0], values[0]

    def mapped(self, layer_idx: int, like: torch.Tensor, pending: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Finished target keys and values of `layer_idx` `[B, n_kv, T, d]`, computed with the other layers of its
        group (which then wait, finished, in `ahead`); `pending` are the target layers not converted yet."""
        transfer = self
        if layer_idx not in transfer.ahead:
            key_feats, value_feats = (f.to(like.device) for f in self._selection_features(layer_idx))
            group, dense = plan_group(self.mapper, layer_idx, pending, key_feats.shape[0] * key_feats.shape[1])
            if self.mapper.layers[layer_idx].linear_parts("key") is None:  # nonlinear: the map's own forward
                rows = self.mapper.layers[layer_idx](key_feats, value_feats)
            else:
                rows = [self._affine_rows(group, kind, x, dense) for kind, x in (("key", key_feats), ("value", value_feats))]
                for inp in self.mapper.map_inputs:  # what the maps read beyond the source, in their order
                    rows = inp.apply(self.inputs.get(inp.name), group, rows)
            keys, values = self._finish(*rows, len(group), like)
            for i, t in enumerate(group):
                transfer.ahead[t] = (keys[i], values[i])
        keys, values = transfer.ahead.pop(layer_idx)
        # Computed with an earlier layer of the group, which under a device map may live elsewhere.
        return keys.to(like.device, like.dtype), values.to(like.device, like.dtype)
