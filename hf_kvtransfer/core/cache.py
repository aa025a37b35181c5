"""TransferredCache: a `DynamicCache` for the target model, filled lazily from the source model's cache."""

from __future__ import annotations

import copy
import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import Cache, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from .capture import cache_argument
from .layer_maps import LinearParts
from .mapper import KVMapper
from .rope import compiled_rotate, position_ids_from_mask, rotary_cos_sin, rotate_into

# Affine maps of target layers that read the same source layers run as one GEMM of up to this many output features
# per kind: on CPU one [F_in -> 512] product is ~2x faster than eight [F_in -> 64] ones (the skinny products are
# dominated by packing the shared input). Big models' layers (n_kv * d >= 1024) map one at a time, so what is
# computed ahead of the layers asking for it stays at most about one layer's KV.
GROUP_OUT_FEATURES = 1024

# A group's weights are concatenated for its one GEMM (a transient copy, freed when the group is done) only up to
# this size; past it each layer's GEMM writes its columns of the group output instead. Nothing derived from the
# mapper outlives a conversion: a transfer holds no second copy of the mapper.
STACK_BYTES = 64 * 2**20

# Reduced-rank maps whose dense weight has at most this many entries are applied densely: there the factored
# path's fixed costs (two skinny GEMMs per layer) outweigh the multiply-adds it saves.
SMALL_MAP_ENTRIES = 2**18

# The prompt's last tokens are prefilled by the target itself unless asked otherwise: the next tokens depend most on
# the nearest context, so exact keys and values there buy the most fidelity per token of the target's forward. On
# the bundled family (small -> large, README) 32 tokens raise greedy 16-token agreement with the target's own
# generation from 14% to 51% on 512-token prompts (first token 82% -> 95%) for +7 ms (9%) of time to first token on
# 1024 tokens.
DEFAULT_NUM_RECOMPUTE_TOKENS = 32


