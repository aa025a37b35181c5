"""The fit's exact-layer choice (`exact_layers.py`): the content probe, its wiring into fits, and what the cache does
with the recorded number."""

import math
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import exact_identity_mapper, random_ids, tiny_model
from hf_kvtransfer import FitConfig, TransferredCache, fit_mapper, prefill
from hf_kvtransfer.fitting.exact_layers import choose_num_exact_layers, probe_stream
from hf_kvtransfer.core.mapper import DEFAULT_NUM_EXACT_LAYERS


def _bundled_family():
    from hf_kvtransfer.commands.demo import find_family

    try:
        return find_family(Path(__file__).resolve().parent.parent / "examples" / "family")
    except FileNotFoundError:
        pytest.skip("bundled family not in examples/family (python research/family_builder/train_family.py --output-dir examples/family)")


@pytest.fixture(scope="module")
def family_models():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    family = _bundled_family()
    tok = AutoTokenizer.from_pretrained(family / "large")
    models = {name: AutoModelForCausalLM.from_pretrained(family / name, dtype=torch.float32).eval() for name in ("small", "large")}
    stream = tok((family / "heldout.txt").read_text(encoding="utf-8")[:60_000], verbose=False)["input_ids"]
    return models, stream


def _broken_at(model, layer: int):
    """An exact identity mapper `model` -> `model` except target layer `layer`, whose keys and values are mapped to
    zero: the target's copying survives exactly when that layer is computed, not mapped."""
    mapper = exact_identity_mapper(model)
    with torch.no_grad():
        for kind in ("key", "value"):
            getattr(mapper.layers[layer], kind).weight.zero_()
    return mapper


@pytest.mark.parametrize("name", ["large", "small"])
def test_probe_picks_the_layers_below_and_including_the_broken_one(family_models, name):
    # Ground truth by construction: every layer but 3 is mapped exactly, so computing layers 0-3 gives the target its
    # own cache (retention 1) and fewer leave zeroed keys and values in layer 3, the one both bundled models copy
    # through (zeroing any other layer of the large one keeps >= 88% of its copying). For the 4-layer small model
    # that is every layer: the probe says no prefill is saved.
    models, stream = family_models
    model, broken = models[name], 3
    chosen, report = choose_num_exact_layers(model, model, _broken_at(model, broken), stream, num_items=16, prefix_len=128)
    tried = {row["num_exact_layers"]: row["retention"] for row in report["tried"]}
    assert report["copy_gain"]["mean"] > 1.0, report  # the bundled large model copies repeated text
    assert chosen == broken + 1, report
    assert tried[DEFAULT_NUM_EXACT_LAYERS] < 0.9
    for k, retention in tried.items():
        if k > broken:
            assert retention == pytest.approx(1.0, abs=1e-3), report
    assert ("whole cache" in report["reason"]) == (chosen == model.config.num_hidden_layers)
    # the mapper's card shows the choice and the probe's table
    from dataclasses import replace

    from hf_kvtransfer.core.card import render_model_card

    mapper = _broken_at(model, broken)
    card = str(render_model_card(replace(mapper.config, num_exact_layers=chosen).to_dict(), report={"exact_layers": report}))
    layers = model.config.num_hidden_layers
    assert f"its first {chosen} of {layers} layers" in card and f"1: {100 * tried[1]:.1f}%" in card, card


def test_probe_declines_when_the_target_does_not_copy(qwen3_model):
    # A random-weight model gains nothing from a repeated span: no content to keep, no number recorded.
    mapper = exact_identity_mapper(qwen3_model)
    chosen, report = choose_num_exact_layers(qwen3_model, qwen3_model, mapper, random_ids(1, 2000, seed=3)[0], num_items=8)
    assert chosen is None and "barely copies" in report["reason"], report
    assert len(report["tried"]) == 1  # one candidate measures the gain; no bisection on noise
    assert probe_stream(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[0, 1, 1], [1, 1, 0]])) == [2, 3, 4, 5]


