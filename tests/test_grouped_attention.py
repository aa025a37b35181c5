"""`core/grouped_attention.py`: transformers' SDPA attention with the head grouping left to PyTorch on CPU. Checked
against transformers' own `sdpa_attention_forward` (which repeats the key/value heads) and against the target's own
forward; a transfer switches only a CPU target using `sdpa` with grouped heads."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from conftest import exact_identity_mapper, left_pad, random_ids, tiny_model
from hf_kvtransfer import TransferredCache, prefill
from hf_kvtransfer.core import cache as cache_module
from hf_kvtransfer.core.grouped_attention import GROUPED_SDPA, grouped_sdpa, prefer_grouped_sdpa


def _layer(groups: int):
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, groups  # what transformers' SDPA path reads of a layer
    return module


def _mask(kind: str, batch: int, q_len: int, kv_len: int, g: torch.Generator) -> torch.Tensor | None:
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None].expand(batch, 1, -1, -1)
    if kind == "causal":
        return causal
    if kind == "padded":  # each row's first keys are padding
        keys = torch.arange(kv_len)[None, :] >= torch.randint(0, kv_len - q_len, (batch, 1), generator=g)
        return causal & keys[:, None, None, :]
    if kind == "additive":
        return torch.zeros(batch, 1, q_len, kv_len).masked_fill(~causal, float("-inf")) + torch.randn(
            batch, 1, q_len, kv_len, generator=g)  # fmt: skip
    return None


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["causal", "padded", "additive", "none"])
def test_grouped_sdpa_gives_transformers_sdpa_numbers(seed, kind):
    g = torch.Generator().manual_seed(seed)
    kv_heads, groups = (1, 2, 4)[seed % 3], (2, 3, 4)[seed % 3]
    batch, q_len = 1 + seed % 2, int(torch.randint(1, 12, (1,), generator=g))
    kv_len = q_len + int(torch.randint(0, 40, (1,), generator=g))
    q = torch.randn(batch, kv_heads * groups, q_len, 16, generator=g)
    k, v = (torch.randn(batch, kv_heads, kv_len, 16, generator=g) for _ in "kv")
    mask = _mask(kind, batch, q_len, kv_len, g)
    got, _ = grouped_sdpa(_layer(groups), q, k, v, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(_layer(groups), q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _sdpa_model():
    model = tiny_model("qwen3", num_hidden_layers=3, seed=11)  # 4 query heads, 2 key/value heads
    model.set_attn_implementation("sdpa")
    return model


def test_a_transfer_switches_a_cpu_sdpa_target_and_answers_as_its_own_prefill():
    model = _sdpa_model()
    ids, mask = left_pad(random_ids(2, 30, seed=3), [30, 21])
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=6, min_new_tokens=6)
    own = model.generate(ids, **kw)
    assert model.config._attn_implementation == "sdpa"
    cache = TransferredCache(prefill(model, ids, attention_mask=mask), exact_identity_mapper(model), attention_mask=mask,
                             num_recompute_tokens=8, model=model)  # fmt: skip
    out = model.generate(ids, cache=cache, **kw)
    assert model.config._attn_implementation == GROUPED_SDPA
    assert torch.equal(out, own)


def test_the_recomputed_tokens_forward_is_the_same_with_either_attention(monkeypatch):
    model = _sdpa_model()
    ids, mask = left_pad(random_ids(2, 40, seed=4), [40, 33])

    def last_logits():
        cache = TransferredCache(prefill(model, ids, attention_mask=mask), exact_identity_mapper(model),
                                 attention_mask=mask, num_recompute_tokens=12, model=model)  # fmt: skip
        with torch.no_grad():
            return model(ids[:, -12:], attention_mask=mask, cache=cache).logits

    monkeypatch.setattr(cache_module, "prefer_grouped_sdpa", lambda model: None)
    stock = last_logits()
    assert model.config._attn_implementation == "sdpa"
    monkeypatch.undo()
    grouped = last_logits()
    assert model.config._attn_implementation == GROUPED_SDPA
    torch.testing.assert_close(grouped, stock, rtol=1e-5, atol=1e-5)


def test_other_attentions_and_models_are_left_as_they_are():
    eager = tiny_model("qwen3", num_hidden_layers=2)
    prefer_grouped_sdpa(eager)
    assert eager.config._attn_implementation == "eager"
    one_per_head = tiny_model("qwen3", num_hidden_layers=2, num_key_value_heads=4)  # no grouping: nothing to save
    one_per_head.set_attn_implementation("sdpa")
    prefer_grouped_sdpa(one_per_head)
    assert one_per_head.config._attn_implementation == "sdpa"
    prefer_grouped_sdpa(None)  # a cache that never met its target


def test_a_model_can_be_loaded_with_it(tmp_path):
    import hf_kvtransfer
    from transformers import AutoModelForCausalLM

    _sdpa_model().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=hf_kvtransfer.GROUPED_SDPA)
    assert model.config._attn_implementation == GROUPED_SDPA


def test_a_mask_is_made_additive_once_and_dropped_with_it():
    from hf_kvtransfer.core import grouped_attention

    mask = torch.rand(2, 1, 3, 7, generator=torch.Generator().manual_seed(0)) > 0.4
    made = grouped_attention.additive(mask, torch.float32)
    assert grouped_attention.additive(mask, torch.float32) is made  # the layers of one forward share it
    want = torch.where(mask, 0.0, float("-inf"))
    assert torch.equal(made, want)
    assert grouped_attention.additive(made, torch.float32) is made  # an additive mask is used as it is
    key = id(mask)
    del mask
    assert key not in grouped_attention._ADDITIVE  # held no longer than the mask


@pytest.mark.slow
def test_it_compiles():
    # A compiled target traces the attention: the mask's additive form is made in the graph, with no state to guard.
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 5, 16, generator=g), *(torch.randn(1, 2, 9, 16, generator=g) for _ in "kv")
    mask = _mask("causal", 1, 5, 9, g)
    want, _ = sdpa_attention_forward(_layer(2), q, k, v, mask, scaling=0.25)
    got, _ = torch.compile(grouped_sdpa)(_layer(2), q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
