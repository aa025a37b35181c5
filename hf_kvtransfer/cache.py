"""TransferredCache: a `DynamicCache` for the target model, filled lazily from the source model's cache."""

from __future__ import annotations

import copy
import functools
import operator
import os
import warnings
from typing import Any

import torch
from torch import nn
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

from .mapper import KVMapper, _LinearLayerMap, _LowRankLayerMap, _LowRankLinear
from .rope import position_ids_from_mask, rotary_cos_sin


@functools.lru_cache(maxsize=8)
def _load_mapper(name_or_path: str, revision: str | None, token: str | bool | None) -> KVMapper:
    # One load per process: a cache is built per request, the mapper is shared.
    return KVMapper.from_pretrained(name_or_path, revision=revision, token=token)


def _source_layers(source_cache: Cache | tuple) -> list[tuple[torch.Tensor | None, torch.Tensor | None, Any]]:
    """`(keys, values, layer)` per source layer from a transformers `Cache` or a legacy tuple of pairs."""
    if isinstance(source_cache, Cache):
        return [(getattr(layer, "keys", None), getattr(layer, "values", None), layer) for layer in source_cache.layers]
    if isinstance(source_cache, (tuple, list)):
        return [(kv[0], kv[1], None) for kv in source_cache]
    raise TypeError(
        f"source_cache must be a transformers Cache (e.g. from `prefill(source, input_ids)`) or a tuple of "
        f"(key, value) pairs, got {type(source_cache).__name__}"
    )


