"""FLOPs (2 x multiply-adds) of what a transfer and the target's own prefill compute, batch 1, counted from the
shapes: a decoder's forward (`prefill_flops`), the exact layers a transfer computes (`exact_layers_flops`), the
maps of the other layers with what their inputs add (`mapping_flops`), and a saved mapper's whole first token at its
defaults (`mapper_first_token`). One count for every surface: `hf-kvtransfer bench` reports it, `plan` and `info`
predict with it, and the fit orders the configurations that keep the content by it and says when the one it keeps
saves little.
Tests check each against torch's FLOP counter."""

from __future__ import annotations

from .conversion import conversion_groups
from .local_attention import causal_pairs
from .map_inputs import map_inputs_of
from .mapper import KVMapper
from .rope import head_dim_of, text_config


def prefill_flops(
    config, seq_len: int, logits: bool = False, *, num_layers: int | None = None, context_len: int = 0,
    window: int | None = None,
) -> dict[str, int]:
    """FLOPs (2 x multiply-adds) of a decoder's forward of `seq_len` tokens, batch 1.

    Args:
        num_layers: only the first this many decoder layers (the exact layers a transfer computes); default all.
        context_len: tokens already in the cache that the `seq_len` new ones attend to (the recomputed tokens of a
            transfer attend to the transferred prompt); 0 is a prefill.
        window: each new token attends to at most this many of them (the exact pass over a local window,
            `local_attention.py`); None: all up to itself.

    Returns `{"projections": ..., "attention": ..., "lm_head": ..., "total": ...}`; attention counts the causal
    half of QK^T and AV over the new tokens (what a fused kernel can skip) and every cached position, projections
    cover q/k/v/o and a gated MLP.
    """
    config = text_config(config)
    hidden = config.hidden_size
    layers = config.num_hidden_layers if num_layers is None else num_layers
    head_dim = head_dim_of(config)
    q_dim, kv_dim = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_token_layer = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * config.intermediate_size
    projections = 2 * seq_len * layers * per_token_layer
    # QK^T and AV: each new token attends to the cached context and, causally, to the new tokens up to itself
    # (sum_i i ~ T^2 / 2 pairs); each pair is 2 * q_dim multiply-adds.
    pairs = seq_len * context_len + causal_pairs(seq_len, window)
    attention = 2 * layers * 2 * q_dim * pairs
    lm_head = 2 * seq_len * hidden * config.vocab_size if logits else 0
    return {"projections": projections, "attention": attention, "lm_head": lm_head,
            "total": projections + attention + lm_head}  # fmt: skip


def exact_layers_flops(config, seq_len: int, num_exact_layers: int, window: int | None = None) -> int:
    """FLOPs of the target computing the keys and values of its first `num_exact_layers` layers for `seq_len` tokens,
    batch 1, as `TransferredCache` does: its forward stops at the last exact layer's cache update, so that layer
    costs only its q/k/v projections (the query is projected before the update) and the layers before it a prefill's
    share (`prefill_flops(num_layers=...)`, their attention within `window` tokens when the pass is windowed)."""
    if num_exact_layers == 0:
        return 0
    config = text_config(config)
    head_dim = head_dim_of(config)
    q_dim, kv_dim = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    last = 2 * seq_len * config.hidden_size * (q_dim + 2 * kv_dim)
    return prefill_flops(config, seq_len, num_layers=num_exact_layers - 1, window=window)["total"] + last


