"""The exact pass over a local window (`core/local_attention.py`, `MapperConfig.exact_window`): each checked against
an independent computation: dense attention under a banded mask, the target's own forward of only the window's
tokens, and transformers' own forward under a banded 4D mask."""

import pytest
import torch
import torch.nn.functional as F

from conftest import ARCHITECTURES, exact_identity_mapper, left_pad, random_ids, tiny_model
from hf_kvtransfer import KVMapper, MapperConfig, TransferredCache, prefill
from hf_kvtransfer.core.defaults import resolve_transfer
from hf_kvtransfer.core.exact import own_prefix
from hf_kvtransfer.core.flops import exact_layers_flops, prefill_flops
from hf_kvtransfer.core.local_attention import attend_within, causal_pairs, local_attention


def _banded(n: int, window: int) -> torch.Tensor:
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= i) & (i - j < window)


def _layer():
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2  # what transformers' SDPA path reads of a layer
    return module


@pytest.mark.parametrize("n,window", [(100, 16), (97, 32), (64, 64), (40, 8), (33, 1), (9, 40)])
def test_blocked_local_attention_is_dense_attention_under_a_band(n, window):
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(2, h, n, 8, generator=g) for h in (4, 2, 2))
    got, _ = local_attention(window)(_layer(), q, k, v, None, scaling=0.3)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=_banded(n, window), scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_a_padding_mask_is_kept_inside_the_window():
    g = torch.Generator().manual_seed(1)
    n, window = 50, 8
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for _ in range(3))
    keep = torch.ones(2, n, dtype=torch.bool)
    keep[1, :13] = False  # row 1 left-padded by 13
    mask = _banded(n, n)[None, None] & keep[:, None, None, :]
    got, _ = local_attention(window)(_layer(), q, k, v, mask, scaling=0.5)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=_banded(n, window)[None, None] & mask, scale=0.5)
    assert torch.isfinite(got).all()  # padding queries that see nothing in their window stay finite
    torch.testing.assert_close(got[1, 13:], want.transpose(1, 2)[1, 13:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], want.transpose(1, 2)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch,window", [("qwen3", 1), ("qwen3", 4)] + [(arch, 7) for arch in sorted(ARCHITECTURES)])
def test_windowed_exact_keys_are_the_target_reading_only_the_window(arch, window):
    """With 2 exact layers, layer 1's keys and values at position i depend on layer 0's output there, which with a
    window sees tokens i-W+1..i only: the target's own forward of just those tokens, at their positions, gives them
    (for every supported architecture: scaled and partial RoPE, a fused QKV projection)."""
    model = tiny_model(arch, num_hidden_layers=3, seed=2)
    ids = random_ids(1, 24, seed=3)
    positions = torch.arange(24)[None]
    kv, hidden = own_prefix(model, ids, None, positions, 2, hidden_of=1, window=window)
    for i in (0, window - 1, 11, 23):
        lo = max(0, i - window + 1)
        ref, ref_hidden = own_prefix(model, ids[:, lo : i + 1], None, positions[:, lo : i + 1], 2, hidden_of=1)
        torch.testing.assert_close(kv[1][0][:, :, i], ref[1][0][:, :, -1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv[1][1][:, :, i], ref[1][1][:, :, -1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hidden[:, i], ref_hidden[:, -1], rtol=1e-5, atol=1e-5)
    whole = own_prefix(model, ids, None, positions, 2)
    assert not torch.allclose(kv[1][0], whole[1][0], atol=1e-4)  # the window changed what layer 1 holds
    torch.testing.assert_close(kv[0][0], whole[0][0])  # layer 0's keys read no attention
    assert model.config._attn_implementation == "eager"  # the model's own attention restored


def test_a_left_padded_row_gets_the_keys_of_its_unpadded_prompt():
    model = tiny_model("qwen3", num_hidden_layers=3, seed=2)
    ids = random_ids(2, 30, seed=6)
    padded, mask = left_pad(ids, [30, 21])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    kv = own_prefix(model, padded, mask, positions, 3, window=5)
    alone = own_prefix(model, ids[1:, 9:], None, torch.arange(21)[None], 3, window=5)
    for t in range(3):
        torch.testing.assert_close(kv[t][0][1:, :, 9:], alone[t][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(kv[t][1][1:, :, 9:], alone[t][1], rtol=1e-4, atol=1e-5)


def test_a_mapper_with_a_window_gives_the_target_under_a_banded_prefill():
    """Every layer exact, a window of 6, the last token recomputed: the logits are the target's when its prefix was
    prefilled under transformers' own banded 4D mask and the last token then attended to all of it."""
    model = tiny_model("qwen3", num_hidden_layers=3, seed=4)
    mapper = exact_identity_mapper(model)
    mapper.config = MapperConfig.from_dict({**mapper.config.to_dict(), "exact_window": 6})
    ids = random_ids(1, 40, seed=7)
    with torch.no_grad():
        cache = TransferredCache(prefill(model, ids), mapper, num_exact_layers=3, num_recompute_tokens=1, model=model)
        got = model(ids[:, -1:], cache=cache).logits
        sdpa = tiny_model("qwen3", num_hidden_layers=3, seed=4, attn_implementation="sdpa")
        sdpa.config._attn_implementation = "sdpa"
        prefix = sdpa(ids[:, :-1], attention_mask=_banded(39, 6)[None, None], use_cache=True).past_key_values
        want = sdpa(ids[:, -1:], cache=prefix).logits
        plain = TransferredCache(prefill(model, ids), mapper, num_exact_layers=3, num_recompute_tokens=1, model=model,
                                 exact_window=0)  # fmt: skip
        whole = model(ids[:, -1:], cache=plain).logits
    assert cache.exact_window == 6 and plain.exact_window is None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(whole, want, atol=1e-3)


def test_the_window_is_saved_with_the_mapper_and_absent_when_unset(tmp_path):
    model = tiny_model("qwen3", num_hidden_layers=2)
    mapper = exact_identity_mapper(model)
    assert "exact_window" not in mapper.config.to_dict()  # configs saved before the field load unchanged
    mapper.config = MapperConfig.from_dict({**mapper.config.to_dict(), "exact_window": 64})
    mapper.save_pretrained(tmp_path)
    assert KVMapper.from_pretrained(tmp_path).config.exact_window == 64
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="exact_window must be an integer >= 1"):
            MapperConfig.from_dict({**mapper.config.to_dict(), "exact_window": bad})


def test_a_callers_window_overrides_the_mappers_and_zero_means_the_whole_prompt():
    model = tiny_model("qwen3", num_hidden_layers=2)
    mapper = exact_identity_mapper(model)
    assert resolve_transfer(mapper, 100).exact_window is None
    mapper.config = MapperConfig.from_dict({**mapper.config.to_dict(), "exact_window": 64})
    assert resolve_transfer(mapper, 100).exact_window == 64
    assert resolve_transfer(mapper, 100, exact_window=16).exact_window == 16
    assert resolve_transfer(mapper, 100, exact_window=0).exact_window is None
    with pytest.raises(ValueError, match="0 for the whole prompt"):
        resolve_transfer(mapper, 100, exact_window=-1)


@pytest.mark.parametrize("n,window", [(10, None), (10, 3), (10, 10), (10, 50), (1, 1)])
def test_causal_pairs_counts_the_band(n, window):
    assert causal_pairs(n, window) == int(_banded(n, window or n).sum())


def test_windowed_exact_flops_count_the_band_only_in_attention():
    config = tiny_model("qwen3", num_hidden_layers=3).config
    whole, local = prefill_flops(config, 200, num_layers=2), prefill_flops(config, 200, num_layers=2, window=16)
    assert whole["projections"] == local["projections"]
    assert local["attention"] * causal_pairs(200) == whole["attention"] * causal_pairs(200, 16)
    assert exact_layers_flops(config, 200, 3, window=16) < exact_layers_flops(config, 200, 3)
    assert exact_layers_flops(config, 200, 1, window=16) == exact_layers_flops(config, 200, 1)  # no attention runs


def test_attend_within_restores_the_models_attention_after_an_error():
    model = tiny_model("qwen3", num_hidden_layers=2)
    with pytest.raises(RuntimeError), attend_within(model, 8):
        raise RuntimeError
    assert model.config._attn_implementation == "eager"


# -- the fit's choice (`fitting/exact_window.py`)

from types import SimpleNamespace  # noqa: E402

from hf_kvtransfer.core.card import render_model_card  # noqa: E402
from hf_kvtransfer.fitting import exact_window  # noqa: E402
from hf_kvtransfer.fitting.config import FitConfig, parse_exact_window  # noqa: E402


class _Gate:
    """A content gate whose verdict is a function of the window the judged mapper records; its probe prompts are
    `lengths` tokens long."""

    tolerance = 0.05

    def __init__(self, accepts, lengths=(300, 500)):
        self.accepts, self.judged = accepts, []
        self.items = {"recall": [SimpleNamespace(prompt_ids=[0] * n) for n in lengths], "handoff": []}

    def judge(self, mapper, num_exact):
        window = mapper.config.exact_window
        self.judged.append((window, num_exact))
        ok = self.accepts(window)
        d = {"difference": 0.0 if ok else -0.2, "difference_ci": [-0.01, 0.01] if ok else [-0.3, -0.1], "num_items": 8}
        return {"accepted": ok, "tolerance": 0.05, "tasks": {"recall": d, "handoff": d}}


def _with_exact(mapper, n):
    mapper.config = MapperConfig.from_dict({**mapper.config.to_dict(), "num_exact_layers": n})
    return mapper


def test_the_fit_records_the_smallest_window_the_gate_accepts():
    base = _with_exact(exact_identity_mapper(tiny_model("qwen3", num_hidden_layers=4)), 3)
    gate = _Gate(lambda w: w is not None and w >= 128)
    chosen = exact_window.with_exact_window(base, gate, "auto", log=lambda line: None)
    # powers of two from 64 up to half the shortest probe prompt (300 // 2 = 150), smallest first
    assert gate.judged == [(64, 3), (128, 3)]
    assert chosen.config.exact_window == 128 and base.config.exact_window is None  # the caller's mapper untouched
    assert chosen.report["exact_window"]["candidates"] == [64, 128]
    none = exact_window.with_exact_window(base, _Gate(lambda w: False), "auto", log=lambda line: None)
    assert none.config.exact_window is None and "no window" in none.report["exact_window"]["reason"]
    card = render_model_card(chosen.config.to_dict(), report=chosen.report).text
    assert "the last 128 tokens up to each token" in card and "64: rejected; 128: accepted" in card


@pytest.mark.parametrize("num_exact,lengths,why", [(1, (300,), "one exact layer"), (4, (300,), "every layer is exact"),
                                                   (3, (100,), "too short")])
def test_no_window_is_searched_where_the_gate_could_not_see_what_it_changes(num_exact, lengths, why):
    base = _with_exact(exact_identity_mapper(tiny_model("qwen3", num_hidden_layers=4)), num_exact)
    gate = _Gate(lambda w: True, lengths)
    chosen = exact_window.with_exact_window(base, gate, "auto", log=lambda line: None)
    assert chosen.config.exact_window is None and gate.judged == []
    assert why in chosen.report["exact_window"]["reason"]


def test_the_gate_judges_each_window_through_the_windowed_exact_pass(monkeypatch):
    """The real content gate on the bundled small model (an identity mapper, 3 exact layers): each window it judges
    reaches the exact pass (`attend_within` is entered with it), and the whole prompt never is."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_kvtransfer.core import exact as exact_module
    from hf_kvtransfer.fitting.content_gate import ContentGate

    family = Path(__file__).resolve().parent.parent / "examples" / "family"
    if not (family / "small").is_dir():
        pytest.skip("bundled family not in examples/family")
    model = AutoModelForCausalLM.from_pretrained(family / "small", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(family / "small")
    seen = []
    real = exact_module.attend_within

    def spy(m, window):
        seen.append(window)
        return real(m, window)

    monkeypatch.setattr(exact_module, "attend_within", spy)
    gate = ContentGate(model, model, tokenizer, None, tolerance=0.05, num_items=6, max_items=6)
    base = _with_exact(exact_identity_mapper(model), 3)
    with torch.no_grad():
        chosen = exact_window.with_exact_window(base, gate, "auto", log=lambda line: None)
    tried = [row["window"] for row in chosen.report["exact_window"]["tried"]]
    assert tried and set(seen) == set(tried)


def test_fit_config_window_grammar_and_a_given_window_is_recorded(qwen3_model, calibration_ids):
    from hf_kvtransfer import fit_mapper

    assert [parse_exact_window(v) for v in ("auto", "none", None, "64", 32)] == ["auto", None, None, 64, 32]
    for bad in ("0", "-1", "x", True, 1.5):
        with pytest.raises(ValueError, match="--exact-window"):
            FitConfig(exact_window=bad)
    given = fit_mapper(qwen3_model, qwen3_model, calibration_ids, top_k=1, num_exact_layers=2, exact_window=32,
                       heldout_fraction=0, progress=False)  # fmt: skip
    assert given.config.exact_window == 32
    unset = fit_mapper(qwen3_model, qwen3_model, calibration_ids, top_k=1, num_exact_layers=2, heldout_fraction=0,
                       progress=False)  # fmt: skip
    assert unset.config.exact_window is None  # "auto" with given exact layers: no probe, so the whole prompt


def test_info_plan_and_eval_say_what_the_window_is(tmp_path, capsys):
    from hf_kvtransfer.commands import cli
    from hf_kvtransfer.commands.plan import plan_transfer
    from hf_kvtransfer.core.flops import mapper_first_token
    from hf_kvtransfer.commands.reporting import transfer_settings

    model = tiny_model("qwen3", num_hidden_layers=4)
    mapper = _with_exact(exact_identity_mapper(model), 3).with_config(exact_window=16)
    mapper.save_pretrained(tmp_path)
    assert cli.main(["info", str(tmp_path)]) == 0
    assert "the exact layers attend within 16 tokens" in capsys.readouterr().out
    # the first-token FLOPs `info` prints count the window: fewer than the whole pass at the same settings
    whole = mapper_first_token(mapper.with_config(exact_window=None), (512,))[512]
    local = mapper_first_token(mapper, (512,))[512]
    assert local["exact_layers"] < whole["exact_layers"] and local["mapping"] == whole["mapping"]
    plan = plan_transfer(model.config, model.config, top_k=1, seq_len=512, num_exact_layers=3, exact_window=16)
    assert plan.first_token_flops["exact_layers"] == local["exact_layers"]
    assert plan.first_token_flop_ratio_by_exact_layers_windowed[3] == pytest.approx(plan.first_token_flop_ratio)
    assert transfer_settings(3, 8, None, 32, exact_window=16).startswith("3 of 8 target layers exact, attending within 16")
    assert cli._with_exact_window(mapper, 0).config.exact_window is None
    assert cli._with_exact_window(mapper, 32).config.exact_window == 32 and mapper.config.exact_window == 16
