"""TransferredCache: a `DynamicCache` for the target model, filled lazily from the source model's cache.

This module is the cache object itself: what it reports before its layers are converted, when each is converted
(on the first `update` of that layer), and the cache operations that must act on what is not converted yet. How a
layer is converted lives in `conversion`, the target's own first layers in `exact`, what the target is fed (told by
a forward pre-hook on the target, and checked) in `told`.
"""

from __future__ import annotations

import copy
import functools
import os
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Cache, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from .conversion import PendingTransfer, RopeTables, SourceLayer
from .exact import own_prefix
from .grouped_attention import prefer_grouped_sdpa
from .defaults import resolve_transfer
from .mapper import KVMapper
from .map_inputs import ExactPass, first_layer_rows
from .options import with_options
from .quality_gate import PendingGate, QualityGateConfig, TransferStatus, run_gate
from .rope import position_ids_from_mask
from .told import ForwardInputs, Listener, check_mask, check_prompt, listen, refeeds_prompt

@functools.lru_cache(maxsize=8)
def _load_mapper(name_or_path: str, revision: str | None, token: str | bool | None) -> KVMapper:
    # One load per process: a cache is built per request, the mapper is shared.
    return KVMapper.from_pretrained(name_or_path, revision=revision, token=token)


def _as_mapper(mapper: KVMapper | str | os.PathLike, revision: str | None, token: str | bool | None) -> KVMapper:
    """`mapper` itself, or the one its repo id / path names (loaded once per process)."""
    if isinstance(mapper, KVMapper):
        return mapper
    if not isinstance(mapper, (str, os.PathLike)):
        raise TypeError(f"mapper must be a KVMapper or a repo id / path, got {type(mapper).__name__}")
    return _load_mapper(os.fspath(mapper), revision, token)


def _prompt_ids(given: torch.Tensor | None, source_cache, batch_size: int, length: int) -> torch.Tensor | None:
    """The ids of the source cache's prompt: the ones given, else the ones `prefill` recorded (`prompt_ids`)."""
    prompt_ids = given if given is not None else getattr(source_cache, "prompt_ids", None)
    if prompt_ids is not None and tuple(prompt_ids.shape) != (batch_size, length):
        raise ValueError(
            f"input_ids has shape {list(prompt_ids.shape)} but the source cache holds {length} tokens x batch "
            f"{batch_size}; pass the ids the source cache was built from"
        )
    return prompt_ids


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




def _prompt_mask(given: torch.Tensor | None, source_cache, batch_size: int, length: int) -> torch.Tensor | None:
    """The mask of the source cache's tokens: the one given, else the one `prefill` recorded (`prompt_attention_mask`);
    a given mask that is not the recorded one would place the tokens at other positions than the source did."""
    if given is not None and (given.ndim != 2 or given.shape[0] != batch_size or given.shape[-1] < length):
        raise ValueError(
            f"attention_mask has shape {list(given.shape)} but the source cache holds {length} tokens x batch "
            f"{batch_size}; pass the [batch, seq] mask the source cache was built with"
        )
    if not hasattr(source_cache, "prompt_attention_mask"):  # not from `prefill`: the caller's word
        return given
    recorded = source_cache.prompt_attention_mask
    if given is None:
        return recorded
    ones = torch.ones(batch_size, length, dtype=torch.long)
    a = given[:, :length].to("cpu", torch.long)
    b = ones if recorded is None else recorded[:, :length].to("cpu", torch.long)
    if not torch.equal(a, b):
        where = (a != b).nonzero()[0].tolist()
        built = "without a mask (no padding)" if recorded is None else "with another attention_mask"
        raise ValueError(
            f"attention_mask differs from the mask the source cache was built with (first at row {where[0]}, position "
            f"{where[1]}): `prefill` ran {built}; pass the same attention_mask to `prefill` and here (or none here: "
            "the one `prefill` recorded is used)"
        )
    return given

def _reorder_prompt(ids: torch.Tensor, beam_idx: torch.LongTensor) -> torch.Tensor:
    if beam_idx.numel() % ids.shape[0]:
        return ids
    repeats = beam_idx.numel() // ids.shape[0]  # beam search's first reorder: rows expanded
    return ids.repeat_interleave(repeats, dim=0).index_select(0, beam_idx.to(ids.device))


