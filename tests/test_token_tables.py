"""Token tables and the first-layer table, a research plug-in (research/token_tables/token_tables_plugin: `tables.py`,
`first_layer.py`, `fit.py`) registered with the library's map inputs when imported: the table rows of the prompt's
ids, the closed-form solve, what the cache adds, refusals, persistence, and the refine step the plug-in hands the fit
(`fit_mapper(..., refine=...)`)."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import VOCAB, random_ids, residual_pair, steady_timings, tables_plugin, tiny_model
from rope_reference import apply_rope
from hf_kvtransfer import KVMapper, TransferredCache, fit_mapper, prefill
from hf_kvtransfer.core.capture import capture_kv
from hf_kvtransfer.core.rope import rotary_cos_sin
from hf_kvtransfer.core.key_norm import KeyNormConfig
from hf_kvtransfer.core.map_inputs import with_input
from hf_kvtransfer.core.residual import ResidualConfig
from hf_kvtransfer.fitting import exact_layers

tables_plugin()  # registers the plug-in's inputs
from token_tables_plugin import (  # noqa: E402
    TokenTableConfig,
    capture_table_inputs,
    fit_token_tables,
    fold_residual_into_tables,
    lagged_token_ids,
    solve_token_tables,
    table_refiner,
    table_rows,
    tabulate_first_layer,
    token_residuals,
    token_table_parameters,
    with_token_tables,
)



@pytest.fixture(scope="module")
def pair():
    source, target, ids, base, (residual,) = residual_pair((0,))
    return source, target, ids, base, residual


def with_random_tables(mapper, readers, lags=(0, 1, 2), seed=0):
    """`mapper` with tables of random entries on `readers` (the fit's output shape, any numbers)."""
    m = KVMapper(with_input(mapper.config, "token_tables", TokenTableConfig(list(lags), list(readers))), layer_maps=mapper.layers)
    m.residual = mapper.residual
    g = torch.Generator().manual_seed(seed)
    for table in (*m.tokens.key.values(), *m.tokens.value.values()):
        table.data.copy_(0.1 * torch.randn(table.shape, generator=g))
    return m


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 9), st.lists(st.integers(0, 10), min_size=1, max_size=4, unique=True),
       st.integers(0, 2**16))
def test_lagged_ids_are_the_id_that_many_positions_back_or_the_no_token_row(batch, seq, lags, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    pads = torch.randint(0, seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq)[None] >= pads[:, None]).long()  # left padding
    got = lagged_token_ids(ids, lags, VOCAB, mask)
    for b in range(batch):
        for t in range(seq):
            for i, lag in enumerate(lags):
                want = int(ids[b, t - lag]) if t - lag >= 0 and mask[b, t - lag] else VOCAB
                assert int(got[b, t, i]) == want


@pytest.mark.parametrize("pseudo_count", [0.5, 3.0])
def test_solve_is_the_joint_ridge_solution_on_one_hot_ids(pseudo_count):
    # Few ids, strongly correlated lags: the joint solve, not the per-lag means.
    g = torch.Generator().manual_seed(0)
    vocab, lags, n = 5, 3, 400
    stream = torch.randint(0, vocab, (n + lags,), generator=g)
    stream[1::2] = stream[::2][: len(stream[1::2])]  # every other id repeats the one before
    lagged = torch.stack([stream[lags - a : lags - a + n] for a in range(lags)], 1)
    targets = torch.randn(n, 4, generator=g, dtype=torch.float64)
    got = solve_token_tables(lagged, targets, vocab, pseudo_count=pseudo_count, tolerance=1e-10)
    one_hot = np.zeros((n, lags * (vocab + 1)))
    for a in range(lags):
        one_hot[np.arange(n), a * (vocab + 1) + lagged[:, a].numpy()] = 1
    want = np.linalg.solve(one_hot.T @ one_hot + pseudo_count * np.eye(one_hot.shape[1]), one_hot.T @ targets.numpy())
    np.testing.assert_allclose(got.reshape(-1, 4).numpy(), want, rtol=1e-6, atol=1e-8)


