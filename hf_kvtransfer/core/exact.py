"""The target's own keys and values of its first layers, computed from the prompt ids (a `TransferredCache`'s
exact layers): a forward of the target's body that stops as soon as the last layer asked for has stored its K/V.

Layer 0's keys and values depend on each token's id alone (its embedding through the layer's norm and
projections; RoPE comes after), so a map input may hold them as one row per id (`MapInput.first_layer_rows`): with
one exact layer the cache then looks them up and applies the target's RoPE, the same numbers without the projections.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from .capture import cache_argument
from .local_attention import attend_within


class StopForward(Exception):
    """Raised by `PrefixCache` to end a forward once the layers it needs have stored their keys and values."""


class PrefixCache(DynamicCache):
    """Keeps what the first `num_layers` layers of a forward store, then stops the forward (its later layers and the
    logits are never computed)."""

    def __init__(self, num_layers: int):
        super().__init__()
        self.num_layers = num_layers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == self.num_layers - 1:
            raise StopForward
        return out


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM or its base model (`model.model.layers` in transformers' decoders)."""
    body = model.base_model if hasattr(model, "base_model") else model
    layers = getattr(body, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (expected `.layers` on its base model)")
    return layers


@torch.no_grad()
def own_prefix(
    model: PreTrainedModel, input_ids, attention_mask, position_ids, num_layers: int, hidden_of: int | None = None,
    window: int | None = None,
):
    """The keys and values `model` itself computes for its first `num_layers` layers: `[(keys, values)]`, each
    `[batch, kv_heads, seq, head_dim]`. Costs those layers' share of a prefill (for one layer: its K/V projections):
    layers `0 .. num_layers-2` run whole, the last one only up to its keys and values.

    With `hidden_of` (< num_layers), returns `(kv, hidden)` with `hidden` the residual stream entering that layer,
    `[batch, seq, hidden_size]`, taken on the way. With `window`, the layers attend only to the `window` tokens up to
    each one (`local_attention.attend_within`)."""
    body = model.base_model if hasattr(model, "base_model") else model
    device = model.get_input_embeddings().weight.device
    cache = PrefixCache(num_layers)
    captured: dict[str, torch.Tensor] = {}
    hook = None
    if hidden_of is not None:
        if not 0 <= hidden_of < num_layers:
            raise ValueError(f"hidden_of must be one of the {num_layers} layers computed, got {hidden_of}")

        def keep_input(module, args, kwargs):
            captured["hidden"] = args[0] if args else kwargs["hidden_states"]

        hook = decoder_layers(model)[hidden_of].register_forward_pre_hook(keep_input, with_kwargs=True)
    try:
        with attend_within(model, window):
            body(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device) if attention_mask is not None else None,
                position_ids=position_ids.to(device),
                use_cache=True,
                **{cache_argument(body): cache},
            )
    except StopForward:
        pass
    finally:
        if hook is not None:
            hook.remove()
    kv = [(layer.keys, layer.values) for layer in cache.layers[:num_layers]]
    return (kv, captured["hidden"]) if hidden_of is not None else kv
