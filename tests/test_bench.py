"""The fast conversion path against the plain reference, FLOP formulas against torch's counter, and the
benchmark's report (no timed assertions)."""

import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rope_reference import apply_rope
from conftest import left_pad, random_ids, tiny_model
from hf_kvtransfer import KVMapper, MapperConfig, TransferredCache, prefill
from hf_kvtransfer.core import conversion as conversion_module
from hf_kvtransfer.commands import bench as bench_module
from hf_kvtransfer.commands.bench import BenchConfig, mapping_flops, prefill_flops, run_benchmark
from hf_kvtransfer.core.mapper import DEFAULT_NUM_EXACT_LAYERS
from hf_kvtransfer.evaluation.timing import QUICK_SEQ_LENS
from hf_kvtransfer.fitting.config import parse_rank_spec
from hf_kvtransfer.commands.reporting import bench_markdown, save_bench_report as save_report
from hf_kvtransfer.core.conversion import conversion_groups
from hf_kvtransfer.commands.cli import main
from hf_kvtransfer.core.rope import build_rotary_embedding, position_ids_from_mask, rotary_cos_sin, strip_rope


REPO = Path(__file__).resolve().parents[1]


def _random_mapper(source, target, selected_layers, seed=0, rank=None):
    torch.manual_seed(seed)
    config = MapperConfig(
        source.config.to_dict(), target.config.to_dict(), selected_layers, mapper_type="lowrank" if rank else "ridge", rank=rank
    )
    return KVMapper(config)


def _dense(proj):
    """(weight, bias) of a full-rank or factored projection."""
    if hasattr(proj, "down"):
        return proj.up.weight @ proj.down.weight, proj.up.bias
    return proj.weight, proj.bias


def _reference_conversion(source, target, cache, mapper, mask, length):
    """Strip -> map -> apply with the plain functions of rope.py, one source layer at a time, no buffers."""
    batch = cache.layers[0].keys.shape[0]
    positions = position_ids_from_mask(mask, batch, cache.get_seq_length(), "cpu")[:, :length]
    cos_s, sin_s = rotary_cos_sin(build_rotary_embedding(source.config), positions, "cpu")
    cos_t, sin_t = rotary_cos_sin(build_rotary_embedding(target.config), positions, "cpu")
    tgt = mapper.target_layout
    out = []
    for t, selected in enumerate(mapper.config.selected_layers):
        feats = {"key": [], "value": []}
        for s in selected:
            k = strip_rope(cache.layers[s].keys[:, :, :length], cos_s, sin_s)
            v = cache.layers[s].values[:, :, :length].float()
            feats["key"].append(k.transpose(1, 2).reshape(batch, length, -1))
            feats["value"].append(v.transpose(1, 2).reshape(batch, length, -1))
        kv = []
        for kind in ("key", "value"):
            y = torch.nn.functional.linear(torch.cat(feats[kind], -1), *_dense(getattr(mapper.layers[t], kind)))
            kv.append(y.view(batch, length, tgt.num_kv_heads, tgt.head_dim).transpose(1, 2))
        out.append((apply_rope(kv[0], cos_t, sin_t), kv[1]))
    return out


