"""TransferredCache inside stock `generate`, compared with the target's own prefill (an independent path)."""

import copy

import pytest
import torch
from transformers import DynamicCache

from conftest import ARCHITECTURES, exact_identity_mapper, left_pad, random_ids, tiny_model
from hf_kvtransfer import TransferredCache, prefill

@pytest.fixture(params=["per_layer", "grouped"])
def mapper(request, identity_mapper, grouped_identity_mapper):
    """The same identity map through the per-layer path (each layer reads its own source layer) and the grouped
    path (every layer reads all source layers: one product for all layers)."""
    return identity_mapper if request.param == "per_layer" else grouped_identity_mapper


GEN = dict(max_new_tokens=10, min_new_tokens=10, return_dict_in_generate=True, output_logits=True)


def _max_logit_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))


def test_greedy_single_prompt_matches_target_prefill(qwen3_model, mapper):
    ids = random_ids(1, 24, seed=2)
    ref = qwen3_model.generate(ids, do_sample=False, **GEN)
    cache = TransferredCache(prefill(qwen3_model, ids), mapper, num_recompute_tokens=1, model=qwen3_model)
    assert cache.num_pending_layers == 3  # nothing converted before generate
    out = qwen3_model.generate(ids, cache=cache, do_sample=False, **GEN)
    assert cache.num_pending_layers == 0
    assert len(set(ref.sequences[0, 24:].tolist())) > 2, "degenerate test model"
    assert torch.equal(out.sequences, ref.sequences)
    assert _max_logit_diff(out, ref) < 1e-4


def test_past_key_values_name_still_works(qwen3_model, identity_mapper):
    ids = random_ids(1, 16, seed=3)
    ref = qwen3_model.generate(ids, do_sample=False, max_new_tokens=6)
    with pytest.warns(Warning):  # transformers' deprecation of the old name
        out = qwen3_model.generate(
            ids, past_key_values=TransferredCache(prefill(qwen3_model, ids), identity_mapper, model=qwen3_model), do_sample=False,
            max_new_tokens=6,
        )
    assert torch.equal(out, ref)


def test_options_object_and_keywords_are_the_same_transfer(qwen3_model, identity_mapper):
    """`TransferOptions` or its fields as keywords (which override it); an unknown option is one line."""
    from hf_kvtransfer.core.cache import TransferOptions

    ids = random_ids(1, 16, seed=3)
    source_cache = prefill(qwen3_model, ids)
    caches = [TransferredCache(source_cache, identity_mapper, options=TransferOptions(num_exact_layers=2, gate=False)),
              TransferredCache(source_cache, identity_mapper, num_exact_layers=2, gate=False),
              TransferredCache(source_cache, identity_mapper, options=TransferOptions(num_exact_layers=0), num_exact_layers=2)]
    for cache in caches:
        assert cache.num_exact_layers == 2 and cache.transfer_status.threshold is None
    with pytest.raises(TypeError, match=r"TransferredCache\(\) got unknown option\(s\) num_exact_layer\b"):
        TransferredCache(source_cache, identity_mapper, num_exact_layer=2)


def test_left_padded_batch(qwen3_model, mapper):
    ids, mask = left_pad(random_ids(3, 28, seed=4), [28, 19, 9])
    ref = qwen3_model.generate(ids, attention_mask=mask, do_sample=False, **GEN)
    cache = TransferredCache(prefill(qwen3_model, ids, attention_mask=mask), mapper, attention_mask=mask, num_recompute_tokens=1, model=qwen3_model)
    out = qwen3_model.generate(ids, attention_mask=mask, cache=cache, do_sample=False, **GEN)
    assert torch.equal(out.sequences, ref.sequences)
    assert _max_logit_diff(out, ref) < 1e-4


def test_left_padding_without_mask_in_prefill_is_refused_before_output(qwen3_model, identity_mapper):
    # The mask matters: a source cache built without it holds the pads at other positions (and attended by the
    # real tokens), so the target given the mask would answer differently from its own run: refused, not answered.
    ids, mask = left_pad(random_ids(2, 20, seed=4), [20, 8])
    cache = TransferredCache(prefill(qwen3_model, ids), identity_mapper, num_recompute_tokens=1, model=qwen3_model)
    with pytest.raises(ValueError, match="pass the same attention_mask to `prefill` as to the target"):
        qwen3_model.generate(ids, attention_mask=mask, cache=cache, do_sample=False, **GEN)
    with pytest.raises(ValueError, match="differs from the mask the source cache was built with"):
        TransferredCache(prefill(qwen3_model, ids), identity_mapper, attention_mask=mask)


