"""What the demo prints adds up (issue 23): the retention beside the counts it is computed from, the calibration
tokens the fit's progress bar counts, "1 CPU thread"; and the fit's content probe shows one short bar per stage
and logs what each candidate scored (issue 39)."""

import json
import re
from pathlib import Path

import torch

from hf_kvtransfer.commands.demo import format_demo


def _result(threads: int) -> dict:
    n = 200
    acc = {"own": 159 / n, "transfer": 161 / n, "no_context": 0.0}  # 79.5% and 80.5%: both print as "80"
    return {
        "source": "s", "target": "t", "fit_seconds": 1.0, "prompt": "p", "prompt_tokens": 3,
        "mapper": {"top_k": 8, "ridge_lambda": 0.01, "calibration_tokens": 4096, "calibration_tokens_read": 16384,
                   "calibration_stride": 4, "num_exact_layers": 1, "target_layers": 8,
                   "maps_read": "source K/V"},
        "answers": {"own": "a", "transfer": "a"}, "same_tokens": {"prefix": 1, "of": 1},
        "recall": {"num_items": n, "accuracy": {k: {"mean": v} for k, v in acc.items()},
                   "retention": (acc["transfer"] - acc["no_context"]) / (acc["own"] - acc["no_context"]),
                   "retention_ci": [0.95, 1.05]},
        "timing": {"num_tokens": 512, "transfer_ms": 1.0, "num_exact_layers": 1, "num_recompute_tokens": 32,
                   "target_prefill_ms": 2.0, "speedup": 2.0},
        "torch_threads": threads,
    }  # fmt: skip


def test_the_retention_is_printed_beside_the_counts_it_is_computed_from():
    text = format_demo(_result(1))
    line = next(ln for ln in text.splitlines() if ln.startswith("recall retention"))
    shown = int(re.search(r"recall retention (\d+)%", line).group(1))
    a, b, c, d = map(int, re.search(r"\((\d+) - (\d+)\) / \((\d+) - (\d+)\)", line).groups())
    assert shown == round(100 * (a - b) / (c - d)) == 101, line


def test_calibration_tokens_count_what_the_progress_bar_counts_and_threads_agree():
    text = format_demo(_result(1))
    assert "16384 calibration tokens, every 4th fit: 4096" in text
    assert "1 CPU thread)" in text and "1 CPU threads" not in text
    assert "4 CPU threads)" in format_demo(_result(4))


def test_maps_that_read_the_targets_residual_say_so():
    """The report names what the maps of a saved residual-alone mapper read, from the mapper itself: the residual
    layer its config records, and no source K/V where no mapped layer selects a source layer."""

    from hf_kvtransfer import KVMapper
    from hf_kvtransfer.commands.demo import _mapper_summary

    saved = KVMapper.from_pretrained(Path(__file__).parent / "fixtures" / "saved_mappers_nested" / "residual-alone")
    residual = saved.config.map_inputs["residual"]
    result = _result(1)
    result["mapper"].update(_mapper_summary(saved, None))
    line = next(ln for ln in format_demo(result).splitlines() if ln.startswith("maps:"))
    exact, layers = result["mapper"]["num_exact_layers"], len(saved.config.selected_layers)
    none_read = not any(saved.config.selected_layers[exact:])
    mapped = f"the {layers - exact} mapped layer{'s' if layers - exact > 1 else ''} read"
    assert mapped in line and f"residual entering layer {residual.layer}" in line, line
    assert ("no source K/V" in line) == none_read and none_read, line
    everything_exact = _result(1)
    everything_exact["mapper"].update(num_exact_layers=8)
    assert not any(ln.startswith("maps:") for ln in format_demo(everything_exact).splitlines())


def test_the_exact_layers_window_the_mapper_records_is_printed():
    """A mapper whose fit chose a window for the exact layers' attention says how far back they read; one without
    says nothing of a window (they read the whole prompt)."""

    from hf_kvtransfer import KVMapper
    from hf_kvtransfer.commands.demo import _mapper_summary

    saved = KVMapper.from_pretrained(Path(__file__).parent / "fixtures" / "saved_mappers_nested" / "residual-alone")
    lines = {}
    for window in (None, 48):
        result = _result(1)
        result["mapper"].update(_mapper_summary(saved.with_config(exact_window=window), None))
        lines[window] = next(ln for ln in format_demo(result).splitlines() if ln.startswith("exact layers:"))
    assert "reaching back 48 tokens" in lines[48] and "reaching back" not in lines[None], lines


