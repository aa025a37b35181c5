"""What a TransferredCache accepts: decoding modes that re-feed the prompt, and input that does not continue it.

The reference is always the target's own output (the exact pair: a mapper from a model to itself that reproduces
its own cache), so every accepted mode must give the same tokens, and every refused one must fail before output.
"""

import warnings

import pytest
import torch

from conftest import exact_identity_mapper, random_ids, scrambled_mapper, tiny_model
from hf_kvtransfer import TransferredCache, prefill

GREEDY = dict(do_sample=False, max_new_tokens=12, min_new_tokens=12)


@pytest.fixture(scope="module")
def pair():
    model = tiny_model("qwen3", num_hidden_layers=3, seed=7)
    return model, exact_identity_mapper(model)


def _cache(model, mapper, ids, **kwargs):
    kwargs.setdefault("num_recompute_tokens", 1)  # these tests feed the prompt's last token themselves
    kwargs.setdefault("model", model)
    return TransferredCache(prefill(model, ids), mapper, **kwargs)


def test_assisted_decoding_with_the_source_as_assistant_is_exact(pair):
    model, mapper = pair
    assistant = tiny_model("qwen3", num_hidden_layers=2, seed=8)  # a different (worse) drafter
    ids = random_ids(1, 20, seed=1)
    ref = model.generate(ids, **GREEDY)
    with pytest.warns(UserWarning, match="re-feed the whole prompt"):
        out = model.generate(ids, cache=_cache(model, mapper, ids), assistant_model=assistant, **GREEDY)
    assert torch.equal(out, ref)


def test_prompt_lookup_is_exact(pair):
    model, mapper = pair
    ids = torch.cat([random_ids(1, 10, seed=2)] * 2, dim=1)  # repeats, so prompt lookup finds candidates
    ref = model.generate(ids, **GREEDY)
    with pytest.warns(UserWarning, match="re-feed the whole prompt"):
        out = model.generate(ids, cache=_cache(model, mapper, ids), prompt_lookup_num_tokens=3, **GREEDY)
    assert torch.equal(out, ref)


def test_num_recompute_tokens_zero_under_generate_is_exact(pair):
    model, mapper = pair
    ids = random_ids(1, 16, seed=3)
    with pytest.warns(UserWarning, match="re-feed the whole prompt"):
        out = model.generate(ids, cache=_cache(model, mapper, ids, num_recompute_tokens=0), **GREEDY)
    assert torch.equal(out, model.generate(ids, **GREEDY))


