"""The per-request quality gate (`core/quality_gate.py`): the score against numpy, the threshold rule, and the gate's
place in the mapper's config (saved, loaded, absent from mappers saved before it)."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import random_ids, scrambled_mapper

from hf_kvtransfer.core.quality_gate import QualityGateConfig, TransferStatus, gate_scores, passes


def _pairs(g, batch=3, layers=4, shape=(2, 5, 8)):
    return [(torch.randn(batch, *shape, generator=g), torch.randn(batch, *shape, generator=g)) for _ in range(layers)]


def _numpy_score(predicted, exact):
    """Worst cosine over layers and K/V per row, written independently with numpy."""
    batch = predicted[0][0].shape[0]
    out = np.full(batch, np.inf)
    for (pk, pv), (ek, ev) in zip(predicted, exact):
        for p, e in ((pk, ek), (pv, ev)):
            p, e = p.numpy().reshape(batch, -1).astype(np.float64), e.numpy().reshape(batch, -1).astype(np.float64)
            cos = (p * e).sum(1) / (np.linalg.norm(p, axis=1) * np.linalg.norm(e, axis=1))
            out = np.minimum(out, cos)
    return out


def test_score_matches_numpy():
    g = torch.Generator().manual_seed(0)
    exact = _pairs(g)
    predicted = [(k + 0.3 * torch.randn(k.shape, generator=g), v + 0.1 * (i + 1) * torch.randn(v.shape, generator=g))
                 for i, (k, v) in enumerate(exact)]  # fmt: skip
    np.testing.assert_allclose(gate_scores(predicted, exact).numpy(), _numpy_score(predicted, exact), rtol=1e-5)


def test_score_is_one_for_exact_prediction_and_lower_for_one_bad_row():
    g = torch.Generator().manual_seed(1)
    exact = _pairs(g)
    predicted = [(k.clone(), v.clone()) for k, v in exact]
    predicted[2][1][1] = torch.randn(predicted[2][1][1].shape, generator=g)  # row 1, layer 2's values: noise
    scores = gate_scores(predicted, exact)
    assert scores[0] == pytest.approx(1.0, abs=1e-6) and scores[2] == pytest.approx(1.0, abs=1e-6)
    assert scores[1] < 0.5


def test_score_refuses_mismatched_layers():
    g = torch.Generator().manual_seed(2)
    with pytest.raises(ValueError, match="one \\(key, value\\) pair per layer"):
        gate_scores(_pairs(g, layers=2), _pairs(g, layers=3))


def test_passes_thresholds_rows_and_lets_all_through_without_gate():
    scores = torch.tensor([0.99, 0.5, 0.9])
    assert passes(scores, QualityGateConfig(threshold=0.9)).tolist() == [True, False, True]
    assert passes(scores, None).tolist() == [True, True, True]


def test_status_names_fallback_rows():
    status = TransferStatus(applied=(True, False), scores=(0.99, 0.2), threshold=0.9)
    assert status.reason == "quality gate" and status.fallback_rows == [1]
    # the vLLM connector's words for a request's status, one vocabulary for both
    from hf_kvtransfer.integrations.transfer_status import APPLIED, FALLBACK

    assert status.statuses == (APPLIED, FALLBACK) == ("applied", "fallback")
    assert TransferStatus(applied=(True, True)).reason is None


def test_gate_config_refuses_out_of_range_threshold():
    with pytest.raises(ValueError, match="threshold is a cosine"):
        QualityGateConfig(threshold=1.5)


def test_gate_saved_and_loaded_with_mapper(identity_mapper, tmp_path):
    from hf_kvtransfer import KVMapper

    mapper = KVMapper(dataclasses.replace(identity_mapper.config, quality_gate=QualityGateConfig(0.97, 0.01, 200, 256)),
                      identity_mapper.layers)  # fmt: skip
    mapper.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quality_gate"]
    assert saved == {"threshold": 0.97, "quantile": 0.01, "num_prompts": 200, "prompt_length": 256}
    assert KVMapper.from_pretrained(tmp_path).config.quality_gate == QualityGateConfig(0.97, 0.01, 200, 256)
    # The card a user reads on the Hub says what the gate does to a request, with its threshold and where it came from.
    card = (tmp_path / "README.md").read_text()
    assert "**Per-request quality gate**: a request row whose mapped K/V come within a cosine of 0.9700" in card
    assert "the 0.01 quantile of the score over 200 held-out prompts of 256 tokens" in card


def test_mapper_saved_before_the_gate_loads_without_one(identity_mapper, tmp_path):
    from hf_kvtransfer import KVMapper

    identity_mapper.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data.pop("quality_gate", None)  # a config.json written before the field existed
    path.write_text(json.dumps(data))
    assert KVMapper.from_pretrained(tmp_path).config.quality_gate is None


# -- the gate in TransferredCache ----------------------------------------------------------------------------------


def _transfer_logits(model, mapper, ids, **kwargs):
    from hf_kvtransfer import TransferredCache, prefill

    cache = TransferredCache(prefill(model, ids), mapper, model=model, **kwargs)
    with torch.no_grad():
        logits = model(ids[:, -cache.num_recompute_tokens :], cache=cache).logits
    return logits, cache


def test_rows_below_the_threshold_get_the_targets_own_prefill(qwen3_model, scrambled):
    ids = random_ids(2, 24, seed=7)
    with torch.no_grad():
        own = qwen3_model(ids).logits[:, -8:]
    ungated, _ = _transfer_logits(qwen3_model, scrambled, ids, num_recompute_tokens=8, gate=False)
    assert (ungated - own).abs().max() > 1e-2  # the scrambled maps alone do not give the target's answer
    # Threshold above every row's score: both rows fall back, and the call returns the target's own logits.
    gated, cache = _transfer_logits(qwen3_model, scrambled, ids, num_recompute_tokens=8, gate=QualityGateConfig(0.999))
    assert cache.transfer_status.applied == (False, False) and cache.transfer_status.reason == "quality gate"
    torch.testing.assert_close(gated, own, rtol=1e-4, atol=1e-4)


def test_gated_cache_serves_a_forward_of_more_rows_than_its_prompt(qwen3_model, scrambled):
    # Several continuations of one prompt scored in one batch (eval's answer scoring, beams): the gated cache is
    # repeated to the forward's rows like the maps' path. With every row falling back, each continuation's logits are
    # the target's own on [prompt + continuation].
    from hf_kvtransfer import TransferredCache, prefill

    ids = random_ids(1, 24, seed=9)
    conts = random_ids(3, 2, seed=10)
    cache = TransferredCache(prefill(qwen3_model, ids), scrambled, num_recompute_tokens=8, gate=QualityGateConfig(0.999), model=qwen3_model)
    feed = torch.cat([ids[:, -8:].expand(3, -1), conts], dim=1)
    with torch.no_grad():
        gated = qwen3_model(feed, cache=cache).logits
        own = qwen3_model(torch.cat([ids.expand(3, -1), conts], dim=1)).logits[:, -10:]
    assert cache.transfer_status.applied == (False,)
    torch.testing.assert_close(gated, own, rtol=1e-4, atol=1e-4)


def test_rows_above_the_threshold_keep_the_transfer(qwen3_model, scrambled):
    ids = random_ids(2, 24, seed=8)
    ungated, _ = _transfer_logits(qwen3_model, scrambled, ids, num_recompute_tokens=8, gate=False)
    gated, cache = _transfer_logits(qwen3_model, scrambled, ids, num_recompute_tokens=8, gate=QualityGateConfig(-1.0))
    assert cache.transfer_status.applied == (True, True) and cache.transfer_status.reason is None
    torch.testing.assert_close(gated, ungated, rtol=1e-4, atol=1e-4)
    # The score is the worst-layer cosine of the mapped K/V against the target's own on the recomputed tokens.
    from hf_kvtransfer import TransferredCache, prefill

    full = TransferredCache(prefill(qwen3_model, ids), scrambled, num_recompute_tokens=0, model=qwen3_model, gate=False)
    full.convert_all()
    # Reference: the target's own K/V on the recomputed tokens given the transferred context, from a forward on a
    # cache holding the mapped K/V of the first 16 tokens.
    from transformers import DynamicCache

    probe = DynamicCache(config=qwen3_model.config)
    for i, layer in enumerate(full.layers):
        probe.update(layer.keys[:, :, :16], layer.values[:, :, :16], i)
    with torch.no_grad():
        qwen3_model(ids[:, 16:], cache=probe)
    expected = _numpy_score([(l.keys[:, :, 16:], l.values[:, :, 16:]) for l in full.layers],
                            [(l.keys[:, :, 16:], l.values[:, :, 16:]) for l in probe.layers])  # fmt: skip
    np.testing.assert_allclose(np.array(cache.transfer_status.scores), expected, rtol=1e-4)


def test_gate_false_and_mappers_without_a_gate_leave_the_transfer_alone(qwen3_model, identity_mapper):
    ids = random_ids(1, 24, seed=9)
    logits, cache = _transfer_logits(qwen3_model, identity_mapper, ids, num_recompute_tokens=8)
    assert identity_mapper.config.quality_gate is None
    assert cache.transfer_status.applied == (True,) and cache.transfer_status.scores is None


@pytest.fixture(scope="module")
def scrambled(identity_mapper):
    return scrambled_mapper(identity_mapper)


# -- calibration in the fit ------------------------------------------------------------------------------------------


def test_calibrated_threshold_is_the_quantile_of_heldout_scores(qwen3_model, identity_mapper):
    from hf_kvtransfer.fitting.quality_gate import calibrate_quality_gate

    heldout = random_ids(6, 40, seed=11)
    mapper = calibrate_quality_gate(qwen3_model, qwen3_model, scrambled_mapper(identity_mapper), heldout, 0.25)
    # The scores, each from its own one-row transfer (the row's own worst-layer cosine), and numpy's quantile of them.
    scores = []
    for row in heldout:
        _, cache = _transfer_logits(qwen3_model, mapper, row[None], gate=QualityGateConfig(-1.0))
        scores.append(cache.transfer_status.scores[0])
    gate = mapper.config.quality_gate
    assert gate.threshold == pytest.approx(float(np.quantile(scores, 0.25)), abs=1e-5)
    assert (gate.quantile, gate.num_prompts, gate.prompt_length) == (0.25, 6, 40)


def test_fit_records_a_gate_only_when_asked(qwen3_model, calibration_ids, identity_mapper):
    from hf_kvtransfer import fit_mapper

    assert identity_mapper.config.quality_gate is None  # the default fit: no gate, as before
    mapper = fit_mapper(qwen3_model, qwen3_model, calibration_ids, top_k=1, ridge_lambda=1e-4, progress=False,
                        quality_gate_quantile=0.01)  # fmt: skip
    gate = mapper.config.quality_gate
    assert gate.num_prompts == 2 and gate.prompt_length == 64  # the 10% held-out rows of 24
    assert gate.threshold > 0.99  # a near-identity map of a model onto itself scores close to 1


def test_cli_fit_flag_sets_the_quantile():
    from hf_kvtransfer.commands import cli

    args = cli.build_parser().parse_args(["fit", "--source", "s", "--target", "t", "--output", "o", "--quality-gate-quantile", "0.01"])
    assert cli.fit_config_from_args(args).quality_gate_quantile == 0.01
    args = cli.build_parser().parse_args(["fit", "--source", "s", "--target", "t", "--output", "o"])
    assert cli.fit_config_from_args(args).quality_gate_quantile is None


def test_generate_on_a_gated_cache_gives_the_targets_own_tokens_for_fallback_rows(qwen3_model, scrambled):
    from hf_kvtransfer import TransferredCache, prefill

    ids = random_ids(2, 24, seed=3)
    own = qwen3_model.generate(ids, max_new_tokens=8, do_sample=False)
    ungated = qwen3_model.generate(ids, cache=TransferredCache(prefill(qwen3_model, ids), scrambled, gate=False, model=qwen3_model),
                                   max_new_tokens=8, do_sample=False)  # fmt: skip
    assert not torch.equal(ungated, own)  # the scrambled maps alone change the answer
    cache = TransferredCache(prefill(qwen3_model, ids), scrambled, gate=QualityGateConfig(0.999), model=qwen3_model)
    assert torch.equal(qwen3_model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False), own)
    assert cache.transfer_status.fallback_rows == [0, 1]