def test_fit_records_a_given_number_and_the_cache_uses_it(qwen3_model, calibration_ids, tmp_path):
    mapper = fit_mapper(qwen3_model, qwen3_model, calibration_ids, top_k=1, num_exact_layers=2, progress=False)
    assert mapper.config.num_exact_layers == 2 and "exact_layers" not in mapper.report  # given: no probe
    mapper.save_pretrained(tmp_path / "m")
    assert "its first 2 of 3 layers" in (tmp_path / "m" / "README.md").read_text()
    ids = random_ids(1, 12, seed=5)
    cache = TransferredCache(prefill(qwen3_model, ids), mapper, num_recompute_tokens=1, model=qwen3_model)
    assert cache.num_exact_layers == 2
    assert TransferredCache(prefill(qwen3_model, ids), mapper, num_exact_layers=0).num_exact_layers == 0
    # what the cache computes: the target's own layers 0-1 (the fit here maps the model onto itself imperfectly)
    with torch.no_grad():
        qwen3_model(ids[:, -1:], cache=cache)
        own = prefill(qwen3_model, ids[:, :-1])
    for t in range(2):
        torch.testing.assert_close(cache.layers[t].keys[:, :, :-1], own.layers[t].keys, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(cache.layers[2].keys[:, :, :-1], own.layers[2].keys, atol=1e-6)


def test_fit_config_num_exact_layers_grammar():
    assert FitConfig().num_exact_layers == "auto"
    assert FitConfig(num_exact_layers="3").num_exact_layers == 3
    for bad in ("-1", "two", 1.5, True):
        with pytest.raises(ValueError, match="must be 'auto' or an integer"):
            FitConfig(num_exact_layers=bad)
    with pytest.raises(ValueError, match="exact_layers_retention"):
        FitConfig(exact_layers_retention=1.5)


def test_mapper_config_rejects_more_exact_layers_than_the_target_has(qwen3_model):
    from dataclasses import replace

    mapper = exact_identity_mapper(qwen3_model)
    assert mapper.config.num_exact_layers is None and mapper.num_exact_layers == DEFAULT_NUM_EXACT_LAYERS
    with pytest.raises(ValueError, match=r"num_exact_layers must be in \[0, 3\]"):
        replace(mapper.config, num_exact_layers=4)


def test_exact_layers_without_prompt_ids_come_from_generate_or_refuse(qwen3_model):
    # Layers 0-1 map to zero: only computing them gives the target's own keys there.
    mapper = exact_identity_mapper(qwen3_model)
    with torch.no_grad():
        for layer in mapper.layers[:2]:
            layer.key.weight.zero_()
            layer.value.weight.zero_()
    ids = random_ids(1, 10, seed=7)
    src = prefill(qwen3_model, ids)
    bare = tuple((layer.keys, layer.values) for layer in src.layers)  # a legacy cache: no prompt ids recorded
    without = TransferredCache(bare, mapper, num_exact_layers=2, num_recompute_tokens=1, model=qwen3_model)
    assert without.prompt_ids is None
    qwen3_model.generate(ids, cache=without, max_new_tokens=2, do_sample=False)
    own = prefill(qwen3_model, ids[:, :-1])
    for t in range(2):  # generate's sequence gave the ids: the exact layers were computed, not mapped to zero
        torch.testing.assert_close(without.layers[t].keys[:, :, :9], own.layers[t].keys, rtol=1e-5, atol=1e-5)
    # beam search repeats each prompt row: the ids are still generate's, one row per source row
    beams = TransferredCache(bare, mapper, num_exact_layers=2, num_recompute_tokens=1, model=qwen3_model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qwen3_model.generate(ids, cache=beams, max_new_tokens=2, num_beams=2, do_sample=False)
    assert not [w for w in caught if "mapped, not computed" in str(w.message)]
    for t in range(2):
        for row in range(2):
            torch.testing.assert_close(beams.layers[t].keys[row : row + 1, :, :9], own.layers[t].keys, rtol=1e-5, atol=1e-5)
    # A direct forward on a cache that knows no ids cannot compute them: one line naming the fix, nothing mapped.
    direct = TransferredCache(bare, mapper, num_exact_layers=2, num_recompute_tokens=1, model=qwen3_model)
    with pytest.raises(ValueError, match="does not know them: .*input_ids= to TransferredCache"):
        with torch.no_grad():
            qwen3_model(ids[:, -1:], cache=direct)
    assert direct.num_pending_layers == 3


def test_no_getter_runs_the_exact_layers_forward(qwen3_model, monkeypatch):
    """`get_seq_length` / `get_mask_sizes` only read and check; the exact layers run inside the first layer's update."""
    import inspect

    from hf_kvtransfer.core import cache as cache_module

    calls = []
    real = cache_module.own_prefix

    def recording(*args, **kwargs):
        calls.append({frame.function for frame in inspect.stack()})
        return real(*args, **kwargs)

    monkeypatch.setattr(cache_module, "own_prefix", recording)
    mapper = exact_identity_mapper(qwen3_model)
    ids = random_ids(2, 12, seed=3)
    cache = TransferredCache(prefill(qwen3_model, ids), mapper, num_exact_layers=2, num_recompute_tokens=1, model=qwen3_model)
    out = qwen3_model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    own = qwen3_model.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, own)
    assert len(calls) == 1, "the exact layers must be computed exactly once"
    assert not calls[0] & {"get_seq_length", "get_mask_sizes"}, f"ran from a getter: {calls[0]}"
    assert "update" in calls[0]


def test_compute_exact_layers_explicitly_matches_the_targets_own_prefill(qwen3_model):
    mapper = exact_identity_mapper(qwen3_model)
    with torch.no_grad():  # layers 0-1 map to zero: only computing them gives the target's own keys there
        for layer in mapper.layers[:2]:
            layer.key.weight.zero_()
            layer.value.weight.zero_()
    ids = random_ids(1, 10, seed=5)
    src = prefill(qwen3_model, ids)
    own = prefill(qwen3_model, ids[:, :-1])
    cache = TransferredCache(src, mapper, num_exact_layers=2, num_recompute_tokens=1)
    cache.compute_exact_layers(qwen3_model).convert_all()
    assert cache.num_pending_layers == 0
    for t in range(2):
        torch.testing.assert_close(cache.layers[t].keys, own.layers[t].keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.layers[t].values, own.layers[t].values, rtol=1e-5, atol=1e-5)
    bare = tuple((layer.keys, layer.values) for layer in src.layers)  # no prompt ids known
    with pytest.raises(ValueError, match="needs the prompt's ids: pass `input_ids=`"):
        TransferredCache(bare, mapper, num_exact_layers=2, num_recompute_tokens=1).compute_exact_layers(qwen3_model)


def _zeroed_first_layers(model, count: int):
    """An exact identity mapper whose first `count` layers map to zero: only computing them gives the target's own
    keys there, so a transfer that maps them in silence changes the logits."""
    mapper = exact_identity_mapper(model)
    with torch.no_grad():
        for layer in mapper.layers[:count]:
            layer.key.weight.zero_()
            layer.value.weight.zero_()
    return mapper


def test_inputs_embeds_calls_compute_the_exact_layers(qwen3_model):
    """`inputs_embeds` (soft prompts, multimodal front-ends) gets the same exact layers as ids: a forward of the
    recomputed tokens' embeddings, and generate on the prompt's embeddings, equal the same calls with ids; the
    reference is the target's own prefill (an independent computation)."""
    mapper = _zeroed_first_layers(qwen3_model, 2)
    ids = random_ids(1, 40, seed=21)
    emb = qwen3_model.get_input_embeddings()
    r = 8

    def cache(model=qwen3_model):  # the model whose forward runs on it: the causal LM, or its body alone
        return TransferredCache(prefill(qwen3_model, ids), mapper, num_exact_layers=2, num_recompute_tokens=r, model=model)

    with torch.no_grad():
        own = qwen3_model(ids).logits[:, -r:]
        by_ids = qwen3_model(ids[:, -r:], cache=cache()).logits
        by_embeds = qwen3_model(inputs_embeds=emb(ids[:, -r:]), cache=cache()).logits
        body = qwen3_model.model(inputs_embeds=emb(ids[:, -r:]), cache=cache(qwen3_model.model)).last_hidden_state
    torch.testing.assert_close(by_ids, own, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(by_embeds, own, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(qwen3_model.lm_head(body), own, rtol=1e-4, atol=1e-4)
    gen = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    ref = qwen3_model.generate(ids, **gen)
    out = qwen3_model.generate(inputs_embeds=emb(ids), cache=cache(), **gen)
    assert torch.equal(out.sequences, ref.sequences[:, ids.shape[1]:])
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), rtol=1e-4, atol=1e-4)


def test_convert_all_computes_the_exact_layers_of_the_model_it_was_given(qwen3_model):
    mapper = _zeroed_first_layers(qwen3_model, 2)
    ids = random_ids(2, 30, seed=22)
    own = prefill(qwen3_model, ids[:, :-1])
    with pytest.raises(ValueError, match="not given the target model"):
        TransferredCache(prefill(qwen3_model, ids), mapper, num_exact_layers=2, num_recompute_tokens=1).convert_all()
    cache = TransferredCache(prefill(qwen3_model, ids), mapper, num_exact_layers=2, num_recompute_tokens=1, model=qwen3_model)
    cache.convert_all()
    for t in range(3):  # layers 0-1 computed, layer 2 mapped by the identity
        torch.testing.assert_close(cache.layers[t].keys, own.layers[t].keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.layers[t].values, own.layers[t].values, rtol=1e-5, atol=1e-5)


def test_convert_layer_one_at_a_time_equals_convert_all(qwen3_model):
    """`convert_layer` in ascending order (a serving engine filling its blocks as its forward reaches each layer)
    gives exactly `convert_all`'s keys and values, the exact layers first; a converted layer is not converted again."""
    mapper = _zeroed_first_layers(qwen3_model, 2)
    ids = random_ids(1, 30, seed=23)

    def cache():
        return TransferredCache(prefill(qwen3_model, ids), mapper, num_exact_layers=2, num_recompute_tokens=1,
                                model=qwen3_model)  # fmt: skip

    whole, layered = cache().convert_all(), cache()
    num_layers = len(whole.layers)
    for t in range(num_layers):
        keys, values = layered.convert_layer(t)
        assert layered.num_pending_layers <= num_layers - t - 1
        assert torch.equal(keys, whole.layers[t].keys) and torch.equal(values, whole.layers[t].values)
    assert layered.num_pending_layers == 0 and layered.pending_nbytes == 0
    assert layered.convert_layer(0)[0] is layered.layers[0].keys


@settings(max_examples=200, derandomize=True)
@given(st.sets(st.integers(0, 80)))
def test_skipped_candidates_are_summarised_as_runs_of_exact_layers(layers):
    """The verbose fit logs one line per skip reason instead of one per skipped candidate: the runs it prints read
    back as the same exact-layer counts."""
    from hf_kvtransfer.fitting.exact_layers import _skipped_lines, _spans

    text = _spans(sorted(layers))
    back = set()
    for part in filter(None, text.split(", ")):
        a, _, b = part.partition("-")
        back |= set(range(int(a), int(b or a) + 1))
    assert back == layers
    rows = [{"skipped": "fewer passed", "num_exact_layers": k} for k in sorted(layers) for _ in range(2)]
    rows.append({"skipped": None, "num_exact_layers": 1})
    assert _skipped_lines(rows) == ([f"{2 * len(layers)} skipped, {text} exact layers (fewer passed)"] if layers else [])


@pytest.fixture(scope="module")
def labelled_mapper():
    return exact_identity_mapper(tiny_model("qwen3", num_hidden_layers=2, seed=0))


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.data())
def test_the_source_only_gate_finds_the_first_accepted_count_in_logarithmic_verdicts(labelled_mapper, data):
    """The gate's search over the source-only answer's exact layers ends where a scan of every count from the
    screen's upward ends (a gate that accepts from some count on), with at most 1 + ceil(log2(layers - first))
    verdicts: a 64-layer target whose source K/V maps need 40 exact layers is judged about 6 times, not 37."""
    from hf_kvtransfer.fitting.exact_layers import _gate_source_only

    num_layers = data.draw(st.integers(1, 96), label="num_layers")
    first = data.draw(st.integers(1, num_layers), label="first")
    threshold = data.draw(st.integers(first, num_layers + 1), label="accepted from")
    judged = []

    class Gate:
        def judge(self, mapper, k):
            judged.append(k)
            return {"accepted": k >= threshold, "tolerance": 0.05, "tasks": {}}

    rows = [{"num_exact_layers": first, "retention": 0.99, "retention_ci": [0.98, 1.0], "passes": True}]
    chosen = _gate_source_only(Gate(), labelled_mapper, first, num_layers, rows)
    scan = next((k for k in range(first, num_layers) if k >= threshold), num_layers)
    assert chosen == scan
    assert len(judged) == len(set(judged)) <= 1 + math.ceil(math.log2(max(1, num_layers - first)))
    assert all(num_layers > k >= first for k in judged)
    assert sorted(r["num_exact_layers"] for r in rows if "gate" in r) == sorted(judged)
    assert _gate_source_only(None, labelled_mapper, first, num_layers, []) == first


