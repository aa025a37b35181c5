"""The windowed exact pass prototype (`research/content_at_speed/windowed_exact.py`): its blocked local attention is
the dense attention under a banded mask; inside it a whole-prompt forward of a model is that model under a banded
4D mask, a forward on a cache (the recomputed tokens) is untouched, and leaving it restores the model."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import random_ids, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "research" / "content_at_speed"))
windowed = pytest.importorskip("windowed_exact")


def _banded(n: int, window: int) -> torch.Tensor:
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= i) & (i - j < window)


@pytest.mark.parametrize("n,window,block", [(100, 16, None), (97, 32, None), (64, 64, None), (40, 8, None),
                                            (100, 16, 48), (97, 32, 40)])
def test_blocked_local_attention_is_dense_attention_under_a_band(n, window, block):
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(2, h, n, 8, generator=g) for h in (4, 2, 2))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2  # what transformers' SDPA path reads of a layer
    got, _ = windowed.local_attention(window, block)(module, q, k, v, None, scaling=0.3)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=_banded(n, window), scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_a_whole_prompt_forward_is_windowed_and_a_forward_on_a_cache_is_not():
    model = tiny_model("qwen3", num_hidden_layers=2, seed=3).eval()
    model.set_attn_implementation("sdpa")  # the reference below passes a 4D boolean mask, as SDPA reads it
    ids = random_ids(1, 50, seed=4)

    def prefix_cache():
        return model(ids[:, :40], use_cache=True).past_key_values

    with torch.no_grad():
        plain = model(ids).logits
        band = model(ids, attention_mask=_banded(50, 8)[None, None]).logits  # transformers' own path, a 4D mask
        tail = model(ids[:, 40:], cache=prefix_cache()).logits
        cached = prefix_cache()
        with windowed.local_exact_pass(model, 8):
            local = model(ids).logits
            # the recomputed tokens: fewer queries than keys, so they attend to every cached token as before
            local_tail = model(ids[:, 40:], cache=cached).logits
        with windowed.local_exact_pass(model, 64):  # a window longer than the prompt changes nothing
            long = model(ids).logits
    torch.testing.assert_close(local, band, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(local, plain, atol=1e-3)  # the window changed the whole-prompt forward
    torch.testing.assert_close(local_tail, tail, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(long, plain, rtol=1e-5, atol=1e-6)
    assert model.config._attn_implementation == "sdpa"  # restored