def test_the_cache_adds_the_tables_to_what_the_maps_predict(pair):
    source, target, _, base, residual = pair
    ids = random_ids(1, 24, seed=9)
    held = ids.shape[1] - 1
    positions = torch.arange(held).unsqueeze(0)
    cos, sin = rotary_cos_sin(target.model.rotary_emb, positions, torch.device("cpu"))

    def run(m):
        cache = TransferredCache(prefill(source, ids), m, num_recompute_tokens=1, model=target)
        with torch.no_grad():
            target(ids[:, held:], cache=cache)
        return cache

    # Source-only maps: tables in the stripped space, written out with the reference RoPE.
    plain, tabled = run(base), run(with_random_tables(base, [1, 2]))
    rows = lagged_token_ids(ids[:, :held], [0, 1, 2], VOCAB)[0]
    for t in (1, 2):
        delta = {kind: sum(getattr(tabled.mapper.tokens, kind)[str(t)][a, rows[:, a]] for a in range(3)) for kind in ("key", "value")}
        stripped = apply_rope(plain.layers[t].keys[:, :, :held], cos, -sin)  # RoPE is a rotation: -sin undoes it
        want_k = apply_rope(stripped + delta["key"].view(held, 2, 16).transpose(0, 1)[None], cos, sin)
        want_v = plain.layers[t].values[:, :, :held] + delta["value"].view(held, 2, 16).transpose(0, 1)[None]
        torch.testing.assert_close(tabled.layers[t].keys[:, :, :held], want_k, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(tabled.layers[t].values[:, :, :held], want_v, rtol=1e-4, atol=1e-5)
    # Keys a mapper predicts before the key norm get the tables before the norm too.
    tabled = run(with_random_tables(residual, [2]))
    raw = with_random_tables(residual, [2])
    raw.config = with_input(raw.config, "key_norm", None)
    unnormed = run(raw)
    pre = apply_rope(unnormed.layers[2].keys[:, :, :held], cos, -sin).transpose(1, 2)  # (B, T, H, D)
    with torch.no_grad():
        want = apply_rope(target.model.layers[2].self_attn.k_norm(pre).transpose(1, 2), cos, sin)
    torch.testing.assert_close(tabled.layers[2].keys[:, :, :held], want, rtol=1e-4, atol=1e-5)
    # Layer 1 reads the residual but has no table: unchanged by the tables of layer 2.
    torch.testing.assert_close(tabled.layers[1].keys, run(residual).layers[1].keys)


def test_generate_gives_the_tables_the_prompt_and_refusals_say_why(pair):
    source, target, _, base, _ = pair
    mapper = with_random_tables(base, [1, 2])
    ids = random_ids(1, 20, seed=3)
    src_cache = prefill(source, ids)
    legacy = tuple((layer.keys, layer.values) for layer in src_cache.layers)  # no prompt ids
    with pytest.raises(ValueError, match="token_tables.*input_ids="):
        with torch.no_grad():
            target(ids[:, -1:], cache=TransferredCache(legacy, mapper, num_recompute_tokens=1, model=target))
    # generate's own sequence starts with the prompt: the same answer as with the ids given.
    outs = [target.generate(ids, cache=TransferredCache(c, mapper, model=target), max_new_tokens=4, do_sample=False,
                            output_logits=True, return_dict_in_generate=True) for c in (legacy, src_cache)]  # fmt: skip
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    torch.testing.assert_close(outs[0].logits[0], outs[1].logits[0])
    with pytest.raises(ValueError, match="TransferredCache"):
        mapper(2, torch.zeros(1, 4, 64), torch.zeros(1, 4, 64))
    tables = mapper.config.map_inputs["token_tables"]
    with pytest.raises(ValueError, match=r"map_inputs.token_tables.readers is missing"):
        replace(base.config, map_inputs={"token_tables": {"lags": [0, 1]}})
    with pytest.raises(ValueError, match=r"map_inputs.token_tables.readers must be ascending"):
        with_input(mapper.config, "token_tables", replace(tables, readers=[2, 1]))
    with pytest.raises(ValueError, match=r"map_inputs.token_tables.lags must be distinct"):
        with_input(mapper.config, "token_tables", replace(tables, lags=[1, 1]))


def test_tables_survive_a_round_trip_and_follow_beam_search(pair, tmp_path):
    source, target, _, base, residual = pair
    mapper = with_random_tables(residual, [1, 2])
    mapper.save_pretrained(tmp_path / "m")
    loaded = KVMapper.from_pretrained(tmp_path / "m")
    assert loaded.config.map_inputs["token_tables"] == TokenTableConfig([0, 1, 2], [1, 2])
    for name, tensor in mapper.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.num_parameters() - residual.num_parameters() == token_table_parameters(loaded.config)
    ids = random_ids(1, 18, seed=4)
    # Beam search reorders the cache's rows before the layers are converted: tables follow the rows.
    kw = dict(max_new_tokens=3, num_beams=2, do_sample=False)
    got = target.generate(ids, cache=TransferredCache(prefill(source, ids), loaded, model=target), **kw)
    want = target.generate(ids, cache=TransferredCache(prefill(source, ids), mapper, model=target), **kw)
    assert torch.equal(got, want)


def test_fit_token_tables_fits_what_the_maps_miss(pair):
    source, target, ids, base, residual = pair
    fitted = fit_token_tables(source, target, residual, ids, readers=[1, 2], lags=(0, 1), pseudo_count=1.0)
    assert fitted.config.map_inputs["token_tables"].readers == [1, 2] and fitted.config.num_exact_layers == residual.config.num_exact_layers
    # Independently: what the maps miss on the same tokens (target's own values minus the transferred ones, keys
    # before the key norm for the residual readers), then a dense one-hot ridge solve in numpy.
    cache = TransferredCache(prefill(source, ids), residual, num_recompute_tokens=0, input_ids=ids)
    cache.compute_exact_layers(target).convert_all()
    _, own_values = capture_kv(target, ids)
    for t in (1, 2):
        miss = (own_values[t] - cache.layers[t].values).permute(0, 2, 1, 3).flatten(2).reshape(-1, 32).double().numpy()
        lagged = lagged_token_ids(ids, [0, 1], VOCAB).reshape(-1, 2).numpy()
        one_hot = np.zeros((len(lagged), 2 * (VOCAB + 1)))
        for a in range(2):
            one_hot[np.arange(len(lagged)), a * (VOCAB + 1) + lagged[:, a]] = 1
        want = np.linalg.solve(one_hot.T @ one_hot + np.eye(one_hot.shape[1]), one_hot.T @ miss)
        got = fitted.tokens.value[str(t)].detach().double().reshape(-1, 32).numpy()
        # The solve stops at a relative residual of 1e-3: what the tables predict per token is that close.
        fit_got, fit_want = one_hot @ got, one_hot @ want
        assert np.sqrt(((fit_got - fit_want) ** 2).mean() / (fit_want**2).mean()) < 5e-3
        assert np.sqrt(((fit_want - miss) ** 2).mean()) < np.sqrt((miss**2).mean())  # and they explain part of the miss
    # Both models' states captured once for several fits give the same tables.
    again = fit_token_tables(source, target, residual, ids, readers=[1, 2], lags=(0, 1), pseudo_count=1.0,
                             inputs=capture_table_inputs(source, target, ids, batch_size=4))  # fmt: skip
    for name, tensor in fitted.tokens.state_dict().items():
        torch.testing.assert_close(again.tokens.state_dict()[name], tensor)
    with pytest.raises(ValueError, match="readers must be mapped target layers"):
        fit_token_tables(source, target, residual, ids, readers=[0])


def test_the_search_probes_each_candidate_with_its_tables(pair, monkeypatch):
    source, target, _, base, residual = pair

    def fake_probe(*args, **kwargs):
        return 3, {"tried": [{"num_exact_layers": 1, "retention": 0.1, "retention_ci": [0, 0.2]}], "prefix_len": 64,
                   "copy_gain": {"mean": 5.0, "ci": [4, 6]}, "reason": "the fewest"}  # fmt: skip

    def fake_retention(s, t, m, items, num_exact_layers, **kw):
        ret = 0.99 if m.tokens is not None else 0.5  # only the refined candidate keeps the content
        n = len(items)
        return {"retention": ret, "retention_ci": [ret - 0.01, ret + 0.01],
                "nll_per_item": {"own": [1.0] * n, "no_context": [3.0] * n, "transfer": [3.0 - 2.0 * ret] * n}}

    monkeypatch.setattr(exact_layers, "choose_num_exact_layers", fake_probe)
    monkeypatch.setattr(exact_layers, "repeated_span_retention", fake_retention)
    monkeypatch.setattr(exact_layers, "_time_candidates", steady_timings(lambda m, n: 10.0))
    refined = []

    def refine(m):
        refined.append(m)
        return with_random_tables(m, [1, 2])

    stream = random_ids(1, 600, seed=1)[0].tolist()
    chosen, report = exact_layers.choose_configuration(source, target, base, stream, candidates=[residual],
                                                      refine=refine)  # fmt: skip
    assert refined == [residual] and chosen.tokens is not None and chosen.config.num_exact_layers == 1
    assert "token tables (t, t-1, t-2) on layers 1, 2" in report["chosen_inputs"]


def test_an_undecided_cued_comparison_is_decided_on_more_items(pair, monkeypatch, caplog):
    source, target, _, base, residual = pair
    monkeypatch.setattr(exact_layers, "choose_num_exact_layers", lambda *a, **k: (2, {
        "tried": [{"num_exact_layers": 1, "retention": 0.1, "retention_ci": [0, 0.2]},
                  {"num_exact_layers": 2, "retention": 0.97, "retention_ci": [0.95, 0.99]}], "prefix_len": 64,
        "copy_gain": {"mean": 5.0, "ci": [4, 6]}, "reason": "the fewest"}))
    scored = []

    def fake_retention(s, t, m, items, num_exact_layers, **kw):
        scored.append((kw.get("desc", ""), len(items)))
        n = len(items)
        return {"retention": 0.99, "retention_ci": [0.98, 1.0],
                "nll_per_item": {"own": [1.0] * n, "no_context": [3.0] * n, "transfer": [1.1] * n}}

    # The paired interval is wide on the first items and narrow on all of them (its width shrinks with their count).
    def fake_difference(own, no_context, transfer, reference, **kw):
        half = 0.08 if len(own) <= 4 * 64 else 0.02
        return {"difference": -0.01, "difference_ci": [-0.01 - half, -0.01 + half]}

    monkeypatch.setattr(exact_layers, "repeated_span_retention", fake_retention)
    monkeypatch.setattr(exact_layers, "retention_difference", fake_difference)
    monkeypatch.setattr(exact_layers, "_time_candidates", steady_timings(lambda m, n: 5.0 if m.needs_exact_layers else 10.0))
    stream = random_ids(1, 3000, seed=1)[0].tolist()
    with caplog.at_level("INFO", logger=exact_layers.__name__):
        chosen, report = exact_layers.choose_configuration(source, target, base, stream, candidates=[residual])
    row = next(r for r in report["candidates"] if r.get("residual_layer") == 0)
    assert row["passes"] and row["cued_items"] == 3 * 4 * 64 and chosen.needs_exact_layers
    # what the candidate scored is in the log (the progress bar only counts exact-layer counts)
    assert f"configuration probe, candidate 1: 1 exact, {row['inputs']}: repeated spans 99% [98, 100], cued " \
           "recall 99% [98, 100]: passes" in caplog.messages, caplog.messages
    # The source-only answer and the candidate were both scored on the extra items.
    assert sum(n == 2 * 4 * 64 for _, n in scored) == 2
    # Decided the first time: no extra items.
    monkeypatch.setattr(exact_layers, "retention_difference", lambda *a, **k: {"difference": -0.01, "difference_ci": [-0.03, 0.01]})
    scored.clear()
    _, report = exact_layers.choose_configuration(source, target, base, stream, candidates=[residual])
    assert all(n != 2 * 4 * 64 for _, n in scored)


def test_tables_move_to_another_candidate_of_the_same_layer(pair):
    source, target, ids, base, residual = pair
    fitted = fit_token_tables(source, target, residual, ids, readers=[1, 2], lags=(0, 1))
    # Another candidate of the same residual layer (other maps) gets the same tables on its mapped layers.
    other = replace(residual.config, selected_layers=[[0], [1], [1]])
    other_mapper = KVMapper(other, layer_maps=residual.layers)
    other_mapper.residual = residual.residual
    moved = with_token_tables(other_mapper, fitted.tokens)
    assert moved.config.map_inputs["token_tables"].readers == [1, 2] and moved.config.selected_layers == [[0], [1], [1]]
    for kind in ("key", "value"):
        for t in (1, 2):
            assert torch.equal(getattr(moved.tokens, kind)[str(t)], getattr(fitted.tokens, kind)[str(t)])
    # A mapper computing more layers itself keeps only the tables of the layers it maps.
    deeper = KVMapper(replace(residual.config, num_exact_layers=2), layer_maps=residual.layers)
    deeper.residual = residual.residual
    assert with_token_tables(deeper, fitted.tokens).config.map_inputs["token_tables"].readers == [2]


def test_the_refiner_fits_tables_once_per_residual_layer_and_says_their_memory(pair):
    source, target, ids, base, residual = pair
    lines = []
    refine = table_refiner(source, target, *table_rows(ids, None, 1), lags=(0, 1), log=lines.append)
    first = refine(residual)
    other = KVMapper(replace(residual.config, selected_layers=[[0], [1], [1]]), layer_maps=residual.layers)
    other.residual = residual.residual
    second = refine(other)
    assert first.config.map_inputs["token_tables"].readers == second.config.map_inputs["token_tables"].readers == [1, 2]
    for name, tensor in first.tokens.state_dict().items():
        assert torch.equal(second.tokens.state_dict()[name], tensor)  # shared, not fit again
    assert len(lines) == 1 and "MiB of rows kept" in lines[0]
    # Fit on the sequences the probe does not score (the last one is held out): the same tables as fit directly,
    # with the residual entering layer 0 (the embedding) held in them.
    direct = fit_token_tables(source, target, residual, ids[:-1], readers=[1, 2], lags=(0, 1))
    assert first.config.map_inputs["residual"].in_tables and "first_layer_table" in first.config.map_inputs
    assert not direct.config.map_inputs["residual"].in_tables
    for name, tensor in fold_residual_into_tables(direct, target).tokens.state_dict().items():
        torch.testing.assert_close(first.tokens.state_dict()[name], tensor)


def test_tables_fit_on_more_sequences_than_the_maps(pair):
    source, target, ids, _, residual = pair
    extra = random_ids(3, ids.shape[1], seed=9)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a padded training row keeps its mask; the extra rows are whole
    rows, rows_mask = table_rows(ids, mask, 1, extra, 7)
    # The 5 training rows (the last of 6 is the probe's), then the first 2 extra rows: 7 in all.
    assert torch.equal(rows, torch.cat([ids[:5], extra[:2]]))
    assert torch.equal(rows_mask, torch.cat([mask[:5], torch.ones(2, ids.shape[1], dtype=mask.dtype)]))
    lines = []
    fitted = table_refiner(source, target, rows, rows_mask, lags=(0, 1), log=lines.append)(residual)
    assert "on 7 sequences" in lines[0]
    direct = fit_token_tables(source, target, residual, torch.cat([ids[:5], extra[:2]]), rows_mask, readers=[1, 2],
                              lags=(0, 1))  # fmt: skip
    for name, tensor in fold_residual_into_tables(direct, target).tokens.state_dict().items():
        torch.testing.assert_close(fitted.tokens.state_dict()[name], tensor)
    # Fewer than the training rows: the first of them.
    fewer, _ = table_rows(ids, None, 1, extra, 2)
    assert torch.equal(fewer, ids[:2])
    with pytest.raises(ValueError, match=r"must be \[sequences, 40\]"):
        table_rows(ids, None, 1, extra[:, :10])


def test_the_fit_hands_the_callers_refiner_to_the_probe(pair, monkeypatch):
    # The library's hook (`fit_mapper(..., refine=...)`): the plug-in's refiner reaches the configuration probe
    # unchanged; without one the probe refines nothing (the default fit).
    from hf_kvtransfer.fitting import fit

    source, target, ids, _, _ = pair
    seen = []

    def record(source, target, mapper, ids, mask, config, log=None, searched=(), refine=None, gate=None):
        seen.append(refine)
        return mapper

    monkeypatch.setattr(fit, "with_exact_layers", record)
    refine = table_refiner(source, target, *table_rows(ids, None, 1), lags=(0, 1))
    fit_mapper(source, target, ids, top_k=1, progress=False, refine=refine)
    fit_mapper(source, target, ids, top_k=1, progress=False)
    assert seen == [refine, None]


def random_residual_mapper(base, lags, readers, rank, token_lags, seed):
    """A residual-layer-0 mapper on `base`'s source maps with random residual weights (lags, readers, rank) and
    random tables on every mapped layer at `token_lags`."""
    config = replace(base.config, map_inputs={"residual": ResidualConfig(0, list(lags), rank=rank, readers=list(readers)),
                                              "key_norm": KeyNormConfig()})  # fmt: skip
    m = with_random_tables(KVMapper(config, layer_maps=base.layers), [1, 2], lags=token_lags, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for weight in m.residual.parameters():
        weight.data.copy_(0.2 * torch.randn(weight.shape, generator=g))
    return m


@settings(max_examples=12, deadline=None)
@given(st.sampled_from([(0,), (0, 1), (1, 2), (0, 1, 2)]), st.sampled_from([(1, 2), (2,), (1,)]),
       st.sampled_from([None, 5]), st.booleans(), st.integers(0, 2**16))
def test_the_embedding_residual_held_in_the_tables_transfers_the_same(pair, lags, readers, rank, padded, seed):
    source, target, _, base, _ = pair
    mapper = random_residual_mapper(base, lags, readers, rank, (0, 1, 2, 3), seed)
    folded = fold_residual_into_tables(mapper, target)
    assert folded.config.map_inputs["residual"].in_tables and folded.config.map_inputs["residual"].rank is None
    assert not list(folded.residual.parameters())  # no residual product left
    # Each table row grew by the residual part of that id: the normalised embedding through the reader's weights.
    emb = target.model.embed_tokens.weight.detach().double()
    normed = emb / emb.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    width = emb.shape[1]
    for t in readers:
        weight = mapper.residual.weight("value", t).detach().double()
        if rank is not None:
            weight = weight @ mapper.residual.down.detach().double()
        for i, lag in enumerate(lags):
            grown = folded.tokens.value[str(t)][lag, :VOCAB].double() - mapper.tokens.value[str(t)][lag, :VOCAB].double()
            torch.testing.assert_close(grown, normed @ weight[:, i * width : (i + 1) * width].T, rtol=1e-4, atol=1e-5)
        assert torch.equal(folded.tokens.key[str(t)][:, VOCAB], mapper.tokens.key[str(t)][:, VOCAB])  # "no token"
    # The transfer: the same keys and values as with the residual product, padded rows included.
    ids = random_ids(2, 21, seed=seed % 97)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :6] = 0
    outs = []
    for m in (mapper, folded):
        cache = TransferredCache(prefill(source, ids, mask), m, num_recompute_tokens=1, model=target)
        with torch.no_grad():
            logits = target(ids[:, -1:], attention_mask=mask, cache=cache).logits
        outs.append((logits, cache))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-4)
    for t in (1, 2):
        for kind in ("keys", "values"):
            torch.testing.assert_close(getattr(outs[1][1].layers[t], kind), getattr(outs[0][1].layers[t], kind),
                                       rtol=1e-4, atol=1e-5)  # fmt: skip