def test_a_mapper_that_saves_little_is_named_by_its_share_of_the_prefill_torch_counts(qwen3_model):
    """`little_saved` warns exactly when a mapper's default transfer (exact layers, maps, then the last 32 tokens
    through the whole target) costs the first token more than half the target's own prefill, and names that share:
    checked against torch's FLOP counter on the target's own forward and on the transfer done by hand, for every
    exact-layer count (the counter sees eager attention's full square where the count takes the causal half: a wide
    MLP makes attention a few percent, and counts whose share is near the line are left out); all layers exact is
    the target's own prefill, which the fit's choice already names."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_kvtransfer import KVMapper, MapperConfig
    from hf_kvtransfer.fitting.exact_layers import LITTLE_SAVED, little_saved

    target = tiny_model("qwen3", num_hidden_layers=6, seed=5, intermediate_size=4096)
    source, seq, recompute = qwen3_model, 256, 32  # the cache's default recomputed tokens
    ids = random_ids(1, seq, seed=3)
    layers, transferred = target.config.num_hidden_layers, seq - recompute
    config = MapperConfig(source.config.to_dict(), target.config.to_dict(), [[0]] * layers)
    with FlopCounterMode(display=False) as counter:
        target.model(ids)
    own = counter.get_total_flops()
    source_cache = prefill(source, ids[:, :transferred])
    decided = 0
    for n in range(layers):
        mapper = KVMapper(config).with_config(num_exact_layers=n)
        cache = TransferredCache(source_cache, mapper, num_recompute_tokens=0, input_ids=ids[:, :transferred], model=target)
        with FlopCounterMode(display=False) as counter:
            cache.convert_all()
            target.model(ids[:, transferred:], cache=cache)
        share = counter.get_total_flops() / own
        line = little_saved(mapper, seq)
        if abs(share - LITTLE_SAVED) < 0.05:
            continue
        decided += 1
        assert (line is not None) == (share > LITTLE_SAVED), (n, share, line)
        if line is not None:
            stated = int(line.split("transfer does ")[1].split("%")[0])
            assert abs(stated - 100 * share) <= 3, (n, share, line)
            assert f"{n} of {layers} target layers" in line and f"{seq}-token prompt" in line
    assert decided >= layers - 1
    assert little_saved(KVMapper(config).with_config(num_exact_layers=layers), seq) is None  # the fit's reason says so


def test_a_fit_that_keeps_most_layers_exact_says_so_in_one_line(qwen3_model, calibration_ids, monkeypatch, caplog):
    """The fit's call: where its choice (here forced to 5 of 6 exact layers) saves little, one warning line, the one
    `little_saved` words; at its own choice on random weights (1 exact layer), none."""
    from hf_kvtransfer.fitting import fit as fit_module
    from hf_kvtransfer.fitting.exact_layers import little_saved

    target = tiny_model("qwen3", num_hidden_layers=6, seed=5, intermediate_size=4096)
    real = fit_module.choose_configuration

    def forced(*args, **kwargs):
        mapper, report = real(*args, **kwargs)
        return mapper.with_config(num_exact_layers=5), report

    for choose, expect in ((real, False), (forced, True)):
        monkeypatch.setattr(fit_module, "choose_configuration", choose)
        caplog.clear()
        with caplog.at_level("WARNING", logger="hf_kvtransfer.fitting.fit"):
            mapper = fit_mapper(qwen3_model, target, calibration_ids, top_k=1, num_exact_layers="auto", progress=False)
        said = [r.getMessage() for r in caplog.records if "saves little" in r.getMessage()]
        line = little_saved(mapper)
        assert (line is not None) == expect and said == ([f"exact layers: {line}"] if expect else []), (said, line)


@settings(max_examples=400, derandomize=True, deadline=None)
@given(st.lists(st.booleans(), max_size=80))
def test_the_count_search_finds_a_boundary_in_about_two_log2_tries(outcomes):
    """`_gallop` (the configuration search over exact-layer counts) on any pass/fail pattern: what it returns passes
    and the one before it fails, each place is tried once, and it tries about 2 log2 of the answer's place where a
    scan tries every one; where nothing fails after a pass it is the first pass, as the scan finds; None only when
    the last place fails."""
    from hf_kvtransfer.fitting.exact_layers import _gallop, _gallop_steps

    tries = []

    def passes(i):
        tries.append(i)
        return outcomes[i]

    found = _gallop(passes, len(outcomes))
    assert len(tries) == len(set(tries)) and all(0 <= i < len(outcomes) for i in tries)
    if found is None:
        assert not outcomes or not outcomes[-1]
    else:
        assert outcomes[found] and (found == 0 or not outcomes[found - 1])
    if outcomes == sorted(outcomes):  # every fail before every pass
        assert found == (outcomes.index(True) if True in outcomes else None)
    reach = len(outcomes) if found is None else found + 1
    assert len(tries) <= 2 * math.ceil(math.log2(reach + 1)) + 1
    assert len(tries) <= _gallop_steps(len(outcomes))  # the progress bar's total is never passed