# The cache operations on the ids of the prompt a `TransferredCache` holds (`[batch, seq]`); `crop` is the cache's
# own (it keeps the tokens the cache keeps: `_keep_prompt`).
prompt_operations: dict[str, Callable[..., torch.Tensor]] = {
    "crop": lambda ids, tokens_to_remove: ids,
    "reorder_cache": _reorder_prompt,
    "batch_repeat_interleave": lambda ids, repeats: ids.repeat_interleave(repeats, dim=0),
    "batch_select_indices": lambda ids, indices: ids[indices.to(ids.device)],
}


@dataclass(frozen=True)
class TransferOptions:
    """How a `TransferredCache` converts its source cache; each field is also accepted as a keyword of
    `TransferredCache` (`strict=True`), where they are described."""

    strict: bool = False
    num_exact_layers: int | None = None
    exact_window: int | None = None
    gate: bool | QualityGateConfig | None = None
    revision: str | None = None
    token: str | bool | None = None


class TransferredCache(DynamicCache, Listener):
    """The target model's KV cache, converted from the source model's cache one layer at a time.

    Nothing is mapped at construction. The first time the target's attention layer `layer_idx` calls
    `update`, that layer's KV is produced from the source cache (strip source RoPE -> map -> apply
    target RoPE, on the device and in the dtype of the incoming `key_states`), and the cache then behaves
    exactly like a `DynamicCache`. Pass it to stock `generate` (`cache=` or `past_key_values=`), built with
    `model=target`: the target tells it what each forward is fed (`told.py`). Under `torch.compile`
    (the target's forward or the whole module), the first forward converts every layer at once, before its graph (one
    graph break, where its input is checked); with `fullgraph=True`, `convert_all()` first. Later turns are checked
    when only the forward is compiled (`target.forward = torch.compile(...)`: the hooks run eagerly), not under
    `torch.compile(target)`, whose graph holds the hook.

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
            stripped and re-applied at the per-row positions `cumsum(mask) - 1`. Default: the mask `prefill`
            recorded on its cache (a different one is an error); the target must be given the same mask.
        num_recompute_tokens: trailing prompt tokens left for the target to recompute. Default (None):
            `resolve_num_recompute_tokens(None, prompt length, mapper, num_exact_layers)`: the mapper's recorded
            number, else 32 (1 when every layer is exact and the prompt's ids are known); at most half the prompt,
            at least 1. 1 is the
            fastest under `generate`; 0 only suits a direct forward of new tokens.
        options: `TransferOptions` (in `hf_kvtransfer.core.cache`): `strict`, `num_exact_layers`, `exact_window`,
            `gate`, `revision` and `token` below; each may be given as a keyword instead (`strict=True`), which
            overrides it.
        strict: when the source cache comes from `prefill`, its model's config is compared with the one the
            mapper was fit for; a difference beyond KV shapes warns, or raises with `strict=True`.
        input_ids: `[batch, seq]` ids of the prompt the source cache holds. Recorded by `prefill` on its cache and
            read from there when not given. With them, the cache refuses input that does not continue that prompt.
        num_exact_layers: the target's first layers computed by the target itself from the prompt ids instead of
            mapped, at the cost of that share of a prefill (layer 0's keys and values depend only on each token and
            its position: one layer's K/V projections). Needs the prompt ids (see `input_ids`) and the target model
            (see `model`); happens when the target's first layer runs on the cache, or in `convert_all`. Default
            (None): the mapper's `num_exact_layers`, which a fit chooses as the fewest layers that keep the target's
            copying from the context (1 for mappers that record none; `defaults.resolve_transfer`). 0 maps every layer.
        exact_window: the exact layers attend, over the transferred prompt, only to this many tokens up to each one
            (`local_attention.py`: at long prompts their attention costs prompt x window instead of prompt^2).
            Default (None): the mapper's `exact_window`, which a fit records where its content gate accepts one
            (none: the whole prompt); 0: the whole prompt.
        model: the target model that runs on the cache (`generate` or `target(...)`, with ids or `inputs_embeds`;
            `torch.compile(target)` too): the model then tells the cache what each forward is fed, before it runs
            (`told.listen`), which is checked against the prompt, and computes the exact layers. A forward on a cache
            built without it (or run by another model) refuses before any output; `convert_all` / `convert_layer`
            need it only for exact layers (or `compute_exact_layers(model)` first). A target on CPU that uses
            transformers' `sdpa` attention with fewer key/value heads than query heads is switched to `hf_kvtransfer.GROUPED_SDPA` when the cache meets it: the same attention and numbers,
            without copying each layer's cache per query head in the recomputed tokens' forward
            (`core/grouped_attention.py`).
        gate: the per-request quality gate (`quality_gate.py`). Default (None): the mapper's own
            (`mapper.config.quality_gate`; none for mappers fit without one); False: off; or a `QualityGateConfig`.
            With a gate, the first forward maps every layer at once, scores each row on the recomputed tokens, and
            gives rows below the threshold the target's own prefill (the same call then returns the target's own
            answer for them); `transfer_status` says which. It needs the prompt's ids and at least one recomputed token.
        revision, token: used when `mapper` is a Hub repo id.

    Example:
        ```python
        src_cache = prefill(source, input_ids, attention_mask=mask)
        cache = TransferredCache(src_cache, mapper, attention_mask=mask, model=target)
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
        options: TransferOptions | None = None,
        input_ids: torch.Tensor | None = None,
        model: PreTrainedModel | None = None,
        **keywords: Any,
    ):
        o = with_options(TransferOptions, options, keywords, "TransferredCache")
        mapper = _as_mapper(mapper, o.revision, o.token)
        super().__init__(config=mapper.target_model_config)
        self.mapper = mapper

        source_config = getattr(source_cache, "source_model_config", None)
        if source_config is not None:
            mapper.check_compatible(source_config=source_config, strict=o.strict)
        sources, length, batch_size, device = self._read_source(source_cache)
        attention_mask = _prompt_mask(attention_mask, source_cache, batch_size, length)
        settings = resolve_transfer(mapper, length, o.num_exact_layers, num_recompute_tokens, o.exact_window)
        self.num_exact_layers, self.num_recompute_tokens = settings.num_exact_layers, settings.num_recompute_tokens
        self.exact_window = settings.exact_window
        transferred = length - self.num_recompute_tokens
        positions = position_ids_from_mask(attention_mask, batch_size, length, device)
        self._gate = self._pending_gate(o.gate, source_cache, attention_mask, positions, batch_size, transferred)
        for layer in sources.values():
            layer.keys, layer.values = layer.keys[:, :, :transferred], layer.values[:, :, :transferred]
        rope = RopeTables(mapper.rotary, positions[:, :transferred])
        mask = attention_mask[:, :transferred] if attention_mask is not None else None
        self._transfer: PendingTransfer | None = PendingTransfer(mapper, sources, rope, transferred, batch_size, mask)
        self._pending = set(range(len(self.layers)))
        self._transferred_tokens = transferred
        # The ids of the prompt the source read (None when unknown): the target's input must continue them.
        self.prompt_ids = _prompt_ids(input_ids, source_cache, batch_size, length)
        if self.prompt_ids is not None:
            self._give_ids(self.prompt_ids)
        self._attach_model(getattr(model, "_orig_mod", model), transferred)  # torch.compile(target): the module it wraps

    def _pending_gate(self, gate: Any, source_cache, attention_mask, positions: torch.Tensor, batch_size: int,
                      transferred: int) -> PendingGate | None:  # fmt: skip
        """The per-request quality gate asked for (`gate`: None or True, the mapper's own; False: off; or a
        `QualityGateConfig`), pending until the first forward; sets the status every row starts with."""
        gate = self.mapper.config.quality_gate if gate is None or gate is True else (gate or None)
        self.transfer_status = TransferStatus((True,) * batch_size, None, gate.threshold if gate else None)
        if gate is None or self.num_recompute_tokens == 0 or transferred == 0:
            return None
        return PendingGate(gate, source_cache, attention_mask, positions)

    def _attach_model(self, model: PreTrainedModel | None, transferred: int) -> None:
        """Listen to the target model's forwards (`hear`) and keep it for the exact layers (dropped once computed)."""
        if model is not None:
            self.mapper.check_compatible(target_config=model.config)
            prefer_grouped_sdpa(model)
            listen(model)  # its forwards tell the cache what they are fed (`hear`)
        self._exact_model: PreTrainedModel | None = model if (self.num_exact_layers or self._gate) and transferred else None
        self._exact_pending = self.num_exact_layers > 0 and transferred > 0
        self._exact_prompt: torch.Tensor | None = None  # the prompt's ids from generate's sequence (`_learn_prompt`)
        self._told: ForwardInputs | None = None  # the first forward's inputs, told by the model's hooks (`hear`)
        self._model = weakref.ref(model) if model is not None else None  # the model whose forwards it hears
        self._only_new_tokens = False  # the first forward fed only new tokens (a mask covering the cached ones)

    def _read_source(self, source_cache: Cache | tuple) -> tuple[dict[int, SourceLayer], int, int, torch.device]:
        """The source layers the mapper reads, checked against the mapper's source layout; the prompt's length, the
        batch size and the device of the source's cache."""
        mapper, layout = self.mapper, self.mapper.source_layout
        layers = _source_layers(source_cache)
        if len(layers) != layout.num_layers:
            raise ValueError(
                f"source cache has {len(layers)} layers but the mapper was fit for a source with "
                f"{layout.num_layers} layers ({mapper.config.source_model_id}); build the cache with that model"
            )
        sources: dict[int, SourceLayer] = {}
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
            sources[s] = SourceLayer(keys, values, set(readers))
        if length is None:  # no map reads the source (residual-alone and mean maps): its cache gives the length
            keys = layers[0][0]
            if keys is None or keys.ndim != 4 or keys.numel() == 0:
                raise ValueError("source cache layer 0 is empty; run the source prefill before transferring")
            length, batch_size = keys.shape[-2], keys.shape[0]
        return sources, length, batch_size, keys.device

    def __deepcopy__(self, memo):
        # Share the mapper and rotary modules: a copy of a cache must not copy model-sized weights.
        shared = [self.mapper]
        if self._gate is not None:  # the caller's source cache
            shared.append(self._gate.source_cache)
        if self._exact_model is not None:
            shared.append(self._exact_model)  # the target model itself
        if self._told is not None:
            shared.append(self._told.model)
        if self._transfer is not None:  # (its RoPE tables' rotary modules are the mapper's)
            for state in self._transfer.inputs.values():  # an input's modules are the target's own
                shared += list(state.values()) if isinstance(state, dict) else []
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
        if self._pending and torch.compiler.is_compiling():
            self._convert_before_graph()
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
        if self._pending and torch.compiler.is_compiling():
            self._convert_before_graph()
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
    def listening(self) -> bool:
        # A compiled forward hears only its first (where it converts): a graph cannot read its inputs at every turn.
        return bool(self._pending) or not torch.compiler.is_compiling()

    def hear(self, inputs: ForwardInputs, compiled: bool) -> None:
        """Told by the target's forward pre-hook (`told.listen`) what the forward about to run on this cache is fed:
        the input is checked here, before the forward builds positions and masks from the cache. A compiled forward
        converts every layer here too (its one graph break; `_convert_before_graph`)."""
        if self._model is None or inputs.model is not self._model():
            return  # another model's forward: not what this cache was built for (`update` refuses it)
        if not self._pending:
            self._check_continuation(inputs)
            return
        self._told = inputs
        self._check_first_input(inputs)
        if compiled:
            self._convert_every_layer()

    @torch.compiler.disable
    def _convert_before_graph(self) -> None:
        """A compiled forward's first question to the cache (its length, or its mask sizes), run eagerly (one graph
        break) where the model's hook ran outside the graph (`target.forward = torch.compile(...)`): every pending
        layer converted in the forward's rows, device and dtype, so the traced layers find a plain cache. Converting
        one layer per `update` instead would change the state each traced layer is guarded on (a recompile per
        layer) and break the graph in every one. Eagerly each layer is converted when it arrives (`update`)."""
        self._require_told()
        self._convert_every_layer()

    def _convert_every_layer(self) -> None:
        if self._transfer is None:
            return  # the forward re-feeds the prompt: it computes it itself
        like = self._forward_like(self._told)
        for layer_idx in sorted(self._pending):
            self._arrive(layer_idx, like, appended=False)  # laid out as a prefill's: the graph's guards on strides hold

    def _require_told(self) -> None:
        if self._told is None:
            raise ValueError(
                "a forward runs on this TransferredCache but the cache was not told what it is fed: build it with "
                "model=target, the model whose forward runs on it (TransferredCache(src_cache, mapper, model=target))"
            )

    def _forward_like(self, told: ForwardInputs) -> torch.Tensor:
        """An empty `[rows, n_kv, 0, d]` tensor like the key states the running forward's layers will pass: its rows
        (from what it was fed), the model's device and dtype (autocast's where it is on)."""
        model, fed = told.model, told.fed
        param = model.get_input_embeddings().weight
        dtype = torch.get_autocast_dtype(param.device.type) if torch.is_autocast_enabled(param.device.type) else model.dtype
        like = self._like(param.device, dtype)
        rows = fed.shape[0] if fed is not None else like.shape[0]
        return like.new_empty((rows, *like.shape[1:]))

    def _check_first_input(self, told: ForwardInputs) -> None:
        """Check the first forward on the transferred tokens, before it builds positions and masks from them."""
        held = self._transfer.length
        if told.ids is None:
            if told.embeds is not None:
                check_mask(told, self._transfer.attention_mask, held)
                self._check_embeds(told.embeds, told.model)
            return
        fed = told.ids
        prompt = self.prompt_ids if self.prompt_ids is not None else told.sequence
        if refeeds_prompt(told, prompt, held):
            # The forward re-feeds the transferred prompt from its start: transformers' assisted decoding and prompt
            # lookup do on their first step, as does generate with num_recompute_tokens=0. Appending it would hold
            # the prompt twice; the target computes it itself instead (exact, but nothing is saved).
            warnings.warn(
                f"the target is fed the {held} transferred prompt tokens again (assisted decoding and prompt lookup "
                "re-feed the whole prompt on their first step; so does generate with num_recompute_tokens=0): it "
                "recomputes them itself and the transferred cache is not used",
                stacklevel=5,
            )
            self._drop_transfer()
            self._keep_prompt(fed.shape[-1] if told.direct else told.sequence.shape[-1])
            return
        self._only_new_tokens = check_prompt(told, self.prompt_ids, held, self.num_recompute_tokens)
        check_mask(told, self._transfer.attention_mask, held)
        # From here the cache holds what the target is given: a later turn continues that, not the rest of the prompt
        # (generate on a prefix of the prompt goes on with its own tokens; assisted decoding's drafts are not given).
        self._keep_prompt(held + fed.shape[-1] if told.direct else max(told.sequence.shape[-1], held))
        if self.prompt_ids is None and not told.direct:
            self._learn_prompt(told.sequence)

    def _check_continuation(self, told: ForwardInputs) -> None:
        """A later turn under generate (decode steps, one token each, skip this) continues the conversation held."""
        if told.ids is None or told.direct or told.ids.shape[-1] <= 1 or self._only_new_tokens:
            # Only new tokens (checked on the first forward): the sequence never holds the prompt, so later steps have
            # no prompt to compare (prompt lookup's steps can be as long as the cache).
            return
        check_prompt(told, self.prompt_ids, self.get_seq_length(), self.num_recompute_tokens)

    def _drop_transfer(self) -> None:
        self._pending.clear()
        self._transfer = None
        self._exact_pending = False

    def _check_embeds(self, fed: torch.Tensor, model: PreTrainedModel | None) -> None:
        """A first forward of `inputs_embeds`: its ids are unknown, so only a re-fed prompt is recognised (the
        embeddings of the cached prompt's ids, as generate feeds with num_recompute_tokens=0), and then recomputed
        as with ids; anything else is taken as what follows the cached tokens."""
        held, prompt = self._transfer.length, self.prompt_ids
        if held == 0 or model is None or prompt is None or fed.shape[1] < held:
            return
        if fed.shape[0] % prompt.shape[0]:
            return
        # beam search and num_return_sequences repeat each row in place
        rows = prompt[:, :held].repeat_interleave(fed.shape[0] // prompt.shape[0], dim=0)
        own = model.get_input_embeddings()(rows.to(fed.device))
        if not torch.equal(own.to(fed.dtype), fed[:, :held]):
            return
        warnings.warn(
            f"the target is fed the {held} transferred prompt tokens again (as embeddings; generate does with "
            "num_recompute_tokens=0): it recomputes them itself and the transferred cache is not used",
            stacklevel=5,
        )
        self._drop_transfer()

    def _learn_prompt(self, sequence: torch.Tensor) -> None:
        """The prompt's ids from generate's sequence, for a cache built without them: it starts with the prompt
        (checked by `check_prompt`); beam search and num_return_sequences repeat each row in place."""
        rows, batch = sequence.shape[0], self._transfer.batch_size
        if rows % batch or sequence.shape[-1] < self._transfer.length:
            return  # not this cache's prompt: the exact layers then say what is missing
        prompt = sequence[:: rows // batch]
        self._exact_prompt = prompt[:, : self._transfer.length] if self._exact_pending else None
        self._give_ids(prompt)

    def _compute_exact_from_context(self) -> None:
        """Compute the exact layers with what the cache was told or learned; refuse in one line when it lacks the
        target model or the prompt's ids (never map those layers in their place)."""
        n, held = self.num_exact_layers, self._transfer.length
        undo = "or num_exact_layers=0 to map every layer"
        if self._exact_model is None:
            raise ValueError(
                f"this cache computes the target's first {n} layer(s) itself (num_exact_layers={n}) but was not given "
                f"the target model: pass model=target to TransferredCache or call compute_exact_layers(target), {undo}"
            )
        prompt = self.prompt_ids if self.prompt_ids is not None else self._exact_prompt
        if prompt is None or prompt.shape[-1] < held:
            reads = ", ".join(inp.name for inp in self.mapper.map_inputs if inp.needs_prompt_ids)
            raise ValueError(
                f"this cache computes the target's first {n} layer(s) from the prompt's ids (the residual stream and "
                f"other inputs its maps read come from there too{': ' + reads if reads else ''}), and it does not know "
                f"them: build the source cache with `prefill` or pass input_ids= to TransferredCache, {undo}"
            )
        self.compute_exact_layers(self._exact_model, prompt)

    def _give_ids(self, prompt: torch.Tensor) -> None:
        """Hand the map inputs that read the prompt's ids (rows looked up by id) their state for the transferred tokens."""
        transfer = self._transfer
        waiting = [inp for inp in self.mapper.map_inputs if transfer is not None and inp.name not in transfer.inputs]
        if not waiting:
            return
        ids = prompt[:, : transfer.length]
        if ids.shape[-1] < transfer.length or ids.shape[0] % transfer.batch_size:
            return  # not this cache's prompt: converting a layer that needs them then says what is missing
        if ids.shape[0] != transfer.batch_size:  # generate's beam / sample rows repeat the prompt's in place
            ids = ids[:: ids.shape[0] // transfer.batch_size]
        for inp in waiting:
            state = inp.from_ids(ids, transfer.attention_mask)
            if state is not None:
                transfer.inputs[inp.name] = state

    def compute_exact_layers(self, model: PreTrainedModel, input_ids: torch.Tensor | None = None) -> "TransferredCache":
        """Compute the target's first `num_exact_layers` layers now, with `model` itself, instead of mapping them.

        A forward on the cache (`generate`, or `target(...)`) does this by itself when its first layer runs; call it
        to drive the conversion without one (a serving engine filling its own KV blocks, timing, inspection), then
        `convert_all()` for the rest.

        Args:
            model: the target model (or one holding at least its first `num_exact_layers` layers, with its
                embeddings and rotary module).
            input_ids: `[batch, seq]` ids of the prompt the source cache holds; default: the ones this cache knows
                (`input_ids=` at construction, or recorded by `prefill`).

        Raises:
            ValueError: when no prompt ids are known, or they are not the cached prompt's length.
        """
        transfer = self._transfer
        prefer_grouped_sdpa(model)
        if input_ids is not None:
            self._give_ids(input_ids)
        if transfer is None or not self.num_exact_layers or not self._exact_pending:
            return self
        prompt = input_ids if input_ids is not None else self.prompt_ids
        if prompt is None or prompt.shape[-1] < transfer.length:
            raise ValueError(
                f"computing the target's first {self.num_exact_layers} layer(s) needs the prompt's ids: pass "
                "`input_ids=` (the ids the source cache was built from) here or to TransferredCache"
            )
        exact, ids, inputs = range(self.num_exact_layers), prompt[:, : transfer.length], self.mapper.map_inputs
        # The residual stream an input reads, captured on the way (at most one layer: `MapInput.hidden_layer`).
        layer = next((inp.hidden_layer() for inp in inputs if inp.hidden_layer() is not None), None)
        hidden = None
        # Layer 0's K/V depend on the ids alone: an input holding them per id has them looked up (the target's own
        # numbers), not projected.
        looked_up = first_layer_rows(self.mapper, ids) if len(exact) == 1 and layer is None else None
        if looked_up is not None:
            own = [transfer.own_first_layer(looked_up, model.get_input_embeddings().weight)]
        else:
            own = own_prefix(model, ids, transfer.attention_mask, transfer.rope.position_ids, len(exact), hidden_of=layer,
                             window=self.exact_window)  # fmt: skip
            own, hidden = own if layer is not None else (own, None)
        exact_pass = ExactPass(model, ids, transfer.attention_mask, hidden)
        for inp in inputs:
            state = inp.from_exact_pass(exact_pass)
            if state is not None:
                transfer.inputs[inp.name] = state
        for t, kv in zip(exact, own):
            transfer.ahead[t] = kv
        for s, layer in list(transfer.sources.items()):
            layer.readers.difference_update(exact)
            if not layer.readers:
                del transfer.sources[s]
        self._exact_pending, self._exact_model, self._exact_prompt = False, None, None
        return self

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
            self._require_told()
            self._arrive(layer_idx, key_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _arrive(self, layer_idx: int, like: torch.Tensor, appended: bool = True) -> None:
        """A pending layer's first `update`: the gate (on the first), the exact layers (where the forward needs them:
        the checks before it are getters), then this layer's conversion (`_convert`'s `appended`)."""
        if self._gate is not None and self._pending == set(range(len(self.layers))):
            self._run_gate(like)
        if layer_idx in self._pending:
            if self._exact_pending:
                self._compute_exact_from_context()
            self._convert(layer_idx, like, appended=appended)

    @torch.no_grad()
    def _run_gate(self, like: torch.Tensor) -> None:
        """The quality gate, on the first conversion: every layer from the source at once, rows below the threshold
        from the target's own prefill (`quality_gate.run_gate`)."""
        pending, self._gate = self._gate, None
        if self._exact_model is None or self.prompt_ids is None:
            raise ValueError(
                "this cache's quality gate runs the target on the recomputed tokens and needs the target model and the "
                "prompt's ids: build the source cache with `prefill` (or pass input_ids=) and run the target on the "
                "cache (or pass model=), or pass gate=False"
            )
        self.transfer_status = run_gate(self, pending, self._exact_model, like)

    def fill_converted(self, layers: list[tuple[torch.Tensor, torch.Tensor]], batch_size: int | None = None) -> None:
        """Store finished target K/V for every pending layer at once (the gate's path) and drop the pending transfer;
        with `batch_size` (the forward's rows), repeated to it as the maps' path does (several continuations of one
        prompt, beams)."""
        for layer_idx, (keys, values) in enumerate(layers):
            if batch_size is not None and batch_size != keys.shape[0]:
                keys, values = self._expand_batch(keys, values, batch_size)
            self.layers[layer_idx].update(keys, values)
        self._pending.clear()
        self._transfer, self._exact_pending, self._exact_model, self._exact_prompt = None, False, None, None

    @torch.no_grad()
    def _convert(self, layer_idx: int, like: torch.Tensor, appended: bool = False) -> None:
        """Store target layer `layer_idx`'s finished K/V. Mapped layers come as strided views (`PendingTransfer._finish`):
        laid out contiguously here, as a prefill's cache holds them, unless the forward's tokens are `appended` next
        (`update`), whose concatenation makes that copy anyway."""
        tgt = self.mapper.target_layout
        if like.shape[1] != tgt.num_kv_heads or like.shape[-1] != tgt.head_dim:
            raise ValueError(
                f"target layer {layer_idx} passes key_states {list(like.shape)} but the mapper produces "
                f"[batch, {tgt.num_kv_heads}, seq, {tgt.head_dim}] for {self.mapper.config.target_model_id}; "
                "load the mapper made for this target model"
            )
        transfer = self._transfer
        if transfer.length > 0:
            keys, values = transfer.mapped(layer_idx, like, self._pending)
            if like.shape[0] != keys.shape[0]:
                keys, values = self._expand_batch(keys, values, like.shape[0])
            if not appended:
                keys, values = keys.contiguous(), values.contiguous()
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
        """Convert every pending layer now (e.g. to time the transfer or to inspect the target KV): the exact layers
        with the target model (`model=` at construction, or `compute_exact_layers` first), then the maps.

        Raises:
            ValueError: when exact layers are pending and the cache was not given the target model.
        """
        if self._transfer is None:
            return self
        if self._exact_pending:
            self._compute_exact_from_context()
        like = self._like(device, dtype)
        for layer_idx in sorted(self._pending):
            self._convert(layer_idx, like)
        return self

    def convert_layer(self, layer_idx: int, device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Convert target layer `layer_idx` now, if it is pending (the exact layers first, as `convert_all`; layers
        its map is computed with wait converted), and return its keys and values `[batch, n_kv, seq, d]`: a serving
        engine filling its KV blocks one layer at a time, as its forward reaches them. In ascending order it converts
        exactly as `convert_all` does."""
        if layer_idx in self._pending:
            if self._exact_pending:
                self._compute_exact_from_context()
            self._convert(layer_idx, self._like(device, dtype))
        layer = self.layers[layer_idx]
        return layer.keys, layer.values

    def _like(self, device, dtype) -> torch.Tensor:
        """An empty `[batch, n_kv, 0, d]` tensor on `device` in `dtype` (default: those of what the pending transfer
        holds: a source layer still read, else (maps without source inputs) the exact layers' own K/V)."""
        transfer = self._transfer
        if transfer.sources:
            some = next(iter(transfer.sources.values())).keys
        elif transfer.ahead:
            some = next(iter(transfer.ahead.values()))[0]
        else:
            some = next(layer.keys for layer in self.layers if getattr(layer, "is_initialized", False))
        tgt = self.mapper.target_layout
        return torch.empty(
            (transfer.batch_size, tgt.num_kv_heads, 0, tgt.head_dim),
            device=device if device is not None else some.device,
            dtype=dtype if dtype is not None else some.dtype,
        )

    # -- cache operations: handed to what is not converted yet, then to the layers ---------------------------
    # As transformers' `Cache` hands each operation to its layers, these hand it to the pending transfer's state
    # (`PendingTransfer`: the source layers still read, the exact layers' own K/V, the map inputs' state) and to the
    # prompt's ids (`prompt_operations`), then to the layers themselves.
    def _keep_prompt(self, length: int) -> None:
        if self.prompt_ids is not None and self.prompt_ids.shape[-1] > length:
            self.prompt_ids = self.prompt_ids[:, :length]

    def _hand(self, operation: str, *args) -> None:
        if self._transfer is not None:
            getattr(self._transfer, operation)(*args)
        if self.prompt_ids is not None:
            self.prompt_ids = prompt_operations[operation](self.prompt_ids, *args)
        getattr(super(), operation)(*args)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0:
            self._keep_prompt(max(self.get_seq_length() + tokens_to_remove, 0))
        self._hand("crop", tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._hand("reorder_cache", beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._hand("batch_repeat_interleave", repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._hand("batch_select_indices", indices)

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