def resolve_num_recompute_tokens(requested: int | None, num_tokens: int) -> int:
    """What a caller's `num_recompute_tokens` means for a prompt of `num_tokens`: as given, and None is the default,
    `DEFAULT_NUM_RECOMPUTE_TOKENS` but at most half of a short prompt (most of it is still transferred) and at least 1
    (`generate` must feed a token)."""
    if requested is not None:
        return requested
    return min(DEFAULT_NUM_RECOMPUTE_TOKENS, max(1, num_tokens // 2))


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


def _take_densely(parts: list[LinearParts], tokens: int) -> bool:
    """Whether a group's maps run as dense products (one wide GEMM) rather than factored, for `tokens` rows: always
    for full-rank maps; for reduced-rank ones when small (`SMALL_MAP_ENTRIES`) or when forming `up @ down` and
    applying it costs at most twice the factors' multiply-adds (two skinny GEMMs and a strided write per layer run
    at about half the speed of one wide GEMM on CPU)."""
    if all(p.down is None for p in parts):
        return True
    if all(p.in_features * p.out_features <= SMALL_MAP_ENTRIES for p in parts):
        return True
    return sum(p.macs(tokens, dense=True) for p in parts) <= 2 * sum(p.macs(tokens, dense=False) for p in parts)


def _plan_group(mapper: KVMapper, layer_idx: int, pending: Iterable[int], tokens: int) -> tuple[tuple[int, ...], bool]:
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
    dense = _take_densely([mapper.layers[t].linear_parts(kind) for t in group for kind in ("key", "value")], tokens)
    return group, dense


def conversion_groups(mapper: KVMapper, tokens: int) -> list[tuple[tuple[int, ...], bool]]:
    """How `TransferredCache` maps the target layers of a cache of `tokens` tokens (batch x length) when they are
    converted in order (as a forward does): `(layers mapped together, taken densely)` per group; the flag is False
    for factored reduced-rank maps and for nonlinear (MLP) maps, which are mapped one layer at a time."""
    pending = set(range(len(mapper.layers)))
    groups = []
    while pending:
        group, dense = _plan_group(mapper, min(pending), pending, tokens)
        pending.difference_update(group)
        groups.append((group, dense))
    return groups


# -- what the target is fed --------------------------------------------------------------------------------------


@dataclass
class _CallerInputs:
    """What the model calling the cache was given, read off the call stack (a cache only sees key/value states).

    `forward_ids` are the token ids of the running model forward; `sequence` the ids of the nearest caller of that
    forward that is not a forward (generate's decoding loop: the whole sequence so far), or the forward's own ids when
    it was called directly; `mask_length` the length of the 2D attention mask given, if any.
    """

    model: PreTrainedModel | None = None
    forward_ids: torch.Tensor | None = None
    mask_length: int | None = None
    sequence: torch.Tensor | None = None
    direct: bool = True  # no enclosing generate-like call: the forward was called by the user

    @classmethod
    def from_stack(cls, max_frames: int = 64) -> "_CallerInputs":
        found = cls()
        frame = sys._getframe(2)
        for _ in range(max_frames):
            if frame is None:
                break
            local = frame.f_locals
            owner, ids = local.get("self"), local.get("input_ids")
            if isinstance(owner, PreTrainedModel) and isinstance(ids, torch.Tensor) and ids.ndim == 2:
                if ids.is_floating_point():
                    break
                if found.forward_ids is None:
                    if frame.f_code.co_name != "forward":
                        return cls()  # asked from generate itself, before any forward: nothing fed yet
                    mask = local.get("attention_mask")
                    found.forward_ids = ids
                    found.mask_length = mask.shape[-1] if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None
                elif frame.f_code.co_name != "forward":
                    found.direct = False
                    found.sequence = ids
                    # generate drops an all-ones mask before the forward but remembers its length
                    model_kwargs, config = local.get("model_kwargs"), local.get("generation_config")
                    mask = model_kwargs.get("attention_mask") if isinstance(model_kwargs, dict) else None
                    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
                        found.mask_length = mask.shape[-1]
                    elif getattr(config, "_mask_length", -1) > 0:
                        found.mask_length = config._mask_length
                    break
                found.model, found.sequence = owner, ids
            frame = frame.f_back
        return found


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First column where `[batch, n]` id tensors differ (rows of `a` may be `b`'s repeated, as beams are)."""
    if a.shape[0] != b.shape[0]:
        if a.shape[0] % b.shape[0]:
            return None  # another batch: reported when the layers are converted
        a = a.reshape(b.shape[0], a.shape[0] // b.shape[0], -1)[:, 0]
    differs = (a.to(b.device) != b).any(dim=0).nonzero()
    return int(differs[0]) if differs.numel() else None


class _StopForward(Exception):
    """Raised by `_PrefixCache` to end a forward once the layers it needs have stored their keys and values."""


class _PrefixCache(DynamicCache):
    """Keeps what the first `num_layers` layers of a forward store, then stops the forward (its later layers and the
    logits are never computed)."""

    def __init__(self, num_layers: int):
        super().__init__()
        self.num_layers = num_layers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == self.num_layers - 1:
            raise _StopForward
        return out


@torch.no_grad()
def _own_prefix(model: PreTrainedModel, input_ids, attention_mask, position_ids, num_layers: int):
    """The keys and values `model` itself computes for its first `num_layers` layers: `[(keys, values)]`, each
    `[batch, kv_heads, seq, head_dim]`. Costs those layers' share of a prefill (for one layer: its K/V projections)."""
    body = model.base_model if hasattr(model, "base_model") else model
    device = model.get_input_embeddings().weight.device
    cache = _PrefixCache(num_layers)
    try:
        body(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device) if attention_mask is not None else None,
            position_ids=position_ids.to(device),
            use_cache=True,
            **{cache_argument(body): cache},
        )
    except _StopForward:
        pass
    return [(layer.keys, layer.values) for layer in cache.layers[:num_layers]]


# -- the state of a transfer that is not finished yet ------------------------------------------------------------


@dataclass
class _SourceLayer:
    """One source layer the mapper reads, until every target layer reading it is converted."""

    keys: torch.Tensor  # (B, H_s, T, D_s), the transferred tokens only; the caller's tensors, never written
    values: torch.Tensor
    readers: set[int]  # target layers still to convert that read this layer
    stripped: tuple[torch.Tensor, torch.Tensor] | None = None  # (B, T, H_s * D_s) features, shared by selections

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.keys, self.values, self.stripped = fn(self.keys), fn(self.values), None


@dataclass
class _RopeTables:
    """cos/sin `[batch, 1, seq, rotary_dim]` at the transferred positions, computed once per (table, device, dtype).

    For the source ("strip") the inverse rotation is folded in: `(cos, -sin) / (cos^2 + sin^2)`, so stripping is the
    same multiply-add as applying RoPE (`rope.rotate_into`) and removes the rope type's attention scaling.
    """

    source_rotary: nn.Module
    target_rotary: nn.Module
    position_ids: torch.Tensor  # (B, T)
    tables: dict[tuple[str, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def get(self, which: str, device: torch.device, dtype: torch.dtype = torch.float32):
        key = (which, torch.device(device), dtype)
        if key not in self.tables:
            if dtype != torch.float32:  # computed in float32, as the models' own rotary modules do, then cast
                self.tables[key] = tuple(t.to(dtype) for t in self.get(which, device))
            else:
                rotary = self.source_rotary if which == "strip" else self.target_rotary
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
class _PendingTransfer:
    """Everything a `TransferredCache` holds for target layers not converted yet; dropped when the last one is."""

    sources: dict[int, _SourceLayer]
    rope: _RopeTables
    length: int  # transferred tokens
    batch_size: int
    attention_mask: torch.Tensor | None  # (B, T) of the transferred tokens, when the source prefill had one
    # Side-by-side features of a multi-layer selection, shared by the target layers that read it.
    features: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Finished target K/V of group members computed together with an earlier layer of their group.
    ahead: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Non-finite flags of stripped source layers on accelerators, checked once after the last layer (no host sync).
    nonfinite: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch or length operation (beam reorder, crop, ...) to what is not converted yet."""
        for layer in self.sources.values():
            layer.map_tensors(fn)
        self.rope.map_positions(fn)
        self.attention_mask = fn(self.attention_mask) if self.attention_mask is not None else None
        self.features.clear()
        self.ahead.clear()  # recomputed from the changed sources when asked for
        if self.sources:
            self.batch_size = next(iter(self.sources.values())).keys.shape[0]

    def nbytes(self) -> int:
        tensors = [t for layer in self.sources.values() for t in (layer.keys, layer.values, *(layer.stripped or ()))]
        tensors += [t for pair in (*self.features.values(), *self.ahead.values(), *self.rope.tables.values()) for t in pair]
        # Views share storage (the caller's tensors, buffers of a selection): count each storage once.
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())


class TransferredCache(DynamicCache):
    """The target model's KV cache, converted from the source model's cache one layer at a time.

    Nothing is mapped at construction. The first time the target's attention layer `layer_idx` calls
    `update`, that layer's KV is produced from the source cache (strip source RoPE -> map -> apply
    target RoPE, on the device and in the dtype of the incoming `key_states`), and the cache then behaves
    exactly like a `DynamicCache`. Pass it to stock `generate` (`cache=` or `past_key_values=`).

    The last `num_recompute_tokens` tokens of the source cache are *not* transferred: the target
    recomputes them itself, so `generate` can be called with the same full `input_ids` the source saw
    (a cache covering the whole prompt would leave `generate` nothing to feed). More recomputed tokens
    also means more of the context the target encodes itself: by default the last 32 (at most half the prompt),
    whose exact keys and values keep the target's generations close to its own. A direct forward feeds the
    tokens the cache does not hold: `target(input_ids[:, -cache.num_recompute_tokens:], cache=cache)`.

    Args:
        source_cache: the source model's cache for the prompt (`DynamicCache`, e.g. from `prefill`).
            It is never modified.
        mapper: a `KVMapper`, or a Hub repo id / local path of one (loaded once per process).
        attention_mask: `[batch, seq]` mask the source cache was built with (left padding); RoPE is
            stripped and re-applied at the per-row positions `cumsum(mask) - 1`.
        num_recompute_tokens: trailing prompt tokens left for the target to recompute. Default (None):
            `resolve_num_recompute_tokens(None, prompt length)`, i.e. 32, at most half the prompt, at least 1. 1 is the
            fastest under `generate`; 0 only suits a direct forward of new tokens.
        strict: when the source cache comes from `prefill`, its model's config is compared with the one the
            mapper was fit for; a difference beyond KV shapes warns, or raises with `strict=True`.
        input_ids: `[batch, seq]` ids of the prompt the source cache holds. Recorded by `prefill` on its cache and
            read from there when not given. With them, the cache refuses input that does not continue that prompt.
        num_exact_layers: the target's first layers computed by the target itself from the prompt ids instead of
            mapped, at the cost of that share of a prefill (layer 0's keys and values depend only on each token and
            its position: one layer's K/V projections). Needs the prompt ids (see `input_ids`) and happens when the
            target first runs on the cache (`convert_all` maps every layer). Default (None): the mapper's
            `num_exact_layers`, which a fit chooses as the fewest layers that keep the target's copying from the
            context (`exact_layers.py`; 1 for mappers that record none). On the bundled family small -> large
            needs 4 of 8 (passage recall 98% vs 1% with 1) and large -> small all 4: there the mapped last layer
            loses what the context said, and the target computes everything itself (README).
        compile_rope: strip and apply RoPE through `torch.compile` (one fused kernel instead of four passes):
            6-11% faster transfers on the bundled pair at 4096 tokens on CPU, after a one-off compile of several
            seconds. Off by default.
        revision, token: used when `mapper` is a Hub repo id.

    Example:
        ```python
        src_cache = prefill(source, input_ids, attention_mask=mask)
        cache = TransferredCache(src_cache, mapper, attention_mask=mask)
        out = target.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=32)
        ```
    """

    def __init__(
        self,
        source_cache: Cache | tuple,
        mapper: KVMapper | str | os.PathLike,
        attention_mask: torch.Tensor | None = None,
        num_recompute_tokens: int | None = None,
        *,
        strict: bool = False,
        input_ids: torch.Tensor | None = None,
        num_exact_layers: int | None = None,
        compile_rope: bool = False,
        revision: str | None = None,
        token: str | bool | None = None,
    ):
        if not isinstance(mapper, KVMapper):
            if not isinstance(mapper, (str, os.PathLike)):
                raise TypeError(f"mapper must be a KVMapper or a repo id / path, got {type(mapper).__name__}")
            mapper = _load_mapper(os.fspath(mapper), revision, token)
        super().__init__(config=mapper.target_model_config)
        self.mapper = mapper
        self.compile_rope = compile_rope

        source_config = getattr(source_cache, "source_model_config", None)
        if source_config is not None:
            mapper.check_compatible(source_config=source_config, strict=strict)
        sources, length, batch_size = self._read_source(source_cache)
        num_recompute_tokens = resolve_num_recompute_tokens(num_recompute_tokens, length)
        if not 0 <= num_recompute_tokens <= length:
            raise ValueError(f"num_recompute_tokens must be in [0, {length}] (the cached tokens), got {num_recompute_tokens}")
        self.num_recompute_tokens = num_recompute_tokens
        transferred = length - num_recompute_tokens
        for layer in sources.values():
            layer.keys, layer.values = layer.keys[:, :, :transferred], layer.values[:, :, :transferred]
        device = next(iter(sources.values())).keys.device
        position_ids = position_ids_from_mask(attention_mask, batch_size, length, device)[:, :transferred]
        rope = _RopeTables(mapper.source_rotary(), mapper.target_rotary(), position_ids)
        mask = attention_mask[:, :transferred] if attention_mask is not None else None
        self._transfer: _PendingTransfer | None = _PendingTransfer(sources, rope, transferred, batch_size, mask)
        self._pending = set(range(len(self.layers)))
        self._transferred_tokens = transferred
        prompt_ids = input_ids if input_ids is not None else getattr(source_cache, "prompt_ids", None)
        if prompt_ids is not None and tuple(prompt_ids.shape) != (batch_size, length):
            raise ValueError(
                f"input_ids has shape {list(prompt_ids.shape)} but the source cache holds {length} tokens x batch "
                f"{batch_size}; pass the ids the source cache was built from"
            )
        # The ids of the prompt the source read (None when unknown): the target's input must continue them.
        self.prompt_ids = prompt_ids
        self._first_input_checked = False
        num_exact_layers = mapper.resolve_num_exact_layers(num_exact_layers)
        if not 0 <= num_exact_layers <= len(self.layers):
            raise ValueError(f"num_exact_layers must be in [0, {len(self.layers)}] (the target's layers), got {num_exact_layers}")
        self.num_exact_layers = num_exact_layers

    def _read_source(self, source_cache: Cache | tuple) -> tuple[dict[int, _SourceLayer], int, int]:
        """The source layers the mapper reads, checked against the mapper's source layout."""
        mapper, layout = self.mapper, self.mapper.source_layout
        layers = _source_layers(source_cache)
        if len(layers) != layout.num_layers:
            raise ValueError(
                f"source cache has {len(layers)} layers but the mapper was fit for a source with "
                f"{layout.num_layers} layers ({mapper.config.source_model_id}); build the cache with that model"
            )
        sources: dict[int, _SourceLayer] = {}
        length = batch_size = None
        for s, readers in sorted(mapper.consumers().items()):
            keys, values, layer = layers[s]
            if keys is None or values is None or keys.numel() == 0:
                raise ValueError(f"source cache layer {s} is empty; run the source prefill before transferring")
            expected = (layout.num_kv_heads, layout.head_dim)
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
            sources[s] = _SourceLayer(keys, values, set(readers))
        return sources, length, batch_size

    def __deepcopy__(self, memo):
        # Share the mapper and rotary modules: a copy of a cache must not copy model-sized weights.
        shared = [self.mapper]
        if self._transfer is not None:
            shared += [self._transfer.rope.source_rotary, self._transfer.rope.target_rotary]
        for module in shared:
            memo[id(module)] = module
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

    @property
    def pending_nbytes(self) -> int:
        """Bytes this cache holds for the layers not converted yet (source layers it still reads, features, layers
        computed ahead, RoPE tables), counting each storage once; 0 once every layer is converted."""
        return self._transfer.nbytes() if self._transfer is not None else 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self._pending and not self._first_input_checked:
            self._check_first_input()
        if layer_idx in self._pending:
            return self._transfer.length
        return super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if query_length == 0:
            raise ValueError(
                f"the target was fed no token beyond the {self.get_seq_length()} this cache holds; pass input_ids that "
                "continue them (the whole conversation so far plus the new tokens), or only the new tokens together "
                "with an attention_mask covering the cached ones"
            )
        if self._pending and not self._first_input_checked:
            self._check_first_input()
        elif query_length > 1 and not self._pending:
            self._check_continuation(query_length)  # a new turn (decode steps, one token each, skip this)
        # Masks and positions are built before any layer runs, so pending layers must already report
        # the sizes they will have once converted.
        if layer_idx not in self._pending:
            return super().get_mask_sizes(query_length, layer_idx)
        length = self._transfer.length
        window = getattr(self.layers[layer_idx], "sliding_window", None)
        if getattr(self.layers[layer_idx], "is_sliding", False) and window is not None:
            offset = max(length - window + 1, 0)
            kv_length = window - 1 + query_length if length >= window else length + query_length
            return kv_length, offset
        return length + query_length, 0

    # -- what the target is fed: never a silent wrong answer ------------------------------------------
    def _check_first_input(self) -> None:
        """Check the first forward on the transferred tokens, before it builds positions and masks from them."""
        caller = _CallerInputs.from_stack()
        if caller.forward_ids is None:
            return  # not inside a model forward (e.g. generate asking for the length first)
        self._first_input_checked = True
        if caller.model is not None:
            # A model of another shape than the mapper's target (fewer layers, other heads) never gets output.
            self.mapper.check_compatible(target_config=caller.model.config)
        held, fed = self._transfer.length, caller.forward_ids
        prompt = self.prompt_ids if self.prompt_ids is not None else (None if caller.direct else caller.sequence)
        if held > 0 and prompt is not None and fed.shape[-1] >= held and _first_difference(fed[:, :held], prompt[:, :held]) is None:
            # The forward re-feeds the transferred prompt from its start: transformers' assisted decoding and prompt
            # lookup do on their first step, as does generate with num_recompute_tokens=0. Appending it would hold
            # the prompt twice; the target computes it itself instead (exact, but nothing is saved).
            warnings.warn(
                f"the target is fed the {held} transferred prompt tokens again (assisted decoding and prompt lookup "
                "re-feed the whole prompt on their first step; so does generate with num_recompute_tokens=0): it "
                "recomputes them itself and the transferred cache is not used",
                stacklevel=4,
            )
            self._pending.clear()
            self._transfer = None
            return
        self._check_prompt(caller, held, fed.shape[-1])
        if self.num_exact_layers and held > 0 and caller.model is not None:
            prompt = self.prompt_ids
            rows = caller.sequence.shape[0]
            if prompt is None and not caller.direct and rows % self._transfer.batch_size == 0:
                # generate's whole sequence starts with the prompt (checked above); beam search and
                # num_return_sequences repeat each row in place (repeat_interleave): take one of each
                prompt = caller.sequence[:: rows // self._transfer.batch_size]
            if prompt is None or prompt.shape[-1] < held:
                warnings.warn(
                    f"the target's first {self.num_exact_layers} layer(s) are mapped, not computed from the prompt: "
                    "this cache does not know the prompt's ids; build the source cache with `prefill` or pass "
                    "`input_ids=` to TransferredCache (or num_exact_layers=0 to map every layer on purpose)",
                    stacklevel=4,
                )
            else:
                self._compute_exact_layers(caller.model, prompt[:, :held])

    def _compute_exact_layers(self, model: PreTrainedModel, prompt_ids: torch.Tensor) -> None:
        """The target's own keys and values of its first `num_exact_layers` layers, in place of mapping them."""
        transfer, exact = self._transfer, range(self.num_exact_layers)
        own = _own_prefix(model, prompt_ids, transfer.attention_mask, transfer.rope.position_ids, len(exact))
        for t, kv in zip(exact, own):
            transfer.ahead[t] = kv
        for s, layer in list(transfer.sources.items()):
            layer.readers.difference_update(exact)
            if not layer.readers:
                del transfer.sources[s]

    def _check_continuation(self, query_length: int) -> None:
        caller = _CallerInputs.from_stack()
        if caller.forward_ids is not None and not caller.direct:
            self._check_prompt(caller, self.get_seq_length(), query_length)

    def _check_prompt(self, caller: _CallerInputs, held: int, fed_length: int) -> None:
        """The input must continue the prompt this cache was built for: generate's sequence starts with it (or only
        new tokens are passed, with a mask covering the cached ones); a direct forward feeds the tokens that follow."""
        only_new = caller.sequence.shape[-1] == fed_length and caller.mask_length == held + fed_length
        if only_new:
            return
        sequence = caller.sequence if not caller.direct else None
        if sequence is not None and sequence.shape[-1] < held:
            raise ValueError(
                f"input_ids hold {sequence.shape[-1]} tokens but this cache already holds {held}; pass the whole "
                "conversation so far (the cached tokens, then the new ones), or only the new tokens together with an "
                "attention_mask covering the cached ones"
            )
        if self.prompt_ids is None:
            return
        if sequence is not None:
            count = min(sequence.shape[-1], self.prompt_ids.shape[-1])
            where = _first_difference(sequence[:, :count], self.prompt_ids[:, :count])
        else:  # a direct forward: its tokens sit at positions held, held + 1, ...
            count = max(min(fed_length, self.prompt_ids.shape[-1] - held), 0)
            where = _first_difference(caller.forward_ids[:, :count], self.prompt_ids[:, held : held + count])
            where = None if where is None else held + where
        if where is not None and sequence is None and self._feeds_prompt_tail(caller.forward_ids, held):
            total = self.prompt_ids.shape[-1]
            raise ValueError(
                f"this cache holds the first {held} of the prompt's {total} tokens and leaves the last {total - held} "
                f"to the target (num_recompute_tokens={self.num_recompute_tokens}), but the forward was fed only the "
                f"last {fed_length}; feed `input_ids[:, {held}:]`, i.e. `input_ids[:, -cache.num_recompute_tokens:]` "
                "(generate does this by itself), or build the cache with num_recompute_tokens=1"
            )
        if where is not None:
            raise ValueError(
                f"the target's input_ids differ from the prompt this cache was built for (first at position {where}); "
                "build a TransferredCache from the source's cache of this prompt (one cache per prompt)"
            )

    def _feeds_prompt_tail(self, fed: torch.Tensor, held: int) -> bool:
        """Whether a direct forward was fed the prompt's last tokens but fewer than the cache left to the target
        (code written for one recomputed token, given a cache that leaves more)."""
        total, count = self.prompt_ids.shape[-1], fed.shape[-1]
        return held + count < total and _first_difference(fed, self.prompt_ids[:, total - count :]) is None

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
            self._convert(layer_idx, key_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _feature_dtype(self, source_dtype: torch.dtype) -> torch.dtype:
        # The wider of the source's and the mapper's dtype: a bf16 source is stripped at a float32 mapper's
        # precision, and a float32 source for a bf16 mapper is stripped in float32 and cast once by the map
        # (writing RoPE results into a narrower buffer takes PyTorch's mixed-dtype path, slow on CPU).
        return torch.promote_types(source_dtype, self.mapper.dtype)

    def _strip_into(self, s: int, key_out: torch.Tensor, value_out: torch.Tensor) -> None:
        """Write stripped source layer `s` into `[batch, seq, heads, head_dim]` buffers (any dtype)."""
        layer = self._transfer.sources[s]
        keys, values = layer.keys, layer.values
        cos, sin = self._transfer.rope.get("strip", keys.device)
        # (B, H, T, D) -> (B, T, H, D) by writing through a transposed view: the transpose costs no extra pass.
        if self.compile_rope:
            key_out.transpose(1, 2).copy_(compiled_rotate()(keys, cos, sin, key_out.dtype))
        else:
            rotate_into(keys, cos, sin, key_out.transpose(1, 2))
        value_out.transpose(1, 2).copy_(values)
        # One reduction over the (contiguous) source tensors instead of isfinite().all(): NaN and inf survive a
        # float32 sum, and reading the source is cheaper than reading strided output slots.
        bad = ~torch.isfinite(keys.sum(dtype=torch.float32) + values.sum(dtype=torch.float32))
        if keys.device.type == "cpu":
            if bool(bad):
                raise ValueError(f"source cache layer {s} has non-finite values (NaN/inf); check the source model's dtype")
        else:
            self._transfer.nonfinite.append((s, bad))

    def _stripped_source(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE-stripped source layer `s` as `[batch, seq, heads * head_dim]` (see `_feature_dtype`), once per layer."""
        layer = self._transfer.sources[s]
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
        if len(selected) == 1:
            return self._stripped_source(selected[0])
        transfer = self._transfer
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

    def _finish(self, key_rows: torch.Tensor, value_rows: torch.Tensor, num_layers: int, like: torch.Tensor):
        """Target K/V of `num_layers` layers from their mapped outputs: RoPE applied, cache layout and dtype.

        Args:
            key_rows / value_rows: `[B, T, num_layers * n_kv * d]` stripped keys / values, (layer, head, dim) order.

        Returns:
            `(keys, values)`, each `[num_layers, B, n_kv, T, d]` in `like`'s dtype and device: one buffer per kind,
            written through a permuted view, so each layer's tensor is contiguous and no further copy is needed.
        """
        tgt = self.mapper.target_layout
        batch, seq = key_rows.shape[:2]
        dtype = like.dtype
        # RoPE runs in the cache dtype, or in the map's when that is wider (a float32 map into a bf16 cache is
        # rounded once, at the end). Narrower map outputs are widened first, in one contiguous pass: mixed-dtype
        # elementwise kernels are several times slower on CPU.
        rope_dtype = torch.promote_types(key_rows.dtype, dtype)
        rows = key_rows.to(device=like.device, dtype=rope_dtype).view(batch, seq, num_layers, tgt.num_kv_heads, tgt.head_dim)
        # (B, 1, T, rotary) -> (B, T, 1, 1, rotary): broadcast over layers and heads
        cos, sin = (t.transpose(1, 2).unsqueeze(2) for t in self._transfer.rope.get("apply", like.device, rope_dtype))
        shape = (num_layers, batch, tgt.num_kv_heads, seq, tgt.head_dim)
        keys, values = (torch.empty(shape, dtype=dtype, device=like.device) for _ in "kv")
        rotated = keys if rope_dtype == dtype else torch.empty(shape, dtype=rope_dtype, device=like.device)
        out = rotated.permute(1, 3, 0, 2, 4)  # (B, T, layers, heads, D) view of the cache layout
        if self.compile_rope:
            out.copy_(compiled_rotate()(rows, cos, sin, rope_dtype))
        else:
            rotate_into(rows, cos, sin, out)
        if rotated is not keys:
            keys.copy_(rotated)
        values.permute(1, 3, 0, 2, 4).copy_(value_rows.view(batch, seq, num_layers, tgt.num_kv_heads, tgt.head_dim))
        return keys, values

    def _mapped(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Finished target keys and values of `layer_idx` `[B, n_kv, T, d]`, computed with the other layers of its
        group (which then wait, finished, in `_PendingTransfer.ahead`)."""
        transfer = self._transfer
        if layer_idx not in transfer.ahead:
            key_feats, value_feats = (f.to(like.device) for f in self._selection_features(layer_idx))
            group, dense = _plan_group(self.mapper, layer_idx, self._pending, key_feats.shape[0] * key_feats.shape[1])
            if self.mapper.layers[layer_idx].linear_parts("key") is None:  # nonlinear: the map's own forward
                rows = self.mapper.layers[layer_idx](key_feats, value_feats)
            else:
                rows = [self._affine_rows(group, kind, x, dense) for kind, x in (("key", key_feats), ("value", value_feats))]
            keys, values = self._finish(*rows, len(group), like)
            for i, t in enumerate(group):
                transfer.ahead[t] = (keys[i], values[i])
        keys, values = transfer.ahead.pop(layer_idx)
        # Computed with an earlier layer of the group, which under a device map may live elsewhere.
        return keys.to(like.device, like.dtype), values.to(like.device, like.dtype)

    @torch.no_grad()
    def _convert(self, layer_idx: int, like: torch.Tensor) -> None:
        tgt = self.mapper.target_layout
        if like.shape[1] != tgt.num_kv_heads or like.shape[-1] != tgt.head_dim:
            raise ValueError(
                f"target layer {layer_idx} passes key_states {list(like.shape)} but the mapper produces "
                f"[batch, {tgt.num_kv_heads}, seq, {tgt.head_dim}] for {self.mapper.config.target_model_id}; "
                "load the mapper made for this target model"
            )
        transfer = self._transfer
        if transfer.length > 0:
            keys, values = self._mapped(layer_idx, like)
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
        selected = tuple(self.mapper.config.selected_layers[layer_idx])
        readers = [t for t in self._pending if tuple(self.mapper.config.selected_layers[t]) == selected]
        if all(t in transfer.ahead for t in readers):  # every other reader is mapped already
            transfer.features.pop(selected, None)
        for s in selected:
            layer = transfer.sources.get(s)
            if layer is None:  # read only by layers the target computed itself (num_exact_layers)
                continue
            layer.readers.discard(layer_idx)
            if not layer.readers:
                # Every reader of this source layer is converted: free it (the caller's cache keeps its own).
                del transfer.sources[s]
        if not self._pending:
            self._transfer = None
            bad = sorted(s for s, flag in transfer.nonfinite if bool(flag))
            if bad:
                raise ValueError(f"source cache layers {bad} have non-finite values (NaN/inf); check the source model's dtype")

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
        if self._transfer is None:
            return self
        some = next(iter(self._transfer.sources.values()))
        tgt = self.mapper.target_layout
        like = torch.empty(
            (self._transfer.batch_size, tgt.num_kv_heads, 0, tgt.head_dim),
            device=device if device is not None else some.keys.device,
            dtype=dtype if dtype is not None else some.keys.dtype,
        )
        for layer_idx in sorted(self._pending):
            self._convert(layer_idx, like)
        return self

    # -- cache operations that must also act on what is not converted yet -----------------------------
    def _map_prompt(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.prompt_ids is not None:
            self.prompt_ids = fn(self.prompt_ids)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0:
            keep = self.get_seq_length() + tokens_to_remove
            self._map_prompt(lambda t: t[:, : max(keep, 0)])
        if self._transfer is not None and tokens_to_remove < 0:
            transfer = self._transfer
            transfer.length -= min(-tokens_to_remove, transfer.length)
            keep = transfer.length
            transfer.map_tensors(lambda t: t[..., :keep, :] if t.ndim == 4 else t[:, :keep])
        elif self._transfer is not None and tokens_to_remove > 0:
            raise ValueError(
                f"`crop` takes a negative number of tokens to remove, got {tokens_to_remove} (as DynamicCache)"
            )
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        transfer = self._transfer
        if transfer is not None:
            batch_size = beam_idx.numel()
            if batch_size != transfer.batch_size and batch_size % transfer.batch_size == 0:
                repeats = batch_size // transfer.batch_size
                transfer.map_tensors(lambda t: t.repeat_interleave(repeats, dim=0))
            transfer.map_tensors(lambda t: t.index_select(0, beam_idx.to(t.device)))
        if self.prompt_ids is not None and beam_idx.numel() % self.prompt_ids.shape[0] == 0:
            repeats = beam_idx.numel() // self.prompt_ids.shape[0]
            self._map_prompt(lambda t: t.repeat_interleave(repeats, dim=0).index_select(0, beam_idx.to(t.device)))
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._transfer is not None:
            self._transfer.map_tensors(lambda t: t.repeat_interleave(repeats, dim=0))
        self._map_prompt(lambda t: t.repeat_interleave(repeats, dim=0))
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._transfer is not None:
            self._transfer.map_tensors(lambda t: t[indices.to(t.device)])
        self._map_prompt(lambda t: t[indices.to(t.device)])
        super().batch_select_indices(indices)

    def reset(self) -> None:
        self._pending.clear()
        self._transfer = None
        super().reset()

    def __repr__(self) -> str:
        return (
            f"TransferredCache(layers={len(self.layers)}, pending={len(self._pending)}, "
            f"transferred_tokens={self._transferred_tokens}, mapper={self.mapper.config.source_model_id}->"
            f"{self.mapper.config.target_model_id})"
        )