def test_folding_refuses_what_it_cannot_hold_and_survives_a_round_trip(pair, tmp_path):
    source, target, _, base, residual = pair
    mapper = random_residual_mapper(base, (0, 1, 2), (1, 2), None, (0, 1, 2, 3), seed=3)
    with pytest.raises(ValueError, match="must cover the residual readers"):
        fold_residual_into_tables(random_residual_mapper(base, (0, 2), (1, 2), None, (0, 1), seed=3), target)
    with pytest.raises(ValueError, match=r"map_inputs.residual.layer 0"):
        fold_residual_into_tables(base, target)  # no residual, no tables
    inputs = mapper.config.map_inputs
    with pytest.raises(ValueError, match=r"map_inputs.residual.in_tables needs layer 0"):  # layer 1 reads the residual, no table
        replace(mapper.config, map_inputs={**inputs, "token_tables": replace(inputs["token_tables"], readers=[2]),
                                           "residual": replace(inputs["residual"], in_tables=True)})  # fmt: skip
    with pytest.raises(ValueError, match=r"map_inputs.residual.layer is missing \(this input needs layer, lags\)"):
        replace(base.config, map_inputs={"residual": {"in_tables": True}})
    folded = fold_residual_into_tables(mapper, target)
    with pytest.raises(ValueError, match="not in them already"):
        fold_residual_into_tables(folded, target)
    folded.save_pretrained(tmp_path / "m")
    loaded = KVMapper.from_pretrained(tmp_path / "m")
    assert loaded.config.map_inputs["residual"].in_tables
    assert "held in rows per token id" in (tmp_path / "m" / "README.md").read_text()  # the card says so
    assert mapper.num_parameters() - loaded.num_parameters() == sum(p.numel() for p in mapper.residual.parameters())
    ids = random_ids(1, 16, seed=8)
    kw = dict(max_new_tokens=3, do_sample=False)
    got = target.generate(ids, cache=TransferredCache(prefill(source, ids), loaded, model=target), **kw)
    want = target.generate(ids, cache=TransferredCache(prefill(source, ids), mapper, model=target), **kw)
    assert torch.equal(got, want)
    # A model whose layer-0 input depends on the position cannot hold it in tables.
    shifted = tiny_model("qwen3", num_hidden_layers=3, seed=1)
    hook = shifted.model.embed_tokens.register_forward_hook(
        lambda module, args, out: out + 0.1 * torch.arange(out.shape[1], dtype=out.dtype)[:, None])
    with pytest.raises(ValueError, match="depends on more than the token id"):
        token_residuals(shifted)
    hook.remove()
    torch.testing.assert_close(token_residuals(shifted), shifted.model.embed_tokens.weight.detach())