def mapping_flops(mapper: KVMapper, seq_len: int, num_exact_layers: int = 0) -> int:
    """FLOPs of mapping `seq_len` tokens through the target layers after the first `num_exact_layers` (keys and
    values), batch 1, as `TransferredCache` computes them (`conversion.conversion_groups`): affine maps cost their
    dense or factored multiply-adds as they are taken (a dense reduced-rank map includes forming `up @ down`);
    nonlinear maps one multiply-add per weight (not bias) and token; and what each map input adds on those layers
    (`MapInput.transfer_flops`, e.g. the maps of the target's residual stream)."""
    total = 0
    for group, dense in conversion_groups(mapper, seq_len, num_exact_layers):
        for t in group:
            layer = mapper.layers[t]
            parts = [layer.linear_parts(kind) for kind in ("key", "value")]
            if any(p is None for p in parts):
                total += seq_len * sum(p.numel() for name, p in layer.named_parameters() if not name.endswith("bias"))
            else:
                total += sum(p.macs(seq_len, dense) for p in parts)
    mapped = set(range(num_exact_layers, len(mapper.layers)))
    return 2 * total + sum(inp.transfer_flops(seq_len, mapped) for inp in map_inputs_of(mapper))


def first_token_parts(
    target_config, mapper: KVMapper, seq_len: int, *, num_exact_layers: int, num_recompute_tokens: int,
    exact_window: int | None = None,
) -> dict[str, int]:
    """FLOPs to the target's first token for a `seq_len`-token prompt whose source cache is at hand, batch 1, by
    part, as `TransferredCache` computes it with `mapper` (its map inputs counted in its maps): the target's first
    `num_exact_layers` layers over the transferred tokens (`seq_len - num_recompute_tokens`; within `exact_window`
    tokens when given), the maps of the other layers over them, and the last `num_recompute_tokens` tokens through
    every layer, attending to the rest; beside it the target's own prefill. Transformer bodies (no LM head).

    Returns:
        `{"own_prefill", "exact_layers", "mapping", "map_inputs", "recompute", "total"}` (total: the transfer;
        `map_inputs` 0: what a planning mapper's inputs would add is the plan's, `commands.plan.first_token_flops`).
    """
    layers = text_config(target_config).num_hidden_layers
    if not 0 <= num_exact_layers <= layers:
        raise ValueError(f"num_exact_layers must be in [0, {layers}] (the target's layers), got {num_exact_layers}")
    if not 1 <= num_recompute_tokens <= seq_len:
        raise ValueError(f"num_recompute_tokens must be in [1, {seq_len}] (the prompt), got {num_recompute_tokens}")
    transferred = seq_len - num_recompute_tokens
    parts = {
        "own_prefill": prefill_flops(target_config, seq_len)["total"],
        "exact_layers": exact_layers_flops(target_config, transferred, num_exact_layers, window=exact_window),
        "mapping": mapping_flops(mapper, transferred, num_exact_layers),
        "map_inputs": 0,
        "recompute": prefill_flops(target_config, num_recompute_tokens, context_len=transferred)["total"],
    }
    parts["total"] = parts["exact_layers"] + parts["mapping"] + parts["recompute"]
    return parts


def mapper_first_token(mapper: KVMapper, lengths: tuple[int, ...] = (1024, 4096),
                       num_recompute_tokens: int | None = None) -> dict[int, dict[str, int]]:  # fmt: skip
    """`first_token_parts` of a saved mapper at its defaults (`defaults.resolve_transfer`: its exact layers and window,
    the cache's recomputed tokens unless `num_recompute_tokens` says otherwise) for prompts of each length, by length:
    what its arithmetic allows, from its config and weights alone (the target's config is the one the mapper
    stores)."""
    from .defaults import resolve_transfer
    from .rope import config_from_dict

    target = config_from_dict(mapper.config.target_config)
    out = {}
    for n in lengths:
        at = resolve_transfer(mapper, n, num_recompute_tokens=num_recompute_tokens)
        out[n] = first_token_parts(target, mapper, n, num_exact_layers=at.num_exact_layers,
                                   num_recompute_tokens=at.num_recompute_tokens, exact_window=at.exact_window)  # fmt: skip
    return out


__all__ = ["exact_layers_flops", "first_token_parts", "mapper_first_token", "mapping_flops", "prefill_flops"]
