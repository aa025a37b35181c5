"""The exact pass over a local window: the target's exact layers attend, over the transferred prompt, only to the
`window` tokens up to each one (`MapperConfig.exact_window`, chosen by the fit's content gate).

At long prompts most of an exact layer's work is its attention over the whole prompt; within a window it grows with
prompt x window instead of prompt^2. What the context says still reaches the target: the mapped layers carry it, and
the recomputed tokens (the prompt's last ones) attend to every earlier token in every layer. Whether a window keeps
the content is measured by the fit (`fitting/exact_window.py`), not assumed.

The window is an attention function registered with transformers (`AttentionInterface`, with SDPA's mask builder):
`attend_within(model, window)` routes the model's attention to it for the duration of the exact pass and restores the
model's own after. It applies to a forward whose queries are its keys (a prefill, as the exact pass is) and leaves any
other forward plain SDPA. While inside, the model object must not run forwards in another thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .grouped_attention import as_additive


def _band(start: int, stop: int, first: int, window: int, device) -> torch.Tensor:
    """`[stop - start, stop - first]`: query i (from `start`) sees key j (from `first`) when 0 <= i - j < window."""
    i = torch.arange(start, stop, device=device)[:, None]
    j = torch.arange(first, stop, device=device)[None, :]
    return (j <= i) & (i - j < window)


def local_attention(window: int):
    """An attention function (`AttentionInterface`'s signature) in which each query of a prefill sees only the
    `window` keys up to itself (and what the model's mask allows: padding, its own sliding window), computed in
    blocks of `ceil(window / 2)` queries against the `window - 1` keys before the block and the block's own."""
    if window < 1:
        raise ValueError(f"the exact pass's window must be >= 1 token, got {window}")
    # Half-window blocks: each query's window fills 2/3 of the keys a block reads (1/2 with blocks of `window`), for
    # twice the calls; on CPU that is the faster side. Blocks past the first window share one band, built once.
    block = (window + 1) // 2

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        n = query.shape[2]
        if n != key.shape[2] or n <= window:  # not a prefill, or one the window covers: unchanged
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                          **kwargs)  # fmt: skip
        out = torch.empty_like(query)
        interior = _band(window - 1, window - 1 + block, 0, window, query.device)  # a block whose keys start > 0
        if attention_mask is None:  # additive once, not at each block's call (SDPA turns a boolean mask so)
            interior = as_additive(interior, query.dtype)
        for start in range(0, n, block):
            stop, first = min(n, start + block), max(0, start - window + 1)
            if first > 0:
                mask = interior[: stop - start, : stop - first]
            else:
                mask = _band(start, stop, first, window, query.device)
            if attention_mask is not None:
                mask = mask & attention_mask[..., start:stop, first:stop].to(torch.bool)
                # A padding query that sees nothing in its window sees itself: finite, and read by no real token.
                mask = mask | (~mask.any(-1, keepdim=True) & _band(start, stop, first, 1, query.device))
            out[:, :, start:stop] = F.scaled_dot_product_attention(
                query[:, :, start:stop], key[:, :, first:stop], value[:, :, first:stop], attn_mask=mask,
                scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
            )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None

    return attend


def _registered(window: int) -> str:
    name = f"kvtransfer_window_{window}"
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, local_attention(window))
        AttentionMaskInterface.register(name, sdpa_mask)  # masks built as for SDPA
    return name


@contextlib.contextmanager
def attend_within(model: PreTrainedModel, window: int | None) -> Iterator[None]:
    """While inside, `model`'s prefills attend within `window` tokens (None: unchanged)."""
    if window is None:
        yield
        return
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = _registered(int(window))
    try:
        yield
    finally:
        config._attn_implementation = before


def causal_pairs(seq_len: int, window: int | None = None) -> int:
    """Query-key pairs of causal attention over `seq_len` tokens, each query seeing at most `window` keys (None: all
    up to itself): `sum_i min(i, window)` for i = 1..seq_len."""
    if window is None or window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    return window * (window + 1) // 2 + (seq_len - window) * window


__all__ = ["attend_within", "causal_pairs", "local_attention"]