def test_mask_given_to_prefill_and_generate_only_is_the_targets_own(qwen3_model, identity_mapper):
    # issue 23: the mask reached prefill and generate but not TransferredCache; prefill records it on its cache.
    ids, mask = left_pad(random_ids(2, 20, seed=4), [20, 8])
    ref = qwen3_model.generate(ids, attention_mask=mask, do_sample=False, **GEN)
    cache = TransferredCache(prefill(qwen3_model, ids, attention_mask=mask), identity_mapper, num_recompute_tokens=1, model=qwen3_model)
    out = qwen3_model.generate(ids, attention_mask=mask, cache=cache, do_sample=False, **GEN)
    assert torch.equal(out.sequences, ref.sequences) and _max_logit_diff(out, ref) < 1e-3


def test_beam_search_expands_lazily(qwen3_model, mapper):
    ids = random_ids(1, 20, seed=5)
    kw = dict(num_beams=2, num_return_sequences=2, do_sample=False, max_new_tokens=8, min_new_tokens=8)
    ref = qwen3_model.generate(ids, **kw)
    out = qwen3_model.generate(ids, cache=TransferredCache(prefill(qwen3_model, ids), mapper, model=qwen3_model), **kw)
    assert torch.equal(out, ref)


def test_seeded_sampling(qwen3_model, mapper):
    ids = random_ids(2, 18, seed=6)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=10, min_new_tokens=10)
    torch.manual_seed(11)
    ref = qwen3_model.generate(ids, **kw)
    torch.manual_seed(11)
    out = qwen3_model.generate(ids, cache=TransferredCache(prefill(qwen3_model, ids), mapper, model=qwen3_model), **kw)
    assert torch.equal(out, ref)


def test_second_turn_on_same_cache(qwen3_model, mapper):
    ids = random_ids(1, 20, seed=7)
    own = DynamicCache(config=qwen3_model.config)
    ref1 = qwen3_model.generate(ids, cache=own, do_sample=False, max_new_tokens=6, min_new_tokens=6)
    turn2 = torch.cat([ref1, random_ids(1, 7, seed=8)], dim=1)
    ref2 = qwen3_model.generate(turn2, cache=own, do_sample=False, **GEN)

    cache = TransferredCache(prefill(qwen3_model, ids), mapper, num_recompute_tokens=1, model=qwen3_model)
    out1 = qwen3_model.generate(ids, cache=cache, do_sample=False, max_new_tokens=6, min_new_tokens=6)
    assert torch.equal(out1, ref1)
    out2 = qwen3_model.generate(turn2, cache=cache, do_sample=False, **GEN)
    assert torch.equal(out2.sequences, ref2.sequences)
    assert _max_logit_diff(out2, ref2) < 1e-4


@pytest.mark.parametrize("num_recompute_tokens", [1, 4])
def test_recompute_tokens_only_new_tokens_fed(qwen3_model, identity_mapper, num_recompute_tokens):
    ids = random_ids(1, 16, seed=9)
    cache = TransferredCache(prefill(qwen3_model, ids), identity_mapper, num_recompute_tokens=num_recompute_tokens, model=qwen3_model)
    assert cache.get_seq_length() == 16 - num_recompute_tokens
    with torch.no_grad():
        logits = qwen3_model(ids[:, 16 - num_recompute_tokens :], cache=cache).logits
        ref = qwen3_model(ids).logits[:, -num_recompute_tokens:]
    assert (logits - ref).abs().max().item() < 1e-4
    assert cache.get_seq_length() == 16


def test_refeeding_whole_prompt_without_recompute_warns(qwen3_model, identity_mapper):
    ids = random_ids(1, 12, seed=10)
    cache = TransferredCache(prefill(qwen3_model, ids), identity_mapper, num_recompute_tokens=0, model=qwen3_model)
    with pytest.warns(UserWarning, match="num_recompute_tokens"):
        qwen3_model.generate(ids, cache=cache, do_sample=False, max_new_tokens=2)