def test_normal_generate_neither_warns_nor_differs(pair):
    model, mapper = pair
    ids = random_ids(2, 16, seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model.generate(ids, cache=_cache(model, mapper, ids), **GREEDY)
    assert torch.equal(out, model.generate(ids, **GREEDY))


@pytest.mark.parametrize("call", ["generate", "forward at its positions"])
def test_a_prompt_whose_end_repeats_its_start_is_no_refeed(pair, call):
    """A span twice, its second half left to the target: the target is fed the very ids the cache holds, but after
    them (generate feeds the end of its sequence; a direct forward says its positions). That is the prompt's end, not
    the prompt fed again: no warning, and the target's own output from the transferred cache."""
    model, mapper = pair
    half = random_ids(1, 8, seed=9)
    ids = torch.cat([half, half], dim=1)
    cache = _cache(model, mapper, ids, num_recompute_tokens=8)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        if call == "generate":
            out, ref = model.generate(ids, cache=cache, **GREEDY), model.generate(ids, **GREEDY)
            assert torch.equal(out, ref)
        else:
            out = model(half, cache=cache, position_ids=torch.arange(8, 16)[None]).logits
            torch.testing.assert_close(out, model(ids).logits[:, 8:], rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() >= 16  # the transferred 8 and what the target computed after them


def test_another_prompt_of_the_same_length_is_refused(pair):
    model, mapper = pair
    a, b = random_ids(1, 16, seed=5), random_ids(1, 16, seed=6)
    with pytest.raises(ValueError, match="differ from the prompt this cache was built for"):
        model.generate(b, cache=_cache(model, mapper, a), **GREEDY)


def test_input_shorter_than_the_cached_prompt_is_refused(pair):
    model, mapper = pair
    ids = random_ids(1, 20, seed=7)
    with pytest.raises(ValueError, match="input_ids hold 8 tokens but this cache already holds 19"):
        model.generate(ids[:, :8], cache=_cache(model, mapper, ids), **GREEDY)


def test_reusing_a_cache_for_the_next_prompt_is_refused(pair):
    # What a pipeline over a list of prompts does with one cache object.
    model, mapper = pair
    first, second = random_ids(1, 12, seed=8), random_ids(1, 40, seed=9)
    cache = _cache(model, mapper, first)
    model.generate(first, cache=cache, **GREEDY)
    with pytest.raises(ValueError, match="differ from the prompt"):
        model.generate(second, cache=cache, **GREEDY)


def test_multi_turn_continuation_still_works(pair):
    model, mapper = pair
    ids = random_ids(1, 14, seed=10)
    cache = _cache(model, mapper, ids)
    turn1 = model.generate(ids, cache=cache, **GREEDY)
    turn2_ids = torch.cat([turn1, random_ids(1, 5, seed=11)], dim=1)
    out = model.generate(turn2_ids, cache=cache, **GREEDY)
    own = model.generate(turn2_ids, **GREEDY)
    assert torch.equal(out, own)


def test_a_second_generate_with_the_same_ids_says_what_to_pass(pair):
    model, mapper = pair
    ids = random_ids(1, 14, seed=12)
    cache = _cache(model, mapper, ids)
    model.generate(ids, cache=cache, **GREEDY)
    with pytest.raises(ValueError, match="cache already holds|no token beyond"):
        model.generate(ids, cache=cache, **GREEDY)


def test_a_second_generate_with_the_same_padded_batch_says_what_to_pass(pair):
    # With padding, generate's positions are not the tokens' indices: its mask, shorter than what the cache holds
    # and is fed, says that the input goes back into the cached tokens.
    from conftest import left_pad

    model, mapper = pair
    ids, mask = left_pad(random_ids(2, 14, seed=12), [14, 9])
    cache = TransferredCache(prefill(model, ids, attention_mask=mask), mapper, attention_mask=mask, model=model,
                             num_recompute_tokens=1)  # fmt: skip
    model.generate(ids, attention_mask=mask, cache=cache, **GREEDY)
    with pytest.raises(ValueError, match="this cache already holds 25"):
        model.generate(ids, attention_mask=mask, cache=cache, **GREEDY)


def test_only_new_tokens_with_a_mask_covering_the_cache_are_exact(pair):
    model, mapper = pair
    prompt, new = random_ids(1, 15, seed=13), random_ids(1, 4, seed=14)
    full = torch.cat([prompt, new], dim=1)
    src = prefill(model, prompt)
    cache = TransferredCache(src, mapper, num_recompute_tokens=0, model=model)
    out = model.generate(new, attention_mask=torch.ones_like(full), cache=cache, **GREEDY)
    assert torch.equal(out[:, -12:], model.generate(full, **GREEDY)[:, -12:])


def test_only_new_tokens_without_a_mask_say_what_to_pass(pair):
    model, mapper = pair
    prompt = random_ids(1, 15, seed=15)
    cache = _cache(model, mapper, prompt)
    with pytest.raises(ValueError, match="whole conversation so far"):
        model.generate(random_ids(1, 4, seed=16), cache=cache, **GREEDY)


def test_a_model_with_fewer_layers_is_refused_before_output():
    source = tiny_model("qwen3", num_hidden_layers=3, seed=17)
    mapper = exact_identity_mapper(source)
    smaller = tiny_model("qwen3", num_hidden_layers=2, seed=18)
    ids = random_ids(1, 12, seed=19)
    with pytest.raises(ValueError, match="num_hidden_layers: mapper has 3, model has 2"):
        smaller.generate(ids, cache=TransferredCache(prefill(source, ids), mapper, model=smaller), **GREEDY)


def test_direct_forward_of_the_recomputed_token_is_exact_and_of_another_is_refused(pair):
    model, mapper = pair
    ids = random_ids(1, 18, seed=20)
    own = model(ids).logits[:, -1]
    with torch.no_grad():
        got = model(ids[:, -1:], cache=_cache(model, mapper, ids)).logits[:, -1]
    torch.testing.assert_close(got, own, rtol=1e-4, atol=1e-4)
    other = (ids[:, -1:] + 1) % model.config.vocab_size
    with pytest.raises(ValueError, match="first at position 17"):
        model(other, cache=_cache(model, mapper, ids))


@torch.no_grad()
def test_default_leaves_the_prompts_last_tokens_to_the_target(pair):
    model, mapper = pair
    ids = random_ids(2, 80, seed=23)
    cache = TransferredCache(prefill(model, ids), mapper, model=model)
    # 32 by default, at most half a short prompt, at least one token for generate to feed
    assert (cache.num_recompute_tokens, cache.get_seq_length()) == (32, 48)
    assert [TransferredCache(prefill(model, ids[:, :n]), mapper).num_recompute_tokens for n in (1, 2, 5, 64)] == [1, 1, 2, 32]
    # the tail it leaves is what a direct forward feeds; feeding only the last token says how to fix the call
    torch.testing.assert_close(model(ids[:, 48:], cache=cache).logits, model(ids).logits[:, 48:], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"holds the first 48 of the prompt's 80 tokens.*feed `input_ids\[:, 48:\]`"):
        model(ids[:, -1:], cache=TransferredCache(prefill(model, ids), mapper, model=model))
    # under generate the first 48 tokens are really transferred: a scrambled mapper changes the output
    kw = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    own = model.generate(ids, **kw)
    same = model.generate(ids, cache=TransferredCache(prefill(model, ids), mapper, model=model), **kw)
    lost = model.generate(ids, cache=TransferredCache(prefill(model, ids), scrambled_mapper(mapper), model=model), **kw)
    assert torch.equal(same.sequences, own.sequences)
    assert (lost.scores[0] - own.scores[0]).abs().max() > 1e-2


def test_decode_steps_after_conversion_compile_without_graph_breaks(pair):
    # A transferred cache must be as compile-friendly as the target's own once converted (the decode path).
    model, mapper = pair
    ids = random_ids(1, 20, seed=21)
    breaks = {}
    for name, cache in (("own", prefill(model, ids[:, :19])), ("transferred", _cache(model, mapper, ids))):
        with torch.no_grad():
            model(ids[:, 19:], cache=cache)  # the transferred cache converts here, eagerly
            torch._dynamo.reset()
            explained = torch._dynamo.explain(model.forward)(ids[:, :1], cache=cache, use_cache=True)
        breaks[name] = (explained.graph_count, explained.graph_break_count)
    assert breaks["transferred"] == breaks["own"] == (1, 0)


@pytest.mark.parametrize("num_exact_layers", [1, 2])
def test_exact_first_layers_are_the_targets_own(num_exact_layers):
    # A deliberately useless mapper (zero weights): only the layers the target computes itself can match its own
    # cache, and they must match it exactly, with left padding; the others stay mapped (here: zeros).
    from hf_kvtransfer import KVMapper

    from conftest import left_pad

    model = tiny_model("llama3-scaling", num_hidden_layers=3, seed=22)
    zero = KVMapper(exact_identity_mapper(model).config)
    ids, mask = left_pad(random_ids(2, 16, seed=23), [16, 11])
    own = prefill(model, ids, attention_mask=mask)
    cache = TransferredCache(prefill(model, ids, attention_mask=mask), zero, attention_mask=mask, num_exact_layers=num_exact_layers, num_recompute_tokens=1, model=model)
    with torch.no_grad():
        model(ids[:, -1:], attention_mask=mask, cache=cache)
    real = mask.bool()[:, :15]
    for t, (a, b) in enumerate(zip(cache.layers, own.layers)):
        got, ref = a.keys[:, :, :15], b.keys[:, :, :15]
        error = (got - ref).abs().amax(dim=(1, 3))[real].max().item()
        assert (error < 1e-5) if t < num_exact_layers else (error > 1e-2), (t, error)


def test_a_compiled_target_converts_before_its_graph():
    # Under torch.compile (dynamo's tracing; the eager backend keeps this fast) the first forward converts every
    # layer in one graph break, the prompt checked there, and answers as the eager target: through generate with the
    # forward compiled, and a direct forward of the compiled module. A mapper with an exact layer and the residual.
    from conftest import residual_pair

    source, target, _, _, (mapper,) = residual_pair((1,))
    ids = random_ids(2, 24, seed=31)

    def cache():
        return TransferredCache(prefill(source, ids), mapper, num_recompute_tokens=8, model=target)

    beams = dict(GREEDY, num_beams=2)
    with torch.no_grad():
        want = target.generate(ids, cache=cache(), **GREEDY)
        want_beams = target.generate(ids, cache=cache(), **beams)
        want_logits = target(ids[:, -8:], cache=cache()).logits
    original = target.forward
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            told = cache()
            explained = torch._dynamo.explain(target)(ids[:, -8:], cache=told, use_cache=True)
        # converted where the model's hook tells the cache its input (the one break, before the forward's graph)
        assert (explained.graph_count, told.num_pending_layers) == (1, 0), explained.break_reasons
        torch._dynamo.reset()
        target.forward = torch.compile(original, backend="eager", dynamic=True)
        with torch.no_grad():
            assert torch.equal(target.generate(ids, cache=cache(), **GREEDY), want)
            assert torch.equal(target.generate(ids, cache=cache(), **beams), want_beams)  # rows expanded: converted so
            with pytest.raises(ValueError, match="differ from the prompt"):
                target.generate(ids.flip(-1), cache=cache(), **GREEDY)
        target.forward = original
        torch._dynamo.reset()
        compiled = torch.compile(target, backend="eager", dynamic=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids[:, -8:], cache=cache()).logits, want_logits, rtol=1e-5, atol=1e-5)
        # fullgraph=True allows no break: converted first, the forward's graph is whole.
        torch._dynamo.reset()
        whole = torch.compile(target, backend="eager", dynamic=True, fullgraph=True)
        converted = TransferredCache(prefill(source, ids), mapper, num_recompute_tokens=8, model=target).convert_all()
        with torch.no_grad():
            torch.testing.assert_close(whole(ids[:, -8:], cache=converted).logits, want_logits, rtol=1e-5, atol=1e-5)
    finally:
        target.forward = original
        torch._dynamo.reset()


def test_a_cache_not_told_its_model_refuses_a_forward_in_one_line():
    # Without model= no forward tells the cache what it is fed: eager or compiled, the first forward refuses before
    # any output, naming the fix; with it, the compiled module answers as the eager target.
    from conftest import residual_pair

    source, target, _, _, (mapper,) = residual_pair((1,))
    ids = random_ids(1, 24, seed=32)
    with torch.no_grad():
        want = target(ids[:, -8:], cache=TransferredCache(prefill(source, ids), mapper, num_recompute_tokens=8,
                                                          model=target)).logits  # fmt: skip
        with pytest.raises(ValueError, match=r"build it with model=target"):
            target(ids[:, -8:], cache=TransferredCache(prefill(source, ids), mapper, num_recompute_tokens=8))
        with pytest.raises(ValueError, match=r"build it with model=target"):
            target.generate(ids, cache=TransferredCache(prefill(source, ids), mapper), **GREEDY)
    compiled = torch.compile(target, backend="eager", dynamic=True)
    try:
        with pytest.raises(ValueError, match="build it with model=target"), torch.no_grad():
            compiled(ids[:, -8:], cache=TransferredCache(prefill(source, ids), mapper, num_recompute_tokens=8))
        told = TransferredCache(prefill(source, ids), mapper, num_recompute_tokens=8, model=target)
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids[:, -8:], cache=told).logits, want, rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()