@settings(max_examples=10, deadline=None)
@given(st.sampled_from(["qwen3", "llama3-scaling", "yarn"]), st.integers(1, 3), st.booleans(), st.integers(0, 2**16))
def test_the_first_layer_looked_up_is_the_targets_own(arch, batch, padded, seed):
    # Independent of the cache: the target's own layer-0 K/V from its own forward, padded rows included.
    source = tiny_model(arch, num_hidden_layers=2, seed=0)
    target = tiny_model(arch, num_hidden_layers=3, seed=1)
    ids = random_ids(batch, 19, seed=seed)
    mask = torch.ones_like(ids)
    if padded:
        mask[-1, :5] = 0
    base = fit_mapper(source, target, random_ids(2, 24, seed=seed + 1), top_k=1, num_exact_layers=1, heldout_fraction=0,
                      residual_inputs="off", progress=False)  # fmt: skip
    mapper = tabulate_first_layer(base, target)
    assert "first_layer_table" in mapper.config.map_inputs and base.first_layer is None
    cache = TransferredCache(prefill(source, ids, mask), mapper, attention_mask=mask, num_recompute_tokens=0, input_ids=ids)
    cache.compute_exact_layers(target).convert_all()
    own = prefill(target, ids, mask).layers  # the target's own cache: keys with its RoPE
    keep = mask.bool()
    for got, want in ((cache.layers[0].keys, own[0].keys), (cache.layers[0].values, own[0].values)):
        torch.testing.assert_close(got.transpose(1, 2)[keep], want.transpose(1, 2)[keep], rtol=1e-4, atol=1e-5)
    # The same answer as the projections give, through generate; more exact layers do not use the table.
    kw = dict(max_new_tokens=3, do_sample=False, attention_mask=mask)
    outs = [target.generate(ids, cache=TransferredCache(prefill(source, ids, mask), m, attention_mask=mask, model=target), **kw)
            for m in (mapper, base)]  # fmt: skip
    assert torch.equal(outs[0], outs[1])
    deeper = TransferredCache(prefill(source, ids, mask), mapper, attention_mask=mask, num_exact_layers=2,
                              num_recompute_tokens=0, input_ids=ids).compute_exact_layers(target)  # fmt: skip
    torch.testing.assert_close(deeper.convert_all().layers[1].keys.transpose(1, 2)[keep],
                               own[1].keys.transpose(1, 2)[keep], rtol=1e-4, atol=1e-5)  # fmt: skip


