"""`hf-kvtransfer fit` end to end on tiny saved models: outputs, one pass for several k, resume, errors."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_kvtransfer.fitting.calibration_pass as calibrate_module
from conftest import HANG_GUARD_S
from fit_fixtures import make_tokenizer, save_pair, write_corpus
from hf_kvtransfer import KVMapper, KVStatistics, collect_statistics, solve_mapper
from hf_kvtransfer.fitting.accumulate import read_checkpoint
from hf_kvtransfer.fitting.calibration import build_calibration, sample_hash
from hf_kvtransfer.commands.cli import main

NUM_SEQUENCES, SEQ_LEN, BATCH = 24, 32, 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    source, target = save_pair(root)
    corpus = write_corpus(root / "corpus.txt", num_paragraphs=200)
    return source, target, corpus


def _args(pair, output, *extra):
    source, target, corpus = pair
    return [
        "fit", "--source", str(source), "--target", str(target), "--output", str(output), "--dataset", str(corpus),
        "--num-sequences", str(NUM_SEQUENCES), "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH),
        # These tests count the pass's capture_kv calls (2 a batch) and name the options a checkpoint differs in;
        # the residual statistics (their own capture, their own run key) are covered in test_residual.py.
        "--residual-inputs", "off", *extra,
    ]  # fmt: skip


def _leftovers(output: Path) -> list[str]:
    """Anything the fit left next to the output: temp dirs, checkpoints, the output itself."""
    return sorted(p.name for p in output.parent.iterdir() if output.name in p.name)


class _CountingCapture:
    """Stands in for `capture_kv` in the calibration pass: counts model forwards, optionally sends SIGINT on call
    `interrupt_at`."""

    def __init__(self, interrupt_at: int | None = None):
        self.calls = 0
        self.interrupt_at = interrupt_at
        self._real = calibrate_module.capture_kv

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.interrupt_at:
            signal.raise_signal(signal.SIGINT)
        return self._real(*args, **kwargs)


def _assert_same_mapper(dir_a: Path, dir_b: Path, **tol):
    a, b = load_file(str(dir_a / "model.safetensors")), load_file(str(dir_b / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], **tol)


def test_cli_subprocess_fit_matches_in_memory_fit(pair, tmp_path):
    source, target, corpus = pair
    out = tmp_path / "mapper"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "hf_kvtransfer.commands.cli", *_args(pair, out, "--top-k", "2", "--heldout-fraction", "0")],
        capture_output=True, text=True, env=env, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "statistics: 2 x (96^2 + 96x16 + 96 + 2x16) float64 = 0.2 MiB on cpu" in proc.stderr
    assert f"wrote {out}: k=2" in proc.stdout
    assert _leftovers(out) == ["mapper"]  # no checkpoint or temp directory left behind
    mapper = KVMapper.from_pretrained(out)
    # What the other layers' maps read, said as `info` and `eval` say it (these maps read the source's K/V alone).
    assert mapper.num_exact_layers < len(mapper.layers) and "; what the other layers' maps read: source" in proc.stdout, proc.stdout

    # Reference: the plain in-memory path on independently packed ids.
    ids, _ = build_calibration(make_tokenizer(), corpus, num_sequences=NUM_SEQUENCES, seq_len=SEQ_LEN)
    src = AutoModelForCausalLM.from_pretrained(source).eval()
    tgt = AutoModelForCausalLM.from_pretrained(target).eval()
    reference = solve_mapper(collect_statistics(src, tgt, ids, stride=4, progress=False), top_k=2)
    assert mapper.config.selected_layers == reference.config.selected_layers
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(mapper.state_dict()[name], tensor, rtol=1e-5, atol=1e-6)
    calibration = mapper.config.calibration
    assert calibration["sample_sha256"] == sample_hash(ids)
    assert (calibration["num_sequences"], calibration["seq_len"], calibration["stride"]) == (NUM_SEQUENCES, SEQ_LEN, 4)
    assert calibration["num_tokens"] == NUM_SEQUENCES * SEQ_LEN // 4
    assert mapper.config.source_model_id == str(source)


def test_several_top_k_from_one_pass(pair, tmp_path, monkeypatch):
    counter = _CountingCapture()
    monkeypatch.setattr(calibrate_module, "capture_kv", counter)
    out = tmp_path / "mappers"
    assert main(_args(pair, out, "--top-k", "1,2,all", "--heldout-fraction", "0.25")) == 0
    # 18 fit + 6 held-out sequences in batches of 4: 5 + 2 batches, two models each, and nothing more
    assert counter.calls == 2 * (5 + 2)
    for name, k in (("k1", 1), ("k2", 2), ("kall", 3)):
        mapper = KVMapper.from_pretrained(out / name)
        assert mapper.config.top_k == k and all(len(s) == k for s in mapper.config.selected_layers)
        assert mapper.layers[0].key.weight.shape == (8, k * 32)
        assert len(mapper.config.heldout_r2_key) == 2 and mapper.config.calibration["heldout_tokens"] == 6 * 8


def test_default_top_k_on_a_shallower_source_means_every_layer(pair, tmp_path):
    # The default top_k=8 exceeds this 3-layer source (as it does the bundled 4-layer small model): the CLI must
    # fit with every source layer, exactly as --top-k all does, not refuse.
    default, every = tmp_path / "default", tmp_path / "all"
    assert main(_args(pair, default)) == 0
    assert main(_args(pair, every, "--top-k", "all")) == 0
    mapper = KVMapper.from_pretrained(default)
    assert mapper.config.selected_layers == [[0, 1, 2]] * len(mapper.layers)
    _assert_same_mapper(default, every, rtol=0, atol=0)


@pytest.mark.parametrize("flag, expected", [(None, torch.float32), ("bfloat16", torch.bfloat16)])
def test_auto_dtype_is_float32_on_the_cpu(pair, tmp_path, monkeypatch, flag, expected):
    # A bf16 checkpoint (as examples/family is) loads in float32 for a CPU fit unless bf16 is asked for.
    import hf_kvtransfer.commands.workflow as workflow

    source, target, corpus = pair
    bf16_source = tmp_path / "bf16-source"
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(bf16_source)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (source / name).exists():
            (bf16_source / name).write_bytes((source / name).read_bytes())
    assert AutoModelForCausalLM.from_pretrained(bf16_source).dtype == torch.bfloat16
    loaded = []
    real = workflow.load_model
    monkeypatch.setattr(workflow, "load_model", lambda *a, **kw: loaded.append(real(*a, **kw)) or loaded[-1])
    extra = ("--dtype", flag) if flag else ()
    assert main(_args((bf16_source, target, corpus), tmp_path / "out", "--top-k", "1", *extra)) == 0
    assert [m.dtype for m in loaded] == [expected, expected]


def test_resume_after_sigint_equals_uninterrupted_run(pair, tmp_path, monkeypatch, capsys):
    common = ("--top-k", "2", "--heldout-fraction", "0.25", "--checkpoint-every", "100")
    full = tmp_path / "full"
    assert main(_args(pair, full, *common, "--stats-dir", str(tmp_path / "stats-full"))) == 0

    out, stats_dir = tmp_path / "resumed", tmp_path / "stats"
    monkeypatch.setattr(calibrate_module, "capture_kv", _CountingCapture(interrupt_at=5))  # inside the 3rd batch
    assert main(_args(pair, out, *common, "--stats-dir", str(stats_dir))) == 130
    assert not out.exists()
    checkpoint = stats_dir / "checkpoints" / "checkpoint-rank0-of-1.safetensors"
    state = read_checkpoint(checkpoint)
    train, heldout, done = state["train"], state["heldout"], state["done"]
    assert done == 3 * BATCH and train.count == done * SEQ_LEN // 4 and heldout.count == 0
    assert state["run"]["stride"] == 4 and state["run"]["num_heldout"] == 6

    counter = _CountingCapture()
    monkeypatch.setattr(calibrate_module, "capture_kv", counter)
    assert main(_args(pair, out, *common, "--stats-dir", str(stats_dir))) == 0
    assert counter.calls == 2 * 4  # the 2 fit batches left and the 2 held-out batches
    assert not (stats_dir / "checkpoints").exists()
    _assert_same_mapper(full, out, rtol=0, atol=0)
    for part in ("train", "heldout"):
        a, b = KVStatistics.load(tmp_path / "stats-full" / part), KVStatistics.load(stats_dir / part)
        assert a.count == b.count
        for name in a.tensors:
            torch.testing.assert_close(a.tensors[name], b.tensors[name], rtol=0, atol=0)


def test_changed_options_refuse_a_foreign_checkpoint(pair, tmp_path, monkeypatch, capsys):
    stats_dir = tmp_path / "stats"
    monkeypatch.setattr(calibrate_module, "capture_kv", _CountingCapture(interrupt_at=1))
    assert main(_args(pair, tmp_path / "a", "--top-k", "1", "--stats-dir", str(stats_dir))) == 130
    monkeypatch.undo()
    assert main(_args(pair, tmp_path / "a", "--top-k", "1", "--stats-dir", str(stats_dir), "--stride", "2")) == 1
    assert "belongs to a different fit (differs in: stride)" in capsys.readouterr().err


def test_tokenizer_mismatch_is_refused_without_output(tmp_path, capsys):
    other = make_tokenizer(specials=["<pad>", "<bos>", "<eos>", "<unk>"])
    source, target = save_pair(tmp_path / "models", target_tokenizer=other)
    corpus = write_corpus(tmp_path / "corpus.txt")
    out = tmp_path / "out"
    assert main(_args((source, target, corpus), out, "--top-k", "1")) == 1
    err = capsys.readouterr().err
    assert "source and target tokenizers differ" in err and "special tokens differ" in err
    assert _leftovers(out) == []


def test_unreadable_dataset_and_failed_write_leave_no_output(pair, tmp_path, monkeypatch, capsys):
    source, target, _ = pair
    out = tmp_path / "out"
    assert main(_args((source, target, tmp_path / "nope.txt"), out, "--top-k", "1")) == 1
    assert "calibration file" in capsys.readouterr().err and _leftovers(out) == []

    # A failure while writing the second of three mappers: nothing that looks like a finished output.
    real_save, calls = KVMapper.save_pretrained, []

    def failing_save(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(KVMapper, "save_pretrained", failing_save)
    assert main(_args(pair, out, "--top-k", "1,2,all")) == 1
    assert "disk full" in capsys.readouterr().err
    assert not out.exists() and not any(".tmp-" in name for name in _leftovers(out))


def test_existing_output_needs_overwrite(pair, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert main(_args(pair, out, "--top-k", "1")) == 1
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main(_args(pair, out, "--top-k", "1", "--overwrite", "--heldout-fraction", "0")) == 0
    assert KVMapper.from_pretrained(out).config.top_k == 1


def test_auto_picks_the_best_held_out_candidate(pair, tmp_path):
    out = tmp_path / "auto"
    assert main(_args(pair, out, "--top-k", "auto", "--ridge-lambda", "0.01,100,auto", "--heldout-fraction", "0.25")) == 0
    mapper = KVMapper.from_pretrained(out)
    config, selection = mapper.config, mapper.report["model_selection"]
    curve = selection["curve"]
    assert {(r["top_k"], r["ridge_lambda"]) for r in curve} == {(k, lam) for k in (1, 2, "all") for lam in (0.01, 100.0)}
    best = max(curve, key=lambda r: r["heldout_r2"])
    assert selection["chosen"] == [{"top_k": best["top_k"], "ridge_lambda": best["ridge_lambda"]}]
    assert config.ridge_lambda == best["ridge_lambda"]
    assert config.top_k == (3 if best["top_k"] == "all" else best["top_k"])
    mean_heldout = (sum(config.heldout_r2_key) + sum(config.heldout_r2_value)) / (2 * len(config.heldout_r2_key))
    assert abs(mean_heldout - best["heldout_r2"]) < 1e-9


def test_fit_mapper_takes_the_cli_options_in_python(pair, tmp_path):
    from hf_kvtransfer import fit_mappers

    source, target, corpus = pair
    assert main(_args(pair, tmp_path / "cli", "--top-k", "1,all", "--heldout-fraction", "0.25")) == 0
    src = AutoModelForCausalLM.from_pretrained(source).eval()
    tgt = AutoModelForCausalLM.from_pretrained(target).eval()
    mappers = fit_mappers(
        src, tgt, corpus, tokenizer=make_tokenizer(), num_sequences=NUM_SEQUENCES, seq_len=SEQ_LEN, batch_size=BATCH,
        top_k="1,all", heldout_fraction=0.25, checkpoint_dir=tmp_path / "ckpt", progress=False,
    )  # fmt: skip
    assert sorted(mappers) == ["k1", "kall"]
    for name, mapper in mappers.items():
        cli = KVMapper.from_pretrained(tmp_path / "cli" / name)
        assert mapper.config.calibration["sample_sha256"] == cli.config.calibration["sample_sha256"]
        assert mapper.config.heldout_r2_key == pytest.approx(cli.config.heldout_r2_key, rel=1e-9, abs=1e-12)
        for key, tensor in cli.state_dict().items():
            torch.testing.assert_close(mapper.state_dict()[key], tensor, rtol=1e-6, atol=1e-7)


def test_reduced_rank_and_bf16_mapper_from_the_cli(pair, tmp_path, capsys):
    from hf_kvtransfer import reduce_mapper_rank

    stats_dir = tmp_path / "stats"
    assert main(_args(pair, tmp_path / "full", "--top-k", "2", "--heldout-fraction", "0", "--stats-dir", str(stats_dir))) == 0
    assert main(_args(pair, tmp_path / "low", "--top-k", "2", "--heldout-fraction", "0", "--rank", "3",
                      "--mapper-dtype", "bfloat16")) == 0  # fmt: skip
    low = KVMapper.from_pretrained(tmp_path / "low")
    assert low.config.rank == [[3, 3], [3, 3]] and next(low.parameters()).dtype == torch.bfloat16
    # The same factors as reducing the full-rank mapper with the statistics it was solved from, rounded to bf16.
    full = KVMapper.from_pretrained(tmp_path / "full")
    expected = reduce_mapper_rank(full, KVStatistics.load(stats_dir / "train"), rank=3, dtype=torch.float32)
    for (name, got), ref in zip(low.state_dict().items(), expected.state_dict().values()):
        torch.testing.assert_close(got.float(), ref.bfloat16().float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item(), msg=name)
    capsys.readouterr()
    assert main(["info", str(tmp_path / "low")]) == 0
    info = capsys.readouterr().out
    assert "MiB on disk, bfloat16)" in info and "rank:        K/V per target layer 3/3, 3/3" in info
    # A bad spec is refused before any model loads, with the accepted forms named.
    assert main(_args(pair, tmp_path / "bad", "--rank", "energy=0.99@bf16")) != 0
    assert "give an integer rank, energy=F or budget=F" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_reduced_rank_fit_at_the_default_inputs_keeps_to_source_maps(pair, tmp_path, capsys):
    # The residual-input candidates extend a full-rank ridge map: with --rank (and residual inputs at their default,
    # auto) the fit used to solve them on the low-rank mapper and fail after the calibration pass. It says it keeps to
    # source K/V maps and saves the reduced-rank mapper asked for.
    assert main(_args(pair, tmp_path / "low", "--top-k", "2", "--rank", "3", "--residual-inputs", "auto")) == 0
    assert "residual-input maps: not tried for a reduced-rank mapper" in capsys.readouterr().err
    low = KVMapper.from_pretrained(tmp_path / "low")
    assert low.config.rank == [[3, 3], [3, 3]] and "residual" not in low.config.map_inputs


def test_solve_from_kept_statistics_without_models(pair, tmp_path, monkeypatch, capsys):
    counter = _CountingCapture()
    monkeypatch.setattr(calibrate_module, "capture_kv", counter)
    stats_dir = tmp_path / "stats"
    assert main(_args(pair, tmp_path / "fit", "--top-k", "2", "--heldout-fraction", "0.25", "--stats-dir", str(stats_dir))) == 0
    forwards = counter.calls
    # The same k from the kept statistics: the same mapper (held-out scoring and refit included), no forward.
    assert main(["solve", "--stats-dir", str(stats_dir), "--top-k", "2", "--output", str(tmp_path / "solved")]) == 0
    assert counter.calls == forwards
    _assert_same_mapper(tmp_path / "fit", tmp_path / "solved", rtol=1e-6, atol=1e-7)
    fit, solved = KVMapper.from_pretrained(tmp_path / "fit"), KVMapper.from_pretrained(tmp_path / "solved")
    assert solved.config.heldout_r2_key == pytest.approx(fit.config.heldout_r2_key)
    # Other k, a reduced rank and fp16 weights, from the same statistics.
    out = tmp_path / "more"
    assert main(["solve", "--stats-dir", str(stats_dir), "--top-k", "1,all", "--rank", "budget=0.5",
                 "--mapper-dtype", "float16", "--output", str(out)]) == 0  # fmt: skip
    assert counter.calls == forwards
    for name, k in (("k1", 1), ("kall", 3)):
        mapper = KVMapper.from_pretrained(out / name)
        assert mapper.config.top_k == k and mapper.config.rank is not None
        assert next(mapper.parameters()).dtype == torch.float16
        assert mapper.num_parameters() <= 0.5 * 2 * 2 * (k * 32 * 8) + 2 * 2 * 8  # budget (+ biases)
    assert "wrote" in capsys.readouterr().out
    # Statistics that are not there: one line saying how to get them, nothing written.
    assert main(["solve", "--stats-dir", str(tmp_path / "nowhere"), "--output", str(tmp_path / "x")]) != 0
    assert "--stats-dir" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_a_fixed_exact_layers_fit_resumes_the_statistics_a_searching_fit_kept(pair, tmp_path, monkeypatch):
    """What the content gate advises when it cannot judge a target is `--exact-layers N`: the same command with it
    resumes the statistics the searching fit checkpointed (their residual sums go unused) instead of refusing the
    checkpoint as another fit's, runs no model forward of the pass, and writes what a fresh fixed fit writes."""
    from hf_kvtransfer.fitting import fit as fit_module

    def searching(output):
        argv = _args(pair, output, "--heldout-fraction", "0.5")
        argv[argv.index("--residual-inputs") + 1] = "auto"  # the default: the residual's sums are collected too
        return argv

    def fixed(output):
        return _args(pair, output, "--heldout-fraction", "0.5", "--exact-layers", "1")

    assert main(fixed(tmp_path / "fresh")) == 0
    real_summary = fit_module._probe_summary

    def interrupt(report):
        raise KeyboardInterrupt

    monkeypatch.setattr(fit_module, "_probe_summary", interrupt)  # stopped after its pass, while choosing
    out = tmp_path / "mapper"
    assert main(searching(out)) == 130
    assert list(out.with_name(f".{out.name}.fit-checkpoint").glob("checkpoint-*.safetensors"))
    monkeypatch.setattr(fit_module, "_probe_summary", real_summary)
    counter = _CountingCapture()
    monkeypatch.setattr(calibrate_module, "capture_kv", counter)
    assert main(fixed(out)) == 0
    assert counter.calls == 0
    _assert_same_mapper(tmp_path / "fresh", out, rtol=0, atol=0)