def test_the_model_tells_every_cache_with_one_hook_and_a_copy_tells_its_own(pair):
    # However many caches a model serves it gets one hook (and one generate wrapper); a deep copy of the model keeps
    # them, bound to the copy, and a cache built for one model refuses the other's forward before any output.
    import copy

    model, mapper = pair
    ids = random_ids(1, 16, seed=40)
    for _ in range(3):
        _cache(model, mapper, ids)
    assert len(model._forward_pre_hooks) == 1
    twin = copy.deepcopy(model)
    assert twin.prepare_inputs_for_generation.__self__ is twin
    out = twin.generate(ids, cache=_cache(twin, mapper, ids), **GREEDY)
    assert torch.equal(out, model.generate(ids, **GREEDY))
    assert len(twin._forward_pre_hooks) == 1
    with pytest.raises(ValueError, match="build it with model=target"):
        twin.generate(ids, cache=_cache(model, mapper, ids), **GREEDY)
    # A model given its own prepare_inputs_for_generation by another library (peft does) keeps it.
    calls = []

    def own(input_ids, *args, **kwargs):
        calls.append(input_ids.shape[-1])
        return type(twin).prepare_inputs_for_generation(other, input_ids, *args, **kwargs)

    other = copy.deepcopy(model)
    vars(other).pop("prepare_inputs_for_generation")
    other.prepare_inputs_for_generation = own
    out = other.generate(ids, cache=_cache(other, mapper, ids), **GREEDY)
    assert torch.equal(out, model.generate(ids, **GREEDY)) and calls[0] == 16
    changed = ids.clone()
    changed[:, 0] = (changed[:, 0] + 1) % model.config.vocab_size  # what the forward is fed is the same: generate's
    with pytest.raises(ValueError, match="differ from the prompt.*position 0"):  # sequence says it is another prompt
        other.generate(changed, cache=_cache(other, mapper, ids), **GREEDY)