def test_a_first_layer_that_is_not_a_look_up_is_refused_and_the_table_survives_a_round_trip(pair, tmp_path):
    source, target, _, base, _ = pair
    mapper = tabulate_first_layer(base, target)
    mapper.save_pretrained(tmp_path / "m")
    loaded = KVMapper.from_pretrained(tmp_path / "m")
    assert "first_layer_table" in loaded.config.map_inputs
    assert "looked up per token id" in (tmp_path / "m" / "README.md").read_text()
    assert loaded.num_parameters() - base.num_parameters() == 2 * VOCAB * base.target_layout.layer_dim
    for name, tensor in mapper.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    shifted = tiny_model("qwen3", num_hidden_layers=3, seed=1)
    shifted.model.embed_tokens.register_forward_hook(
        lambda module, args, out: out + 0.1 * torch.arange(out.shape[1], dtype=out.dtype)[:, None])
    with pytest.raises(ValueError, match="cannot be looked up"):
        tabulate_first_layer(base, shifted)
    # A bf16 target rounds its products differently at other shapes: still a look-up, to its own precision.
    half = tiny_model("qwen3", num_hidden_layers=3, seed=1).to(torch.bfloat16)
    own = prefill(half, (ids := random_ids(1, 12, seed=2))).layers[0]
    cache = TransferredCache(prefill(source, ids), tabulate_first_layer(base, half), num_recompute_tokens=0, input_ids=ids)
    got = cache.compute_exact_layers(half).convert_all().layers[0]
    torch.testing.assert_close(got.keys.float(), own.keys.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.values.float(), own.values.float(), rtol=2e-2, atol=2e-2)