def test_a_fit_interrupted_while_probing_resumes_without_scoring_again(pair, tmp_path, monkeypatch, capsys):
    """Ctrl-C after the calibration pass, while the exact layers are chosen: the statistics and the probe's scores
    stay beside the output, the message says so, and the same command resumes with no model forward of the
    calibration pass and no probe score computed again, writing the mapper an uninterrupted fit writes."""
    from hf_kvtransfer.fitting import exact_layers, fit as fit_module

    probe = ("--heldout-fraction", "0.5")  # 384 held-out tokens: enough for the probe's items
    whole = tmp_path / "whole"
    assert main(_args(pair, whole, *probe)) == 0
    real_retention, real_summary = exact_layers.repeated_span_retention, fit_module._probe_summary
    scored = []

    def counting(*args, **kwargs):
        scored.append(kwargs.get("num_exact_layers"))
        return real_retention(*args, **kwargs)

    def interrupt(report):
        raise KeyboardInterrupt

    monkeypatch.setattr(exact_layers, "repeated_span_retention", counting)
    monkeypatch.setattr(fit_module, "_probe_summary", interrupt)
    out = tmp_path / "resumed"
    assert main(_args(pair, out, *probe)) == 130
    first = len(scored)
    assert first >= 1 and not out.exists()
    where = out.with_name(f".{out.name}.fit-checkpoint")
    assert f"the statistics and {first} probe score" in capsys.readouterr().err
    assert (where / "probe-journal-rank0-of-1.jsonl").is_file()

    monkeypatch.setattr(fit_module, "_probe_summary", real_summary)
    counter = _CountingCapture()
    monkeypatch.setattr(calibrate_module, "capture_kv", counter)
    assert main(_args(pair, out, *probe)) == 0
    assert counter.calls == 0 and len(scored) == first  # nothing computed again
    _assert_same_mapper(whole, out, rtol=0, atol=0)
    assert json.loads((out / "config.json").read_text())["num_exact_layers"] == \
        json.loads((whole / "config.json").read_text())["num_exact_layers"]  # fmt: skip
    assert not where.exists()  # checkpoint and journal deleted once the mapper is written