def test_the_content_probe_shows_one_short_bar_and_logs_each_candidate(monkeypatch, caplog):
    # Issue 39: a bar per candidate, labelled with its whole description, made ~660 updates of one demo's stderr.
    import hf_kvtransfer.fitting.exact_layers as exact_layers

    retention = {1: 0.2, 2: 0.5, 3: 0.97}  # 4 layers: bisection tries 1, then 2 (fails), then 3 (passes)
    scored, bars = [], []

    def fake(*args, num_exact_layers, progress=True, **kwargs):
        scored.append((num_exact_layers, progress))
        r = retention[num_exact_layers]
        return {"retention": r, "retention_ci": [r - 0.05, r + 0.05], "context_gain": {"mean": 1.0, "ci": [0.5, 1.5]}}

    class Bar:  # records what the stage's bar was told
        def __init__(self, *args, **kwargs):
            self.kwargs, self.n = kwargs, 0
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def refresh(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(exact_layers, "repeated_span_retention", fake)
    monkeypatch.setattr(exact_layers, "progress_bar", Bar)

    class Layout:
        num_layers = 4

    class Mapper:
        target_layout = Layout()

    class Config:
        def get_text_config(self):
            return self

        vocab_size = 96

    class Target:
        config = Config()

    with caplog.at_level("INFO", logger=exact_layers.__name__):
        chosen, _ = exact_layers.choose_num_exact_layers(None, Target(), Mapper(), torch.randint(3, 96, (4000,)).tolist(),
                                                         progress=True)  # fmt: skip
    assert chosen == 3 and scored == [(1, False), (2, False), (3, False)]  # no bar of their own
    [bar] = bars
    assert bar.kwargs["desc"] == "exact-layers probe" and bar.kwargs["unit"] == "candidate"
    assert bar.n == bar.total == 3 and bar.kwargs["enabled"]  # ends full though the bisection may try fewer
    logged = [r.getMessage() for r in caplog.records]
    assert logged == [f"exact-layers probe: {k} of 4 layers exact: repeated-span retention {100 * r:.0f}% "
                      f"[{100 * r - 5:.0f}, {100 * r + 5:.0f}]" for k, r in retention.items()], logged  # fmt: skip


def test_a_family_directory_holds_small_and_large_or_source_and_target(tmp_path):
    """`--family` takes the bundled family's layout and the deep pair's; a directory with neither is refused with the
    layouts named."""
    import pytest

    from hf_kvtransfer.commands.demo import family_pair, find_family

    root = Path(__file__).resolve().parent.parent / "examples"
    assert family_pair(find_family(root / "family")) == (root / "family" / "small", root / "family" / "large")
    assert family_pair(find_family(root / "family_deep")) == (root / "family_deep" / "source", root / "family_deep" / "target")
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"small/ and large/ \(or source/ and target/\)"):
        find_family(tmp_path)  # a source without a target


def test_a_second_demo_reads_the_mapper_the_first_fitted(tmp_path, monkeypatch, capsys):
    """A demo without a mapper keeps the one it fits: the same command again reads it instead of fitting (the fit
    is not called), says where from, and answers as the first run did; other options, or --refit, fit anew."""
    from fit_fixtures import save_pair, write_corpus

    import hf_kvtransfer.commands.demo as demo
    from hf_kvtransfer.commands.cli import main

    monkeypatch.setenv("HF_KVTRANSFER_CACHE", str(tmp_path / "cache"))
    source, target = save_pair(tmp_path)
    corpus = write_corpus(tmp_path / "corpus.txt")
    args = ["demo", "--source", str(source), "--target", str(target), "--calibration", str(corpus), "--prompt",
            "the cat sat on the mat", "--recall-items", "0", "--num-sequences", "6", "--seq-len", "48",
            "--exact-layers-items", "8", "--max-new-tokens", "4"]  # fmt: skip
    fits = []
    real_fit = demo.fit_mapper
    monkeypatch.setattr(demo, "fit_mapper", lambda *a, **k: fits.append(k) or real_fit(*a, **k))
    assert main([*args, "--json", str(tmp_path / "first.json")]) == 0
    first_out, first_err = capsys.readouterr()
    assert len(fits) == 1 and "ready in" in first_out
    [kept] = [p for p in (tmp_path / "cache" / "demo").iterdir()]
    assert f"demo: the fitted mapper is kept in {kept}" in first_err, first_err
    assert (kept / "config.json").is_file() and not (kept / "checkpoint").exists()  # the fit's checkpoint is gone
    assert fits[0]["checkpoint_dir"] == str(kept / "checkpoint")  # where an interrupted fit resumes from
    assert main([*args, "--json", str(tmp_path / "second.json")]) == 0
    second_out = capsys.readouterr().out
    assert len(fits) == 1 and f"fitted by an earlier demo, read from {kept}" in second_out, second_out
    first, second = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("first", "second"))
    assert second["answers"] == first["answers"] and second["mapper"] == first["mapper"]
    assert second["mapper_read_from"] == str(kept) and first["mapper_read_from"] is None
    assert first["mapper_kept_in"] == str(kept) and second["mapper_kept_in"] is None
    assert main([*args, "--refit"]) == 0 and len(fits) == 2  # asked to fit again
    assert main([*args[:-1], "5"]) == 0 and len(fits) == 2  # the answer's length is no fit option
    assert main([*args, "--num-sequences", "8"]) == 0 and len(fits) == 3  # another calibration sample
    assert len(list((tmp_path / "cache" / "demo").iterdir())) == 2


def test_a_demo_whose_cache_folder_cannot_be_written_still_answers(tmp_path, monkeypatch, capsys, caplog):
    """A cache path that cannot hold a folder (a file there): the demo fits without a checkpoint, answers, and says
    in one warning where it could not keep the mapper and what to set."""
    from fit_fixtures import save_pair, write_corpus

    from hf_kvtransfer.commands.cli import main

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("HF_KVTRANSFER_CACHE", str(blocker))
    source, target = save_pair(tmp_path)
    corpus = write_corpus(tmp_path / "corpus.txt")
    args = ["demo", "--source", str(source), "--target", str(target), "--calibration", str(corpus), "--prompt",
            "the cat sat on the mat", "--recall-items", "0", "--num-sequences", "6", "--seq-len", "48",
            "--exact-layers-items", "8", "--max-new-tokens", "2"]  # fmt: skip
    with caplog.at_level("WARNING"):
        assert main(args) == 0
    out, err = capsys.readouterr()
    assert "ready in" in out and "is kept in" not in err
    warned = [r.getMessage() for r in caplog.records if "cannot keep the fitted mapper" in r.getMessage()]
    assert len(warned) == 1 and "HF_KVTRANSFER_CACHE" in warned[0], warned