def _rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out = x * cos + rotate_half(x) * sin` on the rotary dims (the rest copied), with no temporaries.

    Same math as `rope.apply_rope` (and, with the folded tables of `_rope_tables("strip")`, `rope.strip_rope`)
    in four fused multiply-adds over half-width views; `out` may be a strided view and of another dtype.
    """
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    o1, o2 = out[..., :half], out[..., half:rotary_dim]
    torch.mul(x1, cos[..., :half], out=o1)
    o1.addcmul_(x2, sin[..., :half], value=-1)
    torch.mul(x2, cos[..., half:], out=o2)
    o2.addcmul_(x1, sin[..., half:])
    if rotary_dim < x.shape[-1]:
        out[..., rotary_dim:].copy_(x[..., rotary_dim:])
    return out


@functools.lru_cache(maxsize=1)
def _compiled_rope():
    """`torch.compile`d RoPE (one fused loop instead of four passes), returning a contiguous tensor of `dtype`."""

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rotary_dim = cos.shape[-1]
        half = rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        parts = [x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:]]
        if rotary_dim < x.shape[-1]:
            parts.append(x[..., rotary_dim:].to(parts[0].dtype))
        return torch.cat(parts, dim=-1).to(dtype).contiguous()

    return torch.compile(rope, dynamic=True)


def _parts(layer_map: nn.Module, attr: str) -> list[torch.Tensor]:
    """The tensors `attr` of one layer map is computed from: itself, or for `"<kind>.weight"` / `"<kind>.bias"` of a
    reduced-rank map, its factors (the dense weight is `up @ down`, the bias `up.bias`)."""
    kind, _, name = attr.partition(".")
    proj = getattr(layer_map, kind)
    if isinstance(proj, _LowRankLinear) and name in ("weight", "bias"):
        return [proj.up.weight, proj.down.weight] if name == "weight" else [proj.up.bias]
    return [operator.attrgetter(attr)(layer_map)]


def _stacked(
    mapper: KVMapper, group: tuple[int, ...], attr: str, device: torch.device, rotary_dim: int | None = None
) -> torch.Tensor:
    """`attr` (e.g. `"key.weight"`, `"value.down.weight"`) of `group`'s layer maps concatenated along dim 0. For a
    reduced-rank map, `"key.weight"` is its dense weight `up @ down`.

    With `rotary_dim`, the output rows are reordered from (layer, head, dim) to: first halves of the rotary dims
    of every (layer, head), then the second halves, then the pass-through dims (the order `TransferredCache._finish`
    reads). Kept on the mapper between caches, and rebuilt when any part changed in place (tensor version
    counters) or moved, so edits to the mapper are never missed.
    """
    parts = [_parts(mapper.layers[t], attr) for t in group]
    if len(group) == 1 and rotary_dim is None and len(parts[0]) == 1:
        return parts[0][0].to(device)
    store = mapper.__dict__.setdefault("_stacked", {})
    versions = tuple((w.data_ptr(), w._version, w.dtype) for p in parts for w in p)
    key = (group, attr, device, rotary_dim)
    entry = store.get(key)
    if entry is None or entry[0] != versions:
        stacked = torch.cat([p[0].detach() if len(p) == 1 else p[0].detach() @ p[1].detach() for p in parts])
        if rotary_dim is not None:
            tgt = mapper.target_layout
            rows = torch.arange(stacked.shape[0]).view(len(group), tgt.num_kv_heads, tgt.head_dim)
            rotary = rows[..., :rotary_dim].unflatten(-1, (2, rotary_dim // 2)).permute(2, 0, 1, 3)
            stacked = stacked[torch.cat([rotary.flatten(), rows[..., rotary_dim:].flatten()])]
        entry = store[key] = (versions, stacked.to(device))
    return entry[1]


def conversion_groups(mapper: KVMapper) -> list[tuple[tuple[int, ...], bool]]:
    """How `TransferredCache` maps the target layers when they are converted in order (as a forward does):
    `(layers mapped together, taken densely)` per group; the flag is False for factored reduced-rank maps and
    for other (MLP) maps, which are mapped one layer at a time."""
    width = mapper.target_layout.layer_dim
    selections = mapper.config.selected_layers
    done: set[int] = set()
    groups = []
    for t, layer_map in enumerate(mapper.layers):
        if t in done:
            continue
        if type(layer_map) not in (_LinearLayerMap, _LowRankLayerMap):
            groups.append(((t,), False))
            continue
        same = [u for u in range(t, len(selections)) if u not in done and selections[u] == selections[t]
                and type(mapper.layers[u]) is type(layer_map)]  # fmt: skip
        group = tuple(same[: max(1, GROUP_OUT_FEATURES // width)])
        done.update(group)
        groups.append((group, type(layer_map) is _LinearLayerMap or _take_densely(mapper, list(group))))
    return groups


# Reduced-rank maps whose dense weight has at most this many entries (per layer and kind) are always applied
# densely: there the factored path's fixed costs (two skinny GEMMs and a strided write per layer) outweigh the
# multiply-adds it saves (on the bundled pair, 256 x 64 maps: 31.8 ms factored vs 22 ms dense at 4096 tokens).
SMALL_MAP_ENTRIES = 2**18


def _take_densely(mapper: KVMapper, group: list[int]) -> bool:
    """Whether reduced-rank maps are cheaper applied as their dense product `up @ down` (one wide GEMM, the
    full-rank path) than factored: small maps (`SMALL_MAP_ENTRIES`), and maps whose factors cost at least half
    the dense multiply-adds."""
    src, tgt = mapper.source_layout, mapper.target_layout
    f_in = len(mapper.config.selected_layers[group[0]]) * src.layer_dim
    if f_in * tgt.layer_dim <= SMALL_MAP_ENTRIES:
        return True
    factored = sum(r * (f_in + tgt.layer_dim) for t in group for r in mapper.config.rank[t])
    return factored >= len(group) * f_in * tgt.layer_dim  # half of the dense K and V multiply-adds


# Ridge maps of target layers that read the same source layers run as one GEMM of up to this many output
# features per kind: on CPU one [F_in -> 512] product is ~2x faster than eight [F_in -> 64] ones (the skinny
# products are dominated by packing the shared input). Big models' layers (n_kv * d >= 1024) still map one at
# a time, so what is computed ahead of the layers asking for it stays at most about one layer's KV.
GROUP_OUT_FEATURES = 1024


class TransferredCache(DynamicCache):
    """The target model's KV cache, converted from the source model's cache one layer at a time.

    Nothing is mapped at construction. The first time the target's attention layer `layer_idx` calls
    `update`, that layer's KV is produced from the source cache (strip source RoPE -> map -> apply
    target RoPE, on the device and in the dtype of the incoming `key_states`), and the cache then behaves
    exactly like a `DynamicCache`. Pass it to stock `generate` (`cache=` or `past_key_values=`).

    The last `num_recompute_tokens` tokens of the source cache are *not* transferred: the target
    recomputes them itself, so `generate` can be called with the same full `input_ids` the source saw
    (a cache covering the whole prompt would leave `generate` nothing to feed). More recomputed tokens
    also means more of the context the target encodes itself.

    Args:
        source_cache: the source model's cache for the prompt (`DynamicCache`, e.g. from `prefill`).
            It is never modified.
        mapper: a `KVMapper`, or a Hub repo id / local path of one (loaded once per process).
        attention_mask: `[batch, seq]` mask the source cache was built with (left padding); RoPE is
            stripped and re-applied at the per-row positions `cumsum(mask) - 1`.
        num_recompute_tokens: trailing prompt tokens left for the target to recompute (default 1).
        strict: when the source cache comes from `prefill`, its model's config is compared with the one the
            mapper was fit for; a difference beyond KV shapes warns, or raises with `strict=True`.
        revision, token: used when `mapper` is a Hub repo id.

    Example:
        ```python
        src_cache = prefill(source, input_ids, attention_mask=mask)
        cache = TransferredCache(src_cache, mapper, attention_mask=mask)
        out = target.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=32)
        ```
    """

    # Opt-in: strip source RoPE (and apply the target's for MLP maps) through `torch.compile`: one fused kernel
    # per layer instead of four passes. Whole transfer 6-11% faster on the bundled pair at 4096 tokens on CPU
    # (`hf-kvtransfer bench --compile both`), after a one-off compile of several seconds. Off by default.
    compile_rope: bool = False

    def __init__(
        self,
        source_cache: Cache | tuple,
        mapper: KVMapper | str | os.PathLike,
        attention_mask: torch.Tensor | None = None,
        num_recompute_tokens: int = 1,
        *,
        strict: bool = False,
        revision: str | None = None,
        token: str | bool | None = None,
    ):
        if not isinstance(mapper, KVMapper):
            if not isinstance(mapper, (str, os.PathLike)):
                raise TypeError(f"mapper must be a KVMapper or a repo id / path, got {type(mapper).__name__}")
            mapper = _load_mapper(os.fspath(mapper), revision, token)
        super().__init__(config=mapper.target_model_config)
        self.mapper = mapper
        self.num_recompute_tokens = num_recompute_tokens
        self._source_rotary = mapper.source_rotary()
        self._target_rotary = mapper.target_rotary()

        src_layout = mapper.source_layout
        source_config = getattr(source_cache, "source_model_config", None)
        if source_config is not None:
            mapper.check_compatible(source_config=source_config, strict=strict)
        layers = _source_layers(source_cache)
        if len(layers) != src_layout.num_layers:
            raise ValueError(
                f"source cache has {len(layers)} layers but the mapper was fit for a source with "
                f"{src_layout.num_layers} layers ({mapper.config.source_model_id}); build the cache with that model"
            )
        consumers = mapper.consumers()
        self._source: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        length = batch_size = None
        for s in sorted(consumers):
            keys, values, layer = layers[s]
            if keys is None or values is None or keys.numel() == 0:
                raise ValueError(f"source cache layer {s} is empty; run the source prefill before transferring")
            expected = (src_layout.num_kv_heads, src_layout.head_dim)
            if keys.ndim != 4 or (keys.shape[1], keys.shape[3]) != expected or values.shape != keys.shape:
                raise ValueError(
                    f"source cache layer {s} has keys {list(keys.shape)} / values {list(values.shape)}; the mapper "
                    f"expects [batch, {expected[0]}, seq, {expected[1]}] from {mapper.config.source_model_id}"
                )
            seen = getattr(layer, "cumulative_length", keys.shape[-2])
            if getattr(layer, "is_sliding", False) and seen > keys.shape[-2]:
                raise ValueError(
                    f"source layer {s} is a sliding-window layer that kept only its last {keys.shape[-2]} of {seen} "
                    "tokens, but target layers read it for the whole context; build the source cache with "
                    "`prefill(source, ...)` (keeps every token) or a DynamicCache without a config"
                )
            if length is None:
                length, batch_size = keys.shape[-2], keys.shape[0]
            elif (keys.shape[0], keys.shape[-2]) != (batch_size, length):
                raise ValueError(
                    f"source cache layers disagree: layer {s} holds {keys.shape[-2]} tokens x batch {keys.shape[0]}, "
                    f"earlier layers {length} x {batch_size}"
                )
            self._source[s] = (keys, values)
        if not 0 <= num_recompute_tokens <= length:
            raise ValueError(f"num_recompute_tokens must be in [0, {length}] (the cached tokens), got {num_recompute_tokens}")
        self._length = length - num_recompute_tokens
        self._batch_size = batch_size
        device = next(iter(self._source.values()))[0].device
        self._position_ids = position_ids_from_mask(attention_mask, batch_size, length, device)[:, : self._length]
        self._source = {s: (k[:, :, : self._length], v[:, :, : self._length]) for s, (k, v) in self._source.items()}
        self._consumers = {s: set(ts) for s, ts in consumers.items()}
        self._pending = set(range(len(self.layers)))
        self._stripped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._warned_refeed = False

    def __deepcopy__(self, memo):
        # Share the mapper and rotary modules: a copy of a cache must not copy model-sized weights.
        for shared in (self.mapper, self._source_rotary, self._target_rotary):
            memo[id(shared)] = shared
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    # -- what the model sees before conversion ------------------------------------------------------
    @property
    def num_pending_layers(self) -> int:
        """Target layers not converted yet."""
        return len(self._pending)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx in self._pending:
            return self._length
        return super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        # Masks and positions are built before any layer runs, so pending layers must already report
        # the sizes they will have once converted.
        if layer_idx not in self._pending:
            return super().get_mask_sizes(query_length, layer_idx)
        window = getattr(self.layers[layer_idx], "sliding_window", None)
        if getattr(self.layers[layer_idx], "is_sliding", False) and window is not None:
            offset = max(self._length - window + 1, 0)
            kv_length = window - 1 + query_length if self._length >= window else self._length + query_length
            return kv_length, offset
        return self._length + query_length, 0

    # -- conversion ---------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"the model has more layers than the mapper's target ({len(self.layers)} layers, "
                f"{self.mapper.config.target_model_id}); load the mapper made for this target model"
            )
        if layer_idx in self._pending:
            self._check_refeed(key_states)
            self._convert(layer_idx, key_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_refeed(self, key_states: torch.Tensor) -> None:
        if self.num_recompute_tokens == 0 and not self._warned_refeed and key_states.shape[-2] == self._length > 1:
            self._warned_refeed = True
            warnings.warn(
                f"the target is fed {self._length} tokens on top of a transferred cache of the same length. If these "
                "are the prompt tokens again (generate re-feeds the whole prompt when the cache covers all of it), "
                "the output is wrong: use num_recompute_tokens >= 1 (the default) or pass only the new tokens.",
                stacklevel=3,
            )

    # Everything derived from the source for the conversion lives in `self._stripped` (so `crop`/beam ops,
    # which clear it, invalidate all of it): int keys hold one stripped source layer, ("sel", layers) keys the
    # side-by-side features of a selection, ("mapped", t) a target layer's finished K/V computed with an earlier
    # layer of its group, ("rope", which, device[, dtype]) the cos/sin tables, ("finite", device) deferred
    # non-finite flags on accelerators.
    def _rope_tables(
        self, which: str, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[batch, 1, seq, rotary_dim]` at the transferred positions, computed once per cache (in float32,
        then cast to `dtype`).

        For the source ("strip") the inverse rotation is folded in: `(cos, -sin) / (cos^2 + sin^2)`, so stripping
        is the same multiply-add as applying RoPE and removes the rope type's attention scaling.
        """
        if dtype != torch.float32:
            key = ("rope", which, device, dtype)
            if key not in self._stripped:
                self._stripped[key] = tuple(t.to(dtype) for t in self._rope_tables(which, device))
            return self._stripped[key]
        key = ("rope", which, device)
        if key not in self._stripped:
            rotary = self._source_rotary if which == "strip" else self._target_rotary
            cos, sin = rotary_cos_sin(rotary, self._position_ids.to(device), device)
            if which == "strip":
                norm = cos * cos + sin * sin
                cos, sin = cos / norm, -sin / norm
            self._stripped[key] = (cos, sin)
        return self._stripped[key]

    def _feature_dtype(self, source_dtype: torch.dtype) -> torch.dtype:
        # The wider of the source's and the mapper's dtype: a bf16 source is stripped at a float32 mapper's
        # precision, and a float32 source for a bf16 mapper is stripped in float32 and cast once by the map
        # (writing RoPE results into a narrower buffer takes PyTorch's mixed-dtype path, slow on CPU).
        param = next(self.mapper.parameters(), None)
        mapper_dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
        return torch.promote_types(source_dtype, mapper_dtype)

    def _strip_into(self, s: int, key_out: torch.Tensor, value_out: torch.Tensor) -> None:
        """Write stripped source layer `s` into `[batch, seq, heads, head_dim]` buffers (any dtype)."""
        keys, values = self._source[s]
        cos, sin = self._rope_tables("strip", keys.device)
        # (B, H, T, D) -> (B, T, H, D) by writing through a transposed view: the transpose costs no extra pass.
        if self.compile_rope:
            key_out.transpose(1, 2).copy_(_compiled_rope()(keys, cos, sin, key_out.dtype))
        else:
            _rotate_into(keys, cos, sin, key_out.transpose(1, 2))
        value_out.transpose(1, 2).copy_(values)
        # One reduction over the (contiguous) source tensors instead of isfinite().all(): NaN and inf survive a
        # float32 sum, and reading the source is cheaper than reading strided output slots.
        bad = ~torch.isfinite(keys.sum(dtype=torch.float32) + values.sum(dtype=torch.float32))
        if keys.device.type == "cpu":
            if bool(bad):
                raise ValueError(f"source cache layer {s} has non-finite values (NaN/inf); check the source model's dtype")
        else:
            # No host sync per layer on accelerators: collect the flags, check once after the last layer.
            flags = self._stripped.setdefault(("finite", keys.device), {})
            flags[s] = bad

    def _raise_deferred_nonfinite(self) -> None:
        for key in [k for k in self._stripped if isinstance(k, tuple) and k[0] == "finite"]:
            bad = sorted(s for s, flag in self._stripped[key].items() if bool(flag))
            if bad:
                raise ValueError(
                    f"source cache layers {bad} have non-finite values (NaN/inf); check the source model's dtype"
                )

    def _stripped_source(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE-stripped source layer `s` as `[batch, seq, heads * head_dim]` (see `_feature_dtype`), once per layer."""
        if s not in self._stripped:
            keys = self._source[s][0]
            batch, heads, seq, dim = keys.shape
            out = [torch.empty(batch, seq, heads, dim, dtype=self._feature_dtype(keys.dtype), device=keys.device) for _ in "kv"]
            self._strip_into(s, *out)
            self._stripped[s] = tuple(o.view(batch, seq, heads * dim) for o in out)
        return self._stripped[s]

    def _selection_features(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stripped features of target layer `layer_idx`'s source layers side by side: `[batch, seq, k * H * D]`.

        Target layers that read the same source layers share one buffer, and each source layer is stripped
        straight into its slot, so the common case (every target layer reads the same layers) costs no copy.
        """
        selected = self.mapper.config.selected_layers[layer_idx]
        if len(selected) == 1:
            return self._stripped_source(selected[0])
        key = ("sel", tuple(selected))
        if key not in self._stripped:
            ref = self._source[selected[0]][0]  # a pending layer's sources are never freed
            batch, seq = ref.shape[0], ref.shape[2]
            layout = self.mapper.source_layout
            shape = (batch, seq, len(selected), layout.num_kv_heads, layout.head_dim)
            buffers = [torch.empty(shape, dtype=self._feature_dtype(ref.dtype), device=ref.device) for _ in "kv"]
            others = {tuple(self.mapper.config.selected_layers[t]) for t in self._pending if t != layer_idx} - {key[1]}
            for j, s in enumerate(selected):
                if s in self._stripped:  # stripped before for another selection: one copy, as a cat would do
                    for buf, feats in zip(buffers, self._stripped[s]):
                        buf[:, :, j].copy_(feats.view(batch, seq, layout.num_kv_heads, layout.head_dim))
                    continue
                self._strip_into(s, buffers[0][:, :, j], buffers[1][:, :, j])
                if any(s in other for other in others):
                    # Another selection reads this layer too: keep a view (no copy) for it.
                    self._stripped[s] = tuple(b[:, :, j].reshape(batch, seq, -1) for b in buffers)
            self._stripped[key] = tuple(b.view(batch, seq, -1) for b in buffers)
        return self._stripped[key]

    def _same_selection(self, layer_idx: int, map_type: type) -> list[int]:
        """Pending target layers reading the same source layers as `layer_idx` through the same kind of map."""
        selected = self.mapper.config.selected_layers[layer_idx]
        return [
            t for t in sorted(self._pending)
            if self.mapper.config.selected_layers[t] == selected and type(self.mapper.layers[t]) is map_type
        ]  # fmt: skip

    def _finish(self, key_rows: torch.Tensor, value_rows: torch.Tensor, num_layers: int, like: torch.Tensor):
        """Target K/V of `num_layers` layers from their mapped outputs, finished: RoPE applied, cache layout and dtype.

        Args:
            key_rows: `[B, T, num_layers * n_kv * d]` stripped keys with the feature order of `_stacked(...,
                rotary_dim)`: the first halves of the rotary dims of every (layer, head), then the second halves,
                then the pass-through dims. RoPE is then four passes over the whole group reading long contiguous
                runs, instead of four passes per layer over transposed views.
            value_rows: `[B, T, num_layers * n_kv * d]` values in (layer, head, dim) order.

        Returns:
            `(keys, values)`, each `[num_layers, B, n_kv, T, d]` in `like`'s dtype and device: one buffer per kind,
            so each layer's tensor is contiguous and no further copy is needed.
        """
        tgt = self.mapper.target_layout
        num_heads, head_dim = tgt.num_kv_heads, tgt.head_dim
        batch, seq = key_rows.shape[:2]
        dtype = like.dtype
        # RoPE runs in the cache dtype, or in the map's when that is wider (a float32 map into a bf16 cache is
        # rounded once, at the end). Narrower map outputs are widened first, in one contiguous pass: mixed-dtype
        # elementwise kernels are several times slower on CPU.
        rope_dtype = torch.promote_types(key_rows.dtype, dtype)
        key_rows = key_rows.to(device=like.device, dtype=rope_dtype)
        cos, sin = self._rope_tables("apply", like.device, rope_dtype)  # (B, 1, T, rotary_dim)
        rotary_dim = cos.shape[-1]
        half = rotary_dim // 2
        # (B, 1, T, half) -> (B, T, 1, 1, half): broadcast over layers and heads
        c1, c2, s1, s2 = (t.transpose(1, 2).unsqueeze(2) for t in (cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]))
        shape = (num_layers, batch, num_heads, seq, head_dim)
        keys, values = (torch.empty(shape, dtype=dtype, device=like.device) for _ in "kv")
        rotated = keys if rope_dtype == dtype else torch.empty(shape, dtype=rope_dtype, device=like.device)
        out = rotated.permute(1, 3, 0, 2, 4)  # (B, T, layers, heads, D) view of the cache layout
        split = 2 * num_layers * num_heads * half
        x1, x2 = key_rows[..., :split].unflatten(-1, (2, num_layers, num_heads, half)).unbind(2)
        o1, o2 = out[..., :half], out[..., half:rotary_dim]
        torch.mul(x1, c1, out=o1)
        o1.addcmul_(x2, s1, value=-1)
        torch.mul(x2, c2, out=o2)
        o2.addcmul_(x1, s2)
        if rotary_dim < head_dim:  # partial rotary: the rest passes through
            out[..., rotary_dim:].copy_(key_rows[..., split:].unflatten(-1, (num_layers, num_heads, head_dim - rotary_dim)))
        if rotated is not keys:
            keys.copy_(rotated)
        values.permute(1, 3, 0, 2, 4).copy_(value_rows.unflatten(-1, (num_layers, num_heads, head_dim)))
        return keys, values

    def _rotary_dim(self, device: torch.device) -> int:
        return self._rope_tables("apply", device)[0].shape[-1]

    def _convert_group(self, layer_idx: int, key_feats: torch.Tensor, value_feats: torch.Tensor, like: torch.Tensor):
        """Ridge maps (full or reduced rank): `layer_idx` together with the next pending layers that read the same
        source layers through the same kind of map, up to `GROUP_OUT_FEATURES` outputs per kind; the others wait,
        finished, in `self._stripped`. Returns `layer_idx`'s finished keys and values.

        Full-rank maps (and reduced-rank ones cheaper taken densely, `_take_densely`) are one GEMM per kind for the
        group. Factored maps do the group's `down` projections in one GEMM, then each layer's `up` into its columns
        of the group output. Either way the output columns come in the order `_finish` reads.
        """
        entry = ("mapped", layer_idx)
        if entry not in self._stripped:
            tgt = self.mapper.target_layout
            width = tgt.layer_dim
            map_type = type(self.mapper.layers[layer_idx])
            candidates = [t for t in self._same_selection(layer_idx, map_type) if t >= layer_idx]
            group = tuple(candidates[: max(1, GROUP_OUT_FEATURES // width)])
            rotary_dim = self._rotary_dim(like.device)
            rows = []
            if map_type is _LinearLayerMap or _take_densely(self.mapper, list(group)):
                for kind, x, order in (("key", key_feats, rotary_dim), ("value", value_feats, None)):
                    weight = _stacked(self.mapper, group, f"{kind}.weight", like.device, order)
                    bias = _stacked(self.mapper, group, f"{kind}.bias", like.device, order)
                    rows.append(nn.functional.linear(x.to(weight.dtype), weight, bias))
            else:
                rows = [self._factored_rows(group, kind, x, rotary_dim) for kind, x in (("key", key_feats), ("value", value_feats))]
            keys, values = self._finish(*rows, len(group), like)
            for i, t in enumerate(group):
                self._stripped[("mapped", t)] = (keys[i], values[i])
        return self._stripped.pop(entry)

    def _factored_rows(self, group: tuple[int, ...], kind: str, x: torch.Tensor, rotary_dim: int) -> torch.Tensor:
        """`[B, T, len(group) * F_out]` outputs of reduced-rank maps applied factored, in `_finish`'s column order."""
        tgt = self.mapper.target_layout
        width, num = tgt.layer_dim, len(group)
        rot = tgt.num_kv_heads * (rotary_dim // 2)  # features in one rotary half of one layer
        rest = width - 2 * rot  # pass-through features of one layer (partial rotary)
        down = _stacked(self.mapper, group, f"{kind}.down.weight", x.device)  # (sum r, F_in)
        codes = nn.functional.linear(x.to(down.dtype), down).flatten(0, -2)  # (B*T, sum r)
        out = torch.empty(codes.shape[0], num * width, dtype=codes.dtype, device=codes.device)
        start = 0
        for i, t in enumerate(group):
            order = rotary_dim if kind == "key" else None
            up = _stacked(self.mapper, (t,), f"{kind}.up.weight", codes.device, order)  # (F_out, r)
            bias = _stacked(self.mapper, (t,), f"{kind}.up.bias", codes.device, order)
            code = codes[:, start : start + up.shape[1]]
            start += up.shape[1]
            if kind == "value":
                spans = [(i * width, 0, width)]
            else:  # (first column in the group output, first row of `up`, count)
                spans = [(i * rot, 0, rot), ((num + i) * rot, rot, rot), (2 * num * rot + i * rest, 2 * rot, rest)]
            for column, row, count in spans:
                if count:
                    part = slice(row, row + count)
                    torch.addmm(bias[part], code, up[part].T, out=out[:, column : column + count])
        return out.view(*x.shape[:-1], num * width)

    @torch.no_grad()
    def _convert(self, layer_idx: int, like: torch.Tensor) -> None:
        tgt = self.mapper.target_layout
        if like.shape[1] != tgt.num_kv_heads or like.shape[-1] != tgt.head_dim:
            raise ValueError(
                f"target layer {layer_idx} passes key_states {list(like.shape)} but the mapper produces "
                f"[batch, {tgt.num_kv_heads}, seq, {tgt.head_dim}] for {self.mapper.config.target_model_id}; "
                "load the mapper made for this target model"
            )
        selected = self.mapper.config.selected_layers[layer_idx]
        if self._length > 0:
            key_feats, value_feats = (f.to(like.device) for f in self._selection_features(layer_idx))
            map_type = type(self.mapper.layers[layer_idx])
            if map_type in (_LinearLayerMap, _LowRankLayerMap):
                keys, values = self._convert_group(layer_idx, key_feats, value_feats, like)
                # Computed with an earlier layer of the group, which under a device map may live elsewhere.
                keys, values = keys.to(like.device, like.dtype), values.to(like.device, like.dtype)
            else:  # other maps (MLP): one layer at a time
                keys, values = self.mapper(layer_idx, key_feats, value_feats)  # (B, H, T, D) views
                if keys.dtype.itemsize < like.dtype.itemsize:  # e.g. a bf16 mapper filling a float32 cache
                    keys = keys.to(like.dtype)
                # Straight into the cache dtype when the map already computed in it; else in float32, cast once.
                rope_dtype = like.dtype if keys.dtype == like.dtype else torch.float32
                # Tables in the dtype RoPE runs in, as the target's own rotary embedding casts them.
                cos, sin = self._rope_tables("apply", like.device, rope_dtype)
                if self.compile_rope:
                    keys = _compiled_rope()(keys, cos, sin, rope_dtype)
                else:
                    keys = _rotate_into(keys, cos, sin, torch.empty(keys.shape, dtype=rope_dtype, device=like.device))
                # One copy for the values: transpose and cast together into the contiguous layout the cache keeps.
                keys = keys.to(like.dtype)
                values = torch.empty(values.shape, dtype=like.dtype, device=like.device).copy_(values)
            if like.shape[0] != keys.shape[0]:
                keys, values = self._expand_batch(keys, values, like.shape[0])
            layer = self.layers[layer_idx]
            if type(layer) is DynamicLayer and not layer.is_initialized:
                # What `update` would store, without its copy (a concatenation onto an empty tensor).
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
            else:
                layer.update(keys, values)
        self._pending.discard(layer_idx)
        if not any(self.mapper.config.selected_layers[t] == selected for t in self._pending):
            self._stripped.pop(("sel", tuple(selected)), None)
        for s in selected:
            self._consumers[s].discard(layer_idx)
            if not self._consumers[s]:
                # Every reader of this source layer is converted: free it (the caller's cache keeps its own).
                self._source.pop(s, None)
                self._stripped.pop(s, None)
        if not self._pending:
            self._raise_deferred_nonfinite()
            self._stripped.clear()  # cos/sin tables and flags

    @staticmethod
    def _expand_batch(keys: torch.Tensor, values: torch.Tensor, batch_size: int):
        # `generate` expands inputs for beam search / num_return_sequences but not a user-passed cache.
        if batch_size % keys.shape[0]:
            raise ValueError(
                f"the target runs a batch of {batch_size} rows on a transferred cache of {keys.shape[0]} rows; the "
                "batch must be the source's (times num_beams / num_return_sequences)"
            )
        repeats = batch_size // keys.shape[0]
        return keys.repeat_interleave(repeats, dim=0), values.repeat_interleave(repeats, dim=0)

    def convert_all(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "TransferredCache":
        """Convert every pending layer now (e.g. to time the mapping or to inspect the target KV)."""
        some = next(iter(self._source.values()), None)
        ref = some[0] if some is not None else torch.empty(0)
        like = torch.empty(
            (self._batch_size, self.mapper.target_layout.num_kv_heads, 0, self.mapper.target_layout.head_dim),
            device=device if device is not None else ref.device,
            dtype=dtype if dtype is not None else ref.dtype,
        )
        for layer_idx in sorted(self._pending):
            self._convert(layer_idx, like)
        return self

    # -- cache operations that must also act on what is not converted yet -----------------------------
    def _map_source(self, fn) -> None:
        self._source = {s: (fn(k), fn(v)) for s, (k, v) in self._source.items()}
        self._position_ids = fn(self._position_ids)
        self._stripped.clear()
        if self._source:
            self._batch_size = next(iter(self._source.values()))[0].shape[0]

    def crop(self, tokens_to_remove: int) -> None:
        if self._pending and tokens_to_remove < 0:
            n = min(-tokens_to_remove, self._length)
            self._length -= n
            self._map_source(lambda t: t[..., : self._length, :] if t.ndim == 4 else t[:, : self._length])
        elif self._pending and tokens_to_remove > 0:
            raise ValueError(
                f"`crop` takes a negative number of tokens to remove, got {tokens_to_remove} (as DynamicCache)"
            )
        super().crop(tokens_to_remove)

    def _expand_source_to(self, batch_size: int) -> None:
        if self._pending and batch_size != self._batch_size and batch_size % self._batch_size == 0:
            repeats = batch_size // self._batch_size
            self._map_source(lambda t: t.repeat_interleave(repeats, dim=0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self._pending:
            self._expand_source_to(beam_idx.numel())
            self._map_source(lambda t: t.index_select(0, beam_idx.to(t.device)))
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._pending:
            self._map_source(lambda t: t.repeat_interleave(repeats, dim=0))
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._pending:
            self._map_source(lambda t: t[indices.to(t.device)])
        super().batch_select_indices(indices)

    def reset(self) -> None:
        self._pending.clear()
        self._source.clear()
        self._stripped.clear()
        self._length = 0
        super().reset()

    def __repr__(self) -> str:
        return (
            f"TransferredCache(layers={len(self.layers)}, pending={len(self._pending)}, "
            f"transferred_tokens={self._length}, mapper={self.mapper.config.source_model_id}->"
            f"{self.mapper.config.target_model_id})"
        )