def test_cache_operations_before_conversion(qwen3_model, mapper):
    ids = random_ids(2, 20, seed=12)
    src = prefill(qwen3_model, ids)
    src_keys = [layer.keys.clone() for layer in src.layers]

    # crop before conversion == transferring the shorter prompt
    cache = TransferredCache(src, mapper, num_recompute_tokens=1, model=qwen3_model)
    cache.crop(-5)
    assert cache.get_seq_length() == 14
    with torch.no_grad():
        out = qwen3_model(ids[:, 14:16], cache=cache).logits
        ref = qwen3_model(ids[:, :16]).logits[:, 14:16]
    assert (out - ref).abs().max().item() < 1e-4

    # batch_select + repeat before conversion, then reorder
    cache = TransferredCache(src, mapper, num_recompute_tokens=1, model=qwen3_model)
    cache.batch_select_indices(torch.tensor([1]))
    cache.batch_repeat_interleave(2)
    cache.reorder_cache(torch.tensor([1, 0]))
    with torch.no_grad():
        out = qwen3_model(ids[[1, 1], 19:], cache=cache).logits
        ref = qwen3_model(ids[[1]]).logits[:, -1:]
    assert (out - ref).abs().max().item() < 1e-4

    # the caller's source cache was never modified
    assert all(torch.equal(layer.keys, k) for layer, k in zip(src.layers, src_keys))


def test_cache_operations_after_conversion(qwen3_model, identity_mapper):
    ids = random_ids(1, 20, seed=13)
    cache = TransferredCache(prefill(qwen3_model, ids), identity_mapper, num_recompute_tokens=1, model=qwen3_model)
    own = DynamicCache(config=qwen3_model.config)
    with torch.no_grad():
        qwen3_model(ids[:, 19:], cache=cache)
        qwen3_model(ids, cache=own)
    for c in (cache, own):
        c.crop(-3)
        c.batch_repeat_interleave(2)
    for a, b in zip(cache.layers, own.layers):
        assert a.keys.shape == b.keys.shape
        assert (a.keys - b.keys).abs().max() < 1e-4


def test_source_layers_released_and_deepcopy_shares_mapper(qwen3_model, mapper):
    ids = random_ids(1, 10, seed=14)
    source_cache = prefill(qwen3_model, ids)
    cache = TransferredCache(source_cache, mapper, num_recompute_tokens=1, model=qwen3_model)
    clone = copy.deepcopy(cache)
    assert clone.mapper is cache.mapper
    source_bytes = sum(t.nbytes for layer in source_cache.layers for t in (layer.keys, layer.values))
    assert 0 < cache.pending_nbytes <= source_bytes  # views of the caller's source tensors, no copies yet
    with torch.no_grad():
        qwen3_model(ids[:, 9:], cache=cache)
    assert cache.num_pending_layers == 0 and cache.pending_nbytes == 0  # source layers and buffers released
    assert clone.num_pending_layers == 3  # the copy is independent


def test_dtype_and_device_follow_key_states(qwen3_model, identity_mapper):
    ids = random_ids(1, 12, seed=15)
    cache = TransferredCache(prefill(qwen3_model, ids), identity_mapper, num_recompute_tokens=1, model=qwen3_model)
    cache.convert_all(dtype=torch.bfloat16)
    assert all(layer.keys.dtype == torch.bfloat16 for layer in cache.layers)


def test_errors_for_wrong_source_cache(qwen3_model, identity_mapper):
    from conftest import tiny_model

    ids = random_ids(1, 10, seed=16)
    other = tiny_model("qwen3", num_hidden_layers=2)
    with pytest.raises(ValueError, match="num_hidden_layers: mapper has 3, model has 2"):
        TransferredCache(prefill(other, ids), identity_mapper)
    legacy = tuple((layer.keys, layer.values) for layer in prefill(other, ids).layers)  # no config attached
    with pytest.raises(ValueError, match="source cache has 2 layers"):
        TransferredCache(legacy, identity_mapper)
    wide = tiny_model("qwen3", num_hidden_layers=3, num_key_value_heads=4)
    legacy = tuple((layer.keys, layer.values) for layer in prefill(wide, ids).layers)
    with pytest.raises(ValueError, match=r"expects \[batch, 2, seq, 16\]"):
        TransferredCache(legacy, identity_mapper)
    rope_changed = tiny_model("qwen3", num_hidden_layers=3, rope_parameters={"rope_type": "default", "rope_theta": 50.0})
    with pytest.warns(UserWarning, match="fit for another source model"):
        TransferredCache(prefill(rope_changed, ids), identity_mapper)
    with pytest.raises(ValueError, match="rope_parameters"):
        TransferredCache(prefill(rope_changed, ids), identity_mapper, strict=True)
    with pytest.raises(TypeError, match="source_cache must be"):
        TransferredCache("not a cache", identity_mapper)
    bad = prefill(qwen3_model, ids)
    bad.layers[0].keys[0, 0, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        TransferredCache(bad, identity_mapper, num_exact_layers=0).convert_all()


def test_error_for_wrong_target_model(qwen3_model, identity_mapper):
    from conftest import tiny_model

    ids = random_ids(1, 10, seed=17)
    deeper = tiny_model("qwen3", num_hidden_layers=4)
    with pytest.raises(ValueError, match="num_hidden_layers: mapper has 3, model has 4"):  # before any output
        deeper.generate(ids, cache=TransferredCache(prefill(qwen3_model, ids), identity_mapper, model=deeper), max_new_tokens=2)
    wide = tiny_model("qwen3", num_hidden_layers=3, num_key_value_heads=4)
    with pytest.raises(ValueError, match="(?i)load the mapper made for this target"):
        wide.generate(ids, cache=TransferredCache(prefill(qwen3_model, ids), identity_mapper, model=wide), max_new_tokens=2)


def test_sliding_window_source_that_dropped_tokens_is_refused():
    from conftest import tiny_model
    from hf_kvtransfer import fit_mapper

    model = tiny_model("mistral", num_hidden_layers=2, sliding_window=8)
    mapper = fit_mapper(model, model, random_ids(8, 32, seed=1), top_k=1, progress=False)
    ids = random_ids(1, 20, seed=2)
    windowed = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=windowed)
    with pytest.raises(ValueError, match="sliding-window layer that kept only"):
        TransferredCache(windowed, mapper)
    # prefill keeps every token; the target's own sliding layers then hold only their window.
    kw = dict(do_sample=False, max_new_tokens=8, min_new_tokens=8)
    ref = model.generate(ids, **kw)
    out = model.generate(ids, cache=TransferredCache(prefill(model, ids), mapper, model=model), **kw)
    assert torch.equal(out, ref)


