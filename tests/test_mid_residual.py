"""research/content_at_speed/mid_residual.py: with its patches on, the exact pass and the calibration pass read the
residual stream after the last exact layer's attention (checked against a hooked forward of the whole target), the
exact layers' keys and values stay the target's own, and mappers not fit through it transfer exactly as without it."""

from pathlib import Path

import pytest
import torch

from conftest import load_script, random_ids, residual_pair
from hf_kvtransfer import TransferredCache
from hf_kvtransfer.core import cache as cache_module
from hf_kvtransfer.fitting import calibration_pass as calibration_module

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mid():
    return load_script(ROOT / "research/content_at_speed/mid_residual.py")


@pytest.fixture(scope="module")
def pair():
    """A tiny 2 -> 3-layer pair and its mapper reading the residual entering layer 1 (2 exact layers)."""
    source, target, ids, _, (mapper,) = residual_pair(residual_layers=(1,))
    return source, target, ids, mapper


def after_attention(model, ids, layer):
    """The target's own forward over `ids`: its cache and the input of layer `layer`'s post-attention norm."""
    seen = {}
    norm = model.model.layers[layer].post_attention_layernorm
    hook = norm.register_forward_pre_hook(lambda module, args: seen.setdefault("hidden", args[0]))
    try:
        with torch.no_grad():
            out = model(ids, use_cache=True)
    finally:
        hook.remove()
    return out.past_key_values, seen["hidden"]


def test_the_exact_pass_stops_after_the_attention_with_the_targets_own_kv(mid, pair):
    _, target, _, _ = pair
    ids = random_ids(2, 30, seed=3)
    positions = torch.arange(30).expand(2, -1)
    own_cache, hidden = after_attention(target, ids, layer=1)
    with mid.patched(fit=True):
        kv, got = cache_module.own_prefix(target, ids, None, positions, 2, hidden_of=1)
    torch.testing.assert_close(got, hidden)
    assert len(kv) == 2
    for layer, (keys, values) in enumerate(kv):
        torch.testing.assert_close(keys, own_cache.layers[layer].keys)
        torch.testing.assert_close(values, own_cache.layers[layer].values)


def test_the_calibration_pass_captures_the_same_stream(mid, pair):
    _, target, _, _ = pair
    ids = random_ids(2, 30, seed=4)
    _, hidden = after_attention(target, ids, layer=1)
    with mid.patched(fit=True):
        _, _, captured, _ = calibration_module.capture_kv_and_inputs(target, ids, hidden_layers=(1,))
    torch.testing.assert_close(captured[1], hidden.float())


def logits(source, target, mapper, ids):
    from hf_kvtransfer import prefill

    with torch.no_grad():
        cache = TransferredCache(prefill(source, ids), mapper, model=target, input_ids=ids, num_recompute_tokens=4)
        return target(ids[:, -4:], cache=cache).logits


def test_only_marked_mappers_read_after_the_attention(mid, pair):
    source, target, _, mapper = pair
    ids = random_ids(1, 24, seed=6)
    plain = logits(source, target, mapper, ids)
    with mid.patched(fit=False):
        unmarked = logits(source, target, mapper, ids)
        mapper.mid_residual = True
        try:
            marked = logits(source, target, mapper, ids)
        finally:
            del mapper.mid_residual
    torch.testing.assert_close(unmarked, plain, rtol=0, atol=0)
    assert not torch.allclose(marked, plain)  # the patch reaches the transfer's exact pass
    assert cache_module.own_prefix is mid._own_prefix  # restored on leaving