@pytest.mark.parametrize("arch", ["qwen3", "phi3-partial", "yarn"])
@pytest.mark.parametrize("selected", [[[0, 2], [1, 2], [0, 2]], [[0, 1, 2]] * 3, [[1], [2, 0], [2]]])
@pytest.mark.parametrize("rank", [None, [[3, 5], [1, 2], [7, 4]], [[30, 20], [32, 25], [28, 32]]], ids=["full", "factored", "dense"])
def test_fast_conversion_matches_plain_reference(arch, selected, rank, monkeypatch):
    monkeypatch.setattr(conversion_module, "SMALL_MAP_ENTRIES", 0)  # tiny maps would always be taken densely
    source = tiny_model(arch, num_hidden_layers=3, seed=3)
    target = tiny_model(arch, num_hidden_layers=3, seed=4)
    mapper = _random_mapper(source, target, selected, rank=rank)
    ids, mask = left_pad(random_ids(2, 14, seed=5), [14, 9])
    cache = prefill(source, ids, attention_mask=mask)
    expected = _reference_conversion(source, target, cache, mapper, mask, length=13)
    got = TransferredCache(cache, mapper, attention_mask=mask, num_recompute_tokens=1, num_exact_layers=0).convert_all()
    for (k_ref, v_ref), layer in zip(expected, got.layers):
        torch.testing.assert_close(layer.keys, k_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.values, v_ref, rtol=1e-5, atol=1e-5)
        assert layer.keys.is_contiguous() and layer.values.is_contiguous()  # what a plain prefill cache holds
    assert got.num_pending_layers == 0 and got.pending_nbytes == 0  # buffers, tables and source layers released
    # Editing the mapper in place after a conversion is seen by the next one (no stale stacked factors).
    if rank is not None:
        with torch.no_grad():
            mapper.layers[2].key.down.weight.mul_(2)
        expected = _reference_conversion(source, target, cache, mapper, mask, length=13)
        again = TransferredCache(cache, mapper, attention_mask=mask, num_recompute_tokens=1, num_exact_layers=0).convert_all()
        torch.testing.assert_close(again.layers[2].keys, expected[2][0], rtol=1e-5, atol=1e-5)
    # Into a bf16 cache: the float32 result rounded once (not per step): at most one bf16 ulp apart, where a
    # float32 round-off difference flips a rounding tie.
    half = TransferredCache(cache, mapper, attention_mask=mask, num_recompute_tokens=1, num_exact_layers=0).convert_all(dtype=torch.bfloat16)
    for (k_ref, v_ref), layer in zip(expected, half.layers):
        assert layer.keys.dtype == torch.bfloat16
        for got_t, ref in ((layer.keys, k_ref), (layer.values, v_ref)):
            exact = (got_t.float() == ref.bfloat16().float()).float().mean()
            assert exact > 0.99
            torch.testing.assert_close(got_t.float(), ref.bfloat16().float(), rtol=2**-7, atol=1e-6)


def test_bf16_source_and_nonfinite_detection():
    source = tiny_model("qwen3", num_hidden_layers=3, seed=3)
    target = tiny_model("qwen3", num_hidden_layers=3, seed=4)
    mapper = _random_mapper(source, target, [[0, 1]] * 3)
    ids = random_ids(1, 12, seed=6)
    cache = prefill(source, ids)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.bfloat16(), layer.values.bfloat16()
    expected = _reference_conversion(source, target, cache, mapper, None, length=11)
    got = TransferredCache(cache, mapper, num_recompute_tokens=1, num_exact_layers=0).convert_all(dtype=torch.float32)
    for (k_ref, v_ref), layer in zip(expected, got.layers):
        torch.testing.assert_close(layer.keys, k_ref, rtol=1e-5, atol=1e-5)
    cache.layers[1].values[0, 1, 4, 2] = float("inf")
    with pytest.raises(ValueError, match="source cache layer 1 has non-finite"):
        TransferredCache(cache, mapper, num_recompute_tokens=1, num_exact_layers=0).convert_all()


def test_flop_formulas_match_torch_flop_counter(monkeypatch):
    source = tiny_model("qwen3", num_hidden_layers=3, seed=3)
    target = tiny_model("qwen3", num_hidden_layers=2, seed=4)
    seq = 24
    ids = random_ids(1, seq, seed=7)
    with FlopCounterMode(display=False) as counter:
        target(ids)
    flops = prefill_flops(target.config, seq, logits=True)
    cfg = target.config
    # The counter sees eager attention's full square; the formula counts the causal triangle.
    full_square = 2 * cfg.num_hidden_layers * 2 * cfg.num_attention_heads * cfg.head_dim * seq * seq
    assert counter.get_total_flops() == flops["projections"] + flops["lm_head"] + full_square

    # Full rank; reduced rank taken factored (small ranks) and densely (ranks near full: cheaper as one product).
    monkeypatch.setattr(conversion_module, "SMALL_MAP_ENTRIES", 0)  # tiny maps would always be taken densely
    for selected, rank in (([[0, 2], [1, 2]], None), ([[0, 1, 2], [2]], [[3, 5], [1, 2]]), ([[0, 1], [0, 1]], [[32, 30], [31, 32]])):
        config = MapperConfig(
            source.config.to_dict(), target.config.to_dict(), selected, mapper_type="lowrank" if rank else "ridge", rank=rank
        )
        mapper = KVMapper(config)
        cache = prefill(source, ids)
        TransferredCache(cache, mapper, num_recompute_tokens=0, num_exact_layers=0).convert_all()  # builds the stacked weights once
        with FlopCounterMode(display=False) as counter:
            TransferredCache(cache, mapper, num_recompute_tokens=0, num_exact_layers=0).convert_all()
        assert counter.get_total_flops() == mapping_flops(mapper, seq)
    dense = [d for _, d in conversion_groups(mapper, seq)]
    assert dense == [True]  # the last case: one group of both layers, taken densely
    monkeypatch.undo()
    assert [d for _, d in conversion_groups(KVMapper(config), seq)] == [True]  # small maps: always densely