def test_grouped_products_split_and_bf16_mapper(qwen3_model, identity_mapper, grouped_identity_mapper, monkeypatch):
    from hf_kvtransfer.core import conversion as conversion_module

    ids = random_ids(2, 18, seed=16)
    own = prefill(qwen3_model, ids)
    grouped = TransferredCache(prefill(qwen3_model, ids), grouped_identity_mapper, num_recompute_tokens=0, num_exact_layers=0).convert_all()
    # One layer per product (what a big model gets): the same numbers.
    monkeypatch.setattr(conversion_module, "GROUP_OUT_FEATURES", 1)
    single = TransferredCache(prefill(qwen3_model, ids), grouped_identity_mapper, num_recompute_tokens=0, num_exact_layers=0).convert_all()
    for a, b, ref in zip(grouped.layers, single.layers, own.layers):
        assert (a.keys - b.keys).abs().max() < 1e-5 and (a.values - b.values).abs().max() < 1e-5
        # ... and the target's own KV (an independent computation), to the identity map's fit accuracy
        assert (a.keys - ref.keys).abs().max() < 1e-3 and (a.values - ref.values).abs().max() < 1e-3
        assert a.keys.is_contiguous() and a.values.is_contiguous()
    monkeypatch.undo()

    # A bf16 mapper fills a float32 cache: float32 tensors, within bf16 rounding of the float32 mapper's.
    half = copy.deepcopy(grouped_identity_mapper).to(torch.bfloat16)
    cache = TransferredCache(prefill(qwen3_model, ids), half, num_recompute_tokens=0, num_exact_layers=0).convert_all()
    for a, ref in zip(cache.layers, grouped.layers):
        assert a.keys.dtype == torch.float32
        scale = ref.keys.abs().max()
        assert (a.keys - ref.keys).abs().max() < 2e-2 * scale
        assert (a.values - ref.values).abs().max() < 2e-2 * ref.values.abs().max()