# -- plan: the plug-in's costs, once it is imported (`MapInput.cost`) ----------------------------------------------


def test_plan_costs_the_tables_a_mapper_holds():
    # Independent: the parameters of a real mapper with tables and a layer-0 table, built from the tiny target.
    from transformers import Qwen3Config

    from hf_kvtransfer import MapperConfig
    from hf_kvtransfer.commands.plan import format_plan, plan_transfer

    def tiny(layers, kv_heads, head_dim, heads=4):
        return Qwen3Config(num_hidden_layers=layers, num_key_value_heads=kv_heads, head_dim=head_dim,
                           num_attention_heads=heads, hidden_size=64, intermediate_size=128, vocab_size=96,
                           max_position_embeddings=256)  # fmt: skip

    source, target = tiny(3, 2, 16), tiny(5, 4, 8, heads=8)
    base = MapperConfig(source_config=source.to_dict(), target_config=target.to_dict(), selected_layers=[[0]] * 5)
    with_tables = KVMapper(replace(base, map_inputs={"token_tables": {"lags": [0, 1, 2], "readers": [2]}}))
    looked_up = KVMapper(replace(base, map_inputs={"first_layer_table": {}}))
    plain = KVMapper(base).num_parameters()
    plan = plan_transfer(source, target, top_k=1, input_positions={"token_positions": 3}, dtype="float32",
                         use_hub=False, available_memory=2**40, num_exact_layers=4)  # fmt: skip
    # One mapped layer (4 of 5 exact): the tables of one layer.
    assert plan.map_inputs["token_tables"]["parameters"] == with_tables.num_parameters() - plain
    assert plan.map_inputs["token_tables"]["bytes"] == 4 * plan.map_inputs["token_tables"]["parameters"]
    assert plan.map_inputs["first_layer_table"]["bytes"] == 4 * (looked_up.num_parameters() - plain)
    assert "  layer 0's keys and values per token id: 24.00 KiB, no FLOPs (a look-up)" in format_plan(plan)  # 2 x 96 x 32 x 4 B