def test_parse_rank_spec():
    assert parse_rank_spec("full") == {}
    assert parse_rank_spec("16") == {"rank": 16}
    assert parse_rank_spec("energy=0.99") == {"energy": 0.99}
    assert parse_rank_spec("budget=0.25") == {"size_budget": 0.25}
    assert parse_rank_spec("energy=0.99@bf16") == {"energy": 0.99, "dtype": torch.bfloat16}
    assert parse_rank_spec("full@fp32") == {"dtype": torch.float32}
    with pytest.raises(ValueError, match="rank spec must be"):
        parse_rank_spec("half")
    with pytest.raises(ValueError, match="must be one of"):
        parse_rank_spec("full@int4")


def test_run_benchmark_report_and_files(tmp_path, monkeypatch):
    source = tiny_model("qwen3", num_hidden_layers=2, seed=3)
    target = tiny_model("qwen3", num_hidden_layers=3, seed=4)
    mappers = {"a": _random_mapper(source, target, [[0, 1]] * 3), "b": _random_mapper(source, target, [[1]] * 3)}
    mappers["a"].config.num_exact_layers = 2  # as a fit's content probe records it
    calls = []
    real_timer = bench_module.time_to_first_token

    def timer(*args, **kwargs):  # the one timer, called as the bench calls it; what it used is in its result
        result = real_timer(*args, **kwargs)
        calls.append((kwargs["num_exact_layers"], kwargs["num_recompute_tokens"], result))
        return result

    monkeypatch.setattr(bench_module, "time_to_first_token", timer)
    report = run_benchmark(source, target, mappers, seq_lens=[8, 80], repeats=1, warmup=0, decode_steps=2, progress=False)
    assert [r["seq_len"] for r in report["results"]] == [8, 80]
    # Per length: the mapper's defaults (its 2 exact layers, the cache's recomputed tokens), then all mapped.
    assert [(c[0], c[1]) for c in calls] == [(None, None), (0, 1)] * 2
    assert [(c[2]["num_exact_layers"], c[2]["num_recompute_tokens"]) for c in calls] == [(2, 4), (0, 1), (2, 32), (0, 1)]
    for row in report["results"]:
        assert set(row["transfer"]) == {"a", "b"}
        for entry in row["transfer"].values():
            assert entry["ms"] > 0 and entry["speedup_vs_body"] == pytest.approx(row["prefill_body_ms"] / entry["ms"])
            assert entry["peak_bytes"] > 0
        assert row["decode_own_ms"] > 0 and row["ttft_defaults_ms"] > 0 and row["ttft_all_mapped_ms"] > 0
        assert row["ttft_defaults_speedup"] == pytest.approx(row["ttft_own_ms"] / row["ttft_defaults_ms"])
        assert row["ttft_all_mapped_speedup"] == pytest.approx(row["ttft_own_ms"] / row["ttft_all_mapped_ms"])
        assert row["ttft_defaults_num_exact_layers"] == 2
    assert [r["ttft_defaults_num_recompute_tokens"] for r in report["results"]] == [4, 32]  # at most half the prompt
    settings = report["settings"]
    assert settings["ttft_defaults"]["num_exact_layers"] == 2 and settings["ttft_all_mapped"]["num_exact_layers"] == 0
    assert settings["ttft_defaults"]["exact_layers_origin"] == "recorded by the mapper's fit"
    assert report["mappers"]["b"]["parameters"] < report["mappers"]["a"]["parameters"]
    assert report["environment"]["torch_num_threads"] == torch.get_num_threads()
    paths = save_report(report, tmp_path)
    assert json.loads(paths["json"].read_text())["results"][1]["seq_len"] == 80
    table = paths["markdown"].read_text()
    assert "| 80 |" in table and "OMP_WAIT_POLICY" in table
    for threads, words in ((1, "1 thread,"), (2, "2 threads,")):  # the machine line counts them in words
        report["environment"]["torch_num_threads"] = threads
        assert words in bench_markdown(report).splitlines()[0]
    said = "**at the mapper's defaults**, 2 of 3 target layers exact (recorded by the mapper's fit), 4/32 recomputed tokens"
    assert said + " by prompt length (TransferredCache's default: 32" in table
    # ... and what the maps of the third layer read (a source-only mapper with k = 2: both source layers).
    assert "32, at most half a shorter prompt); what the mapped layers read: source K/V; beside it" in table
    assert "all mapped: 0 exact layers, 1 recomputed token" in table and "TTFT all mapped ms (x faster; lossy)" in table
    assert paths["plot"].stat().st_size > 1000