@pytest.mark.parametrize("mode", ["per_layer", "grouped", "low_rank"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_exact_identity_transfer_reproduces_own_cache(arch, mode):
    # Strip + map + re-apply with an identity map must give back the model's own cache, for every supported
    # RoPE flavour (scaled, partial rotary), with left padding, through the per-layer, grouped and low-rank paths.
    model = tiny_model(arch, num_hidden_layers=3)
    ids, mask = left_pad(random_ids(2, 21, seed=17), [21, 12])
    own = prefill(model, ids, attention_mask=mask)
    cache = TransferredCache(own, exact_identity_mapper(model, mode), attention_mask=mask, num_recompute_tokens=0,
                             num_exact_layers=0)
    cache.convert_all()
    real = mask.bool()
    for a, b in zip(cache.layers, own.layers):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert x.shape == y.shape and x.is_contiguous()
            assert (x - y).abs().amax(dim=(1, 3))[real].max().item() < 1e-5


def test_group_members_land_on_their_own_layers_dtype(qwen3_model, grouped_identity_mapper):
    # Layer 0's conversion computes the whole group; layer 1 then asks in another dtype (as a layer on another
    # device would ask on its device) and must get its KV in that dtype, equal to the float32 result rounded.
    ids = random_ids(1, 10, seed=18)
    cache = TransferredCache(prefill(qwen3_model, ids), grouped_identity_mapper, num_recompute_tokens=0, num_exact_layers=0)
    cache.convert_layer(0)
    assert cache.num_pending_layers == 2  # layers 1 and 2 were computed ahead, not converted
    cache.convert_layer(1, dtype=torch.bfloat16)
    ref = TransferredCache(prefill(qwen3_model, ids), grouped_identity_mapper, num_recompute_tokens=0, num_exact_layers=0).convert_all()
    assert cache.layers[1].keys.dtype == torch.bfloat16 and cache.layers[0].keys.dtype == torch.float32
    assert torch.equal(cache.layers[1].keys, ref.layers[1].keys.bfloat16())


def test_a_cache_computing_every_layer_recomputes_one_token_by_default(qwen3_model, identity_mapper):
    """With every target layer exact nothing is mapped: the transferred K/V are the target's own, and the default
    leaves one token (not 32) to the forward; the answer is the target's own. The maps here are scrambled, so any
    layer that were mapped instead would change it."""
    from dataclasses import replace

    from conftest import scrambled_mapper
    from hf_kvtransfer import resolve_num_recompute_tokens

    every = scrambled_mapper(identity_mapper)
    every.config = replace(every.config, num_exact_layers=3)
    ids = random_ids(1, 80, seed=31)
    ref = qwen3_model.generate(ids, do_sample=False, **GEN)
    cache = TransferredCache(prefill(qwen3_model, ids), every, model=qwen3_model)
    assert cache.num_recompute_tokens == 1 and cache.get_seq_length() == 79
    out = qwen3_model.generate(ids, cache=cache, do_sample=False, **GEN)
    assert torch.equal(out.sequences, ref.sequences) and _max_logit_diff(out, ref) < 1e-4
    # Fewer exact layers asked for, or a recorded number: the mapped transfer's default. Without the prompt's ids at
    # hand the default is the same (the cache then takes them from generate, or refuses: it never maps in their place).
    assert TransferredCache(prefill(qwen3_model, ids), every, num_exact_layers=2).num_recompute_tokens == 32
    assert resolve_num_recompute_tokens(None, 80, replace(every.config, num_recompute_tokens=5)) == 5
    legacy = tuple((layer.keys, layer.values) for layer in prefill(qwen3_model, ids).layers)
    assert TransferredCache(legacy, every).num_recompute_tokens == 1
    assert TransferredCache(legacy, every, input_ids=ids).num_recompute_tokens == 1
    assert resolve_num_recompute_tokens(None, 80, every) == 1 and resolve_num_recompute_tokens(None, 80, every, 0) == 32


@pytest.mark.parametrize("operation", ["crop", "select", "repeat_reorder"])
def test_cache_operations_between_the_exact_pass_and_conversion(qwen3_model, identity_mapper, operation):
    """`compute_exact_layers`, then a cache operation, then the forward: the exact layers are the target's own
    prefill of the cropped / selected prompt (they were dropped, and the forward failed on the missing layers).
    The maps are scrambled, so exact layers taken from the maps would not match."""
    from conftest import scrambled_mapper

    mapper = scrambled_mapper(identity_mapper)
    ids = random_ids(2, 20, seed=21)
    cache = TransferredCache(prefill(qwen3_model, ids), mapper, num_exact_layers=2, num_recompute_tokens=1, model=qwen3_model)
    cache.compute_exact_layers(qwen3_model, ids)
    if operation == "crop":
        cache.crop(-5)
        rows, length = [0, 1], 14
    elif operation == "select":
        cache.batch_select_indices(torch.tensor([1]))
        rows, length = [1], 19
    else:
        cache.batch_repeat_interleave(2)  # rows 0 0 1 1
        cache.reorder_cache(torch.tensor([3, 0, 1, 2]))
        rows, length = [1, 0, 0, 1], 19
    with torch.no_grad():
        qwen3_model(ids[rows, length : length + 1], cache=cache)
    own = prefill(qwen3_model, ids[rows, :length])
    for t in range(2):
        assert torch.allclose(cache.layers[t].keys[:, :, :length], own.layers[t].keys, atol=1e-5)
        assert torch.allclose(cache.layers[t].values[:, :, :length], own.layers[t].values, atol=1e-5)
    assert not torch.allclose(cache.layers[2].keys[:, :, :length], own.layers[2].keys, atol=1e-3)  # mapped
