"""Transformers' SDPA attention without copies of the keys and values per query head on CPU.

With grouped-query attention (fewer key/value heads than query heads), transformers' `sdpa` attention repeats each
key/value head for its query heads (`repeat_kv`, a copy of the whole cache per layer) whenever a forward of several
tokens comes with a mask, on CPU too, where PyTorch's SDPA takes the grouping itself (`enable_gqa`). A transfer's
first forward is such a forward: its recomputed tokens attend to the whole transferred prompt under a causal mask.

`GROUPED_SDPA` is the same attention with the grouping left to PyTorch on CPU (the same kernel reads each key/value
head for its query heads; the numbers are those of `sdpa`), and transformers' own `sdpa` everywhere else. A
`TransferredCache` switches a target that uses `sdpa` on CPU to it when it meets the target (`prefer_grouped_sdpa`);
`AutoModelForCausalLM.from_pretrained(..., attn_implementation=GROUPED_SDPA)` chooses it at load.
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_SDPA = "kvtransfer_grouped_sdpa"


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """`AttentionInterface`'s signature: PyTorch's SDPA grouping the heads itself for a masked multi-token forward on
    CPU with fewer key/value heads than query heads; transformers' `sdpa_attention_forward` otherwise."""
    grouped = (
        query.device.type == "cpu" and attention_mask is not None and query.shape[2] > 1
        and query.shape[1] != key.shape[1] and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )  # fmt: skip
    if not grouped:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)  # fmt: skip
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=additive(attention_mask, query.dtype), dropout_p=dropout, scale=scaling,
        enable_gqa=True,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


# Boolean masks turned additive, by the mask object's id: a forward hands every layer the same mask, and its additive
# form is dropped when the mask is (a tensor's `==` is elementwise, so a WeakKeyDictionary cannot hold them).
_ADDITIVE: dict[int, torch.Tensor] = {}


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive one (0 / -inf) PyTorch's SDPA turns it into at each call, made once for the
    layers of a forward that share it; a float mask as it is."""
    if mask.dtype != torch.bool:
        return mask
    if torch.compiler.is_compiling():  # a compiled forward fuses the conversion; no state to trace
        return as_additive(mask, dtype)
    key = id(mask)
    made = _ADDITIVE.get(key)
    if made is None or made.dtype != dtype:
        if made is None:
            weakref.finalize(mask, _ADDITIVE.pop, key, None)
        made = _ADDITIVE[key] = as_additive(mask, dtype)
    return made


def as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the additive one SDPA adds to the scores: 0 where True, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # masks built as for SDPA


def prefer_grouped_sdpa(model: PreTrainedModel | None) -> None:
    """Switch `model` from transformers' `sdpa` to `GROUPED_SDPA` when it runs on CPU with grouped-query attention
    (the same numbers, without the per-head copies); any other model or attention is left as it is."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return
    text = config.get_text_config(decoder=True)
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if not heads or not kv_heads or heads == kv_heads:
        return
    can_switch = getattr(model, "_can_set_attn_implementation", lambda: False)()  # attention through the interface
    if can_switch and getattr(model, "device", None) == torch.device("cpu"):
        model.set_attn_implementation(GROUPED_SDPA)


__all__ = ["GROUPED_SDPA", "grouped_sdpa", "prefer_grouped_sdpa"]