def test_plan_says_the_tables_are_not_practical_at_real_shapes():
    # Qwen3 14B -> 32B, 1 exact layer: tables on the 63 mapped layers at 4 positions (the plug-in's default), keys and
    # values, one row per id (151,936 + "no token") of 8 KV heads x 128, in bfloat16; the target's own weights from its
    # config (meta device).
    from hf_kvtransfer.commands.plan import format_plan, plan_transfer

    plan = plan_transfer("Qwen/Qwen3-14B", "Qwen/Qwen3-32B", top_k=8, seq_len=4096, use_hub=False, num_exact_layers=1,
                         available_memory=2**40)  # fmt: skip
    tables = 63 * 2 * 4 * (151936 + 1) * 8 * 128 * 2
    assert plan.map_inputs["token_tables"]["bytes"] == tables and round(tables / 2**30) == 146
    target_bytes = 2 * plan.model_parameters["target"]
    assert tables > target_bytes > 60 * 2**30  # more than the model itself: not practical
    text = format_plan(plan)
    assert f"  token tables (4 positions): 146.06 GiB, no FLOPs (a look-up); {tables / target_bytes:.2f}x the target's own " \
           "weights (61.02 GiB): not practical at this shape" in text


# -- loading: the plug-in is what makes its mappers load -------------------------------------------------------------


@pytest.mark.parametrize("kind, name", [("token-tables", "token_tables"), ("first-layer-table", "first_layer_table")])
def test_without_the_plugin_a_mapper_with_its_inputs_is_refused_in_one_line(kind, name, monkeypatch):
    from hf_kvtransfer.core import map_inputs
    from mapper_kinds import FIXTURES, NESTED_FIXTURES

    for root in (FIXTURES, NESTED_FIXTURES):  # an older flat config, migrated, and the nested one
        assert KVMapper.from_pretrained(root / kind).config.map_inputs[name] is not None  # with the plug-in
        # Registration is global: the plug-in's inputs taken out of the registry for this test only.
        library = {k: v for k, v in map_inputs.MAP_INPUTS.items() if k not in ("token_tables", "first_layer_table")}
        monkeypatch.setattr(map_inputs, "MAP_INPUTS", library)
        with pytest.raises(ValueError, match=rf"^map_inputs\.{name}: unknown map input .*registers itself when its "
                           r"module is imported \(register_map_input\)") as refused:  # fmt: skip
            KVMapper.from_pretrained(root / kind)
        assert "\n" not in str(refused.value)
        monkeypatch.undo()