def test_cli_bench_runs_and_writes_results(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # with no --source/--target: random weights of the bundled family's configs
    monkeypatch.delenv("HF_KVTRANSFER_FAMILY", raising=False)
    code = main([
        "bench", "--no-reexec", "--seq-lens", "64", "--repeats", "1", "--warmup", "0", "--decode-steps", "1",
        "--ranks", "full", "4", "--calibration-tokens", "1024", "--output-dir", str(tmp_path),
    ])  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert set(report["results"][0]["transfer"]) == {"k=4 full", "k=4 4"}
    large = json.loads((REPO / "examples" / "family" / "large" / "config.json").read_text())
    assert report["mappers"]["k=4 4"]["rank"] == [[4, 4]] * large["num_hidden_layers"]
    # Solved here: no content probe, so the cache's default for a mapper that records none, said as such.
    defaults = report["settings"]["ttft_defaults"]
    assert defaults["num_exact_layers"] == DEFAULT_NUM_EXACT_LAYERS and "without a content probe" in defaults["exact_layers_origin"]
    assert report["settings"]["config"]["random_weights"] is True
    out = capsys.readouterr().out
    first = out.splitlines()[0]  # printed before the timing
    assert first.startswith(f"time to first token at the mapper's defaults: {DEFAULT_NUM_EXACT_LAYERS} of 8 target layers exact")
    assert "beside it, all mapped: 0 exact layers" in first and "| 64 |" in out
    # More exact layers than the target has: one line before any timing.
    assert main(["bench", "--no-reexec", "--exact-layers", "9", "--ranks", "full", "--calibration-tokens", "512"]) == 1
    assert "exact_layers must be in [0, 8] (the target's layers), got 9" in capsys.readouterr().err


def test_cli_builds_the_bench_config_without_guessing_defaults(tmp_path, monkeypatch):
    """The CLI passes what was given and nothing else: --quick no longer overrides an explicit --ranks that happens
    to equal the default, and BenchConfig holds every default."""
    import argparse

    from hf_kvtransfer.commands import cli

    def config(*argv):
        args = cli.build_parser().parse_args(["bench", *argv])
        return cli._bench_config(args)

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("HF_KVTRANSFER_FAMILY", raising=False)
    plain = config()
    assert plain == BenchConfig("examples/family/small", "examples/family/large", random_weights=True)
    assert plain.ranks == ("full", "16", "8") and plain.exact_layers is None and plain.recompute_tokens is None
    quick = config("--quick", "--ranks", "full", "16", "8", "--repeats", "7")
    assert quick.ranks == ("full", "16", "8") and quick.repeats == 7 and quick.seq_lens == QUICK_SEQ_LENS
    assert quick.decode_steps == 4
    given = config("--source", "a", "--target", "b", "--mapper", "m1", "--mapper", "x=m2", "--exact-layers", "3",
                   "--recompute-tokens", "8", "--no-ttft", "--top-k", "all")  # fmt: skip
    assert given == BenchConfig("a", "b", mappers=("m1", "x=m2"), exact_layers=3, recompute_tokens=8, ttft=False, top_k="all")
    with pytest.raises(cli.CLIError, match="both --source and --target"):
        config("--source", "a")
    monkeypatch.chdir(tmp_path)  # no family here
    with pytest.raises(cli.CLIError, match="no model family at examples/family"):
        config()
    deep = REPO / "examples" / "family_deep"  # the deep pair's layout: source/ and target/
    monkeypatch.setenv("HF_KVTRANSFER_FAMILY", str(deep))
    assert config() == BenchConfig(str(deep / "source"), str(deep / "target"), random_weights=True)
    assert isinstance(cli.build_parser().parse_args(["bench"]), argparse.Namespace)
    with pytest.raises(ValueError, match="recompute_tokens must be >= 1"):
        BenchConfig("a", "b", recompute_tokens=0)
    with pytest.raises(ValueError, match="drop --random-weights"):
        BenchConfig("a", "b", random_weights=True, mappers=("m",))


def test_prefill_flops_of_exact_layers_and_recomputed_tokens_match_torch_flop_counter():
    """`prefill_flops(num_layers=, context_len=)` (what plan counts for the exact layers and the recomputed tokens)
    against torch's counter on a truncated model and on a forward over a cache."""
    target = tiny_model("qwen3", num_hidden_layers=4, seed=4)
    cfg, seq, context = target.config, 12, 20
    q_dim = cfg.num_attention_heads * cfg.head_dim
    ids = random_ids(1, context + seq, seed=7)
    # The first 2 layers: a copy of the model cut to them.
    import copy

    cut = copy.deepcopy(target)
    cut.model.layers = cut.model.layers[:2]
    with FlopCounterMode(display=False) as counter:
        cut.model(ids[:, :seq])
    flops = prefill_flops(cfg, seq, num_layers=2)
    square = 2 * 2 * 2 * q_dim * seq * seq  # eager attention computes the full square; the formula the triangle
    triangle = 2 * 2 * 2 * q_dim * (seq * (seq + 1) // 2)
    assert counter.get_total_flops() == flops["total"] - triangle + square
    # `seq` new tokens on a cache of `context`: every layer, attending to the context and causally to themselves.
    cache = prefill(target, ids[:, :context])
    with FlopCounterMode(display=False) as counter:
        target.model(ids[:, context:], cache=cache, use_cache=True)
    flops = prefill_flops(cfg, seq, context_len=context)
    layers = cfg.num_hidden_layers
    rectangle = 2 * layers * 2 * q_dim * seq * (context + seq)
    causal = 2 * layers * 2 * q_dim * (seq * context + seq * (seq + 1) // 2)
    assert counter.get_total_flops() == flops["total"] - causal + rectangle


def test_run_benchmark_takes_bench_timing_or_its_fields_as_keywords():
    from hf_kvtransfer.commands.bench import BenchTiming

    source = tiny_model("qwen3", num_hidden_layers=2, seed=3)
    target = tiny_model("qwen3", num_hidden_layers=3, seed=4)
    mapper = _random_mapper(source, target, [[1]] * 3)
    options = dict(repeats=1, warmup=0, measure_ttft=False, measure_decode=False, measure_memory=False,
                   measure_full_forward=False, num_exact_layers=2, progress=False)  # fmt: skip
    for report in (run_benchmark(source, target, mapper, [8], BenchTiming(**options)),
                   run_benchmark(source, target, mapper, [8], **options)):  # fmt: skip
        assert report["settings"]["repeats"] == 1 and "ttft_defaults" not in report["settings"]
        assert set(report["results"][0]) == {"seq_len", "source_prefill_ms", "source_prefill_ms_cpu", "prefill_body_ms",
                                             "prefill_body_ms_cpu", "prefill_gflop", "transfer"}  # fmt: skip
    with pytest.raises(TypeError, match=r"run_benchmark\(\) got unknown option\(s\) repeat\b"):
        run_benchmark(source, target, mapper, [8], repeat=1)
    with pytest.raises(ValueError):  # an exact-layer count the target cannot take, before any timing
        run_benchmark(source, target, mapper, [8], **{**options, "num_exact_layers": 7})
