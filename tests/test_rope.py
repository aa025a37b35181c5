"""RoPE strip / re-apply against the pre-RoPE keys hooked out of the attention modules themselves."""

import importlib

import pytest
import torch

from rope_reference import apply_rope
from conftest import ARCHITECTURES, left_pad, random_ids, tiny_model
from hf_kvtransfer import prefill
from hf_kvtransfer.core.rope import (
    build_rotary_embedding,
    config_from_dict,
    position_ids_from_mask,
    rotary_cos_sin,
    rotate_,
    rotate_into,
    strip_rope,
)


def _hook_pre_rope_keys(model, monkeypatch):
    """Record the key states each attention layer passes into `apply_rotary_pos_emb` (i.e. before RoPE)."""
    module = importlib.import_module(type(model).__module__)
    original = module.apply_rotary_pos_emb
    captured = []

    def recording(q, k, cos, sin, *args, **kwargs):
        captured.append(k.detach().clone())
        return original(q, k, cos, sin, *args, **kwargs)

    monkeypatch.setattr(module, "apply_rotary_pos_emb", recording)
    return captured


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_strip_matches_hooked_pre_rope_keys_with_left_padding(arch, monkeypatch):
    model = tiny_model(arch, num_hidden_layers=2)
    ids, mask = left_pad(random_ids(3, 40, seed=1), [40, 31, 17])
    captured = _hook_pre_rope_keys(model, monkeypatch)
    cache = prefill(model, ids, attention_mask=mask)
    assert len(captured) == model.config.num_hidden_layers

    # Rebuilt from the config dict alone, as the target process does (no model object).
    rotary = build_rotary_embedding(config_from_dict(model.config.to_dict()))
    position_ids = position_ids_from_mask(mask, 3, 40, ids.device)
    cos, sin = rotary_cos_sin(rotary, position_ids, ids.device)
    real = mask.bool()
    for layer_idx, pre_rope in enumerate(captured):
        cached = cache.layers[layer_idx].keys
        stripped = strip_rope(cached, cos, sin)
        err = (stripped - pre_rope).abs().amax(dim=(1, 3))[real].max().item()
        assert err < 1e-5, f"{arch} layer {layer_idx}: strip error {err}"
        reapplied = apply_rope(stripped, cos, sin)
        assert (reapplied - cached).abs().amax(dim=(1, 3))[real].max().item() < 1e-5


def test_attention_scaling_is_removed_by_strip():
    # yarn scales cos/sin by a != 1: a plain inverse rotation would leave keys scaled by a^2.
    model = tiny_model("yarn")
    rotary = build_rotary_embedding(model.config)
    assert abs(rotary.attention_scaling - 1.0) > 0.05
    k = torch.randn(1, 2, 9, 16)
    cos, sin = rotary_cos_sin(rotary, torch.arange(9).unsqueeze(0), k.device)
    assert torch.allclose(strip_rope(apply_rope(k, cos, sin), cos, sin), k, atol=1e-5)


def test_partial_rotary_leaves_pass_through_dims_untouched():
    model = tiny_model("phi3-partial")
    rotary = build_rotary_embedding(model.config)
    k = torch.randn(2, 2, 5, 16)
    cos, sin = rotary_cos_sin(rotary, torch.arange(5).unsqueeze(0).expand(2, -1), k.device)
    assert cos.shape[-1] == 8
    rotated = apply_rope(k, cos, sin)
    assert torch.equal(rotated[..., 8:], k[..., 8:])
    assert not torch.allclose(rotated[..., :8], k[..., :8])


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        build_rotary_embedding(GPT2Config())


def test_mapper_rotary_is_built_once_matches_the_target_and_is_never_moved(identity_mapper, qwen3_model):
    rotary = identity_mapper.rotary("target")
    assert identity_mapper.target_rotary() is rotary and identity_mapper.rotary("target", "cpu") is rotary
    # The same cos/sin as the model's own rotary module (the one its attention uses), from the stored config alone.
    positions = torch.arange(23).unsqueeze(0)
    probe = torch.empty(0, dtype=torch.float32)
    own_cos, own_sin = qwen3_model.model.rotary_emb(probe, positions)
    cos, sin = rotary_cos_sin(rotary, positions, probe.device)
    assert torch.allclose(cos[:, 0], own_cos) and torch.allclose(sin[:, 0], own_sin)
    # Tables on another device come from a copy: the module every cache of this mapper shares stays where it is.
    cos, _ = rotary_cos_sin(rotary, positions, torch.device("meta"))
    assert cos.device.type == "meta" and next(rotary.buffers()).device.type == "cpu"
    with pytest.raises(ValueError, match="'source' or 'target'"):
        identity_mapper.rotary("strip")


@pytest.mark.parametrize("rotary_dim,head_dim", [(16, 16), (8, 16), (32, 64)])
def test_rotate_in_place_is_the_attention_modules_rope(rotary_dim, head_dim):
    g = torch.Generator().manual_seed(rotary_dim + head_dim)
    x = torch.randn(2, 7, 3, 2, head_dim, generator=g)
    cos, sin = (torch.randn(2, 7, 1, 1, rotary_dim, generator=g) for _ in "cs")
    want = apply_rope(x, cos, sin)
    out = x.clone()
    assert rotate_(out, cos, sin) is out
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rotate_into(x, cos, sin, torch.empty_like(x)), want, rtol=1e-5, atol=1e-6)
