"""`hf-kvtransfer` misuse: every known failure is one line (plus a hint) and a non-zero exit; bugs keep their traceback.

Each case is one a user ran into (issue 13). The shared check: exit code != 0, stderr is `error: ...` on ONE line,
optionally followed by a `hint: ...` line, it names the file / id / number at fault, and holds no traceback.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_kvtransfer.fitting.calibration_pass as calibration_pass
from conftest import HANG_GUARD_S, exact_identity_mapper, tiny_model
from fit_fixtures import save_pair, write_corpus
from hf_kvtransfer.commands import cli
from hf_kvtransfer.commands.cli import main

REPO = Path(__file__).resolve().parents[1]


def assert_one_line(code: int, err: str, *names: str) -> str:
    """The error contract: non-zero exit, `error:` line + optional `hint:` line, naming `names`, no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0, err
    assert "Traceback" not in err, err
    assert lines and lines[0].startswith("error: "), err
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("hint: ")), err
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    return lines[0]


@pytest.fixture(scope="module")
def mappers(tmp_path_factory):
    """A saved mapper and a copy whose model.safetensors lost its second half (an interrupted download)."""
    root = tmp_path_factory.mktemp("mappers")
    mapper = exact_identity_mapper(tiny_model("qwen3", num_hidden_layers=2))
    mapper.save_pretrained(root / "good")
    shutil.copytree(root / "good", root / "broken")
    weights = root / "broken" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return root / "good", root / "broken"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    source, target = save_pair(root)
    return source, target, write_corpus(root / "corpus.txt", num_paragraphs=60)


# -- a. a truncated model.safetensors ----------------------------------------------------------------------


def test_info_validates_the_weights_it_describes(mappers, capsys):
    good, broken = mappers
    assert main(["info", str(good)]) == 0 and "MiB on disk" in capsys.readouterr().out
    code = main(["info", str(broken)])
    out, err = capsys.readouterr()
    assert_one_line(code, err, str(broken / "model.safetensors"), "truncated")
    assert "MiB on disk" not in out  # no summary of a mapper that does not load


@pytest.mark.parametrize("command", ["eval", "demo", "push"])
def test_truncated_mapper_is_one_line_in_every_command(command, mappers, pair, tmp_path, capsys, unreachable_hub):
    _, broken = mappers
    source, target, corpus = pair
    argv = {
        "eval": ["eval", "--source", str(source), "--target", str(target), "--mapper", str(broken), "--text", str(corpus)],
        "demo": ["demo", "--source", str(source), "--target", str(target), "--mapper", str(broken), "--text", str(corpus)],
        "push": ["push", str(broken), "someone/some-mapper"],
    }[command]
    code = main(argv)
    assert_one_line(code, capsys.readouterr().err, str(broken / "model.safetensors"), "truncated")


def test_subprocess_one_line_and_traceback_only_with_hf_debug(mappers):
    _, broken = mappers
    command = [sys.executable, "-m", "hf_kvtransfer.commands.cli", "info", str(broken)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DEBUG": ""}
    plain = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=HANG_GUARD_S)
    assert plain.returncode == 1 and plain.stdout == ""
    assert_one_line(plain.returncode, plain.stderr, str(broken / "model.safetensors"))
    debug = subprocess.run(command, capture_output=True, text=True, env={**env, "HF_DEBUG": "1"}, cwd=REPO, timeout=HANG_GUARD_S)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "model.safetensors" in debug.stderr


# -- b. --device cuda on a torch without CUDA ------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")
def test_bench_on_cuda_without_cuda_is_one_line(capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # bench's default: the bundled family's configs
    code = main(["bench", "--device", "cuda", "--quick", "--no-reexec"])
    line = assert_one_line(code, capsys.readouterr().err, "CUDA is not available", torch.__version__, "--device cpu")
    assert ("in this torch build" in line) == (torch.version.cuda is None)


# -- c. local paths are never sent to the Hub ------------------------------------------------------------


def test_mistyped_local_mapper_folder_says_there_is_none(tmp_path, monkeypatch, capsys, hub_server):
    # `org/name` is a Hub id even next to a folder `org/` (issue 23); when the Hub has no such repo either, the line
    # says that there is no local directory of that name and what the folder holds.
    (tmp_path / "mappers" / "small-to-large").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    code = main(["info", "mappers/does-not-exist"])
    line = assert_one_line(code, capsys.readouterr().err, "local directory mappers/does-not-exist does not exist")
    assert "small-to-large" in line and "not found on the Hub" in line  # what is there instead, and the Hub's answer


@pytest.mark.parametrize("name", ["./nope", "../nope", "nope/./x", "~/no-such-model-dir", "not a hub id"])
def test_missing_local_model_directory_is_one_line(name, pair, tmp_path, capsys, hub_server):
    _, target, corpus = pair
    code = main(["fit", "--source", name, "--target", str(target), "--dataset", str(corpus), "--output", str(tmp_path / "o")])
    assert_one_line(code, capsys.readouterr().err, f"local directory {name} does not exist", "source")
    assert hub_server.requests == [] and not (tmp_path / "o").exists()


# -- d. a mistyped dataset id -----------------------------------------------------------------------------


def test_mistyped_dataset_fails_once_with_one_request(pair, tmp_path, capsys, hub_server, retry_waits):
    source, target, _ = pair
    code = main(["fit", "--source", str(source), "--target", str(target), "--output", str(tmp_path / "o"),
                 "--dataset", "someone/fineweb-eud", "--num-sequences", "4", "--seq-len", "16"])  # fmt: skip
    err = capsys.readouterr().err
    assert_one_line(code, err, "'someone/fineweb-eud'", "is neither a local file or directory nor a dataset on the Hub")
    assert "Retry" not in err and "retry" not in err
    # One question to the Hub about it (no retries), and none about the models (local) or anything else.
    assert [path for _, path, _ in hub_server.requests] == ["/api/datasets/someone/fineweb-eud"]
    assert retry_waits == []  # was 29 s of retries; no wait at all, whatever the machine's load


# -- e. Ctrl-C during fit ---------------------------------------------------------------------------------


def test_ctrl_c_during_fit_says_where_the_checkpoint_is(pair, tmp_path, monkeypatch, capsys):
    real, calls = calibration_pass.capture_kv, []

    def capture_then_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # inside the second batch: one batch done, then the graceful stop writes a checkpoint
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(calibration_pass, "capture_kv", capture_then_interrupt)
    source, target, corpus = pair
    stats = tmp_path / "stats"
    argv = ["fit", "--source", str(source), "--target", str(target), "--output", str(tmp_path / "o"), "--dataset",
            str(corpus), "--num-sequences", "8", "--seq-len", "16", "--batch-size", "2", "--top-k", "1",
            "--heldout-fraction", "0", "--stats-dir", str(stats),
            "--residual-inputs", "off"]  # fmt: skip  (counted: 2 capture_kv calls a batch without residual statistics)
    assert main(argv) == 130
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    where = stats / "checkpoints"
    assert any(line.startswith("interrupted") and str(where) in line for line in lines), lines
    assert any(line.startswith("hint: ") and "same command" in line and "resume" in line for line in lines), lines
    assert "Traceback" not in "\n".join(lines)
    assert list(where.glob("checkpoint-*.safetensors")), "the message names a checkpoint that is not there"
    # ... and the same command does resume: only the batches left are run.
    calls.clear()
    monkeypatch.setattr(calibration_pass, "capture_kv", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    assert main(argv) == 0
    assert len(calls) == 2 * 2  # 2 of 4 batches were done before the interrupt; 2 models each for the rest


# -- f. --seq-len beyond max_position_embeddings ---------------------------------------------------------------


def test_seq_len_beyond_max_positions_warns_once(pair, tmp_path, caplog):
    source, target, corpus = pair
    limit = tiny_model("qwen3", num_hidden_layers=1).config.max_position_embeddings  # what save_pair's models have
    seq_len = limit + 8
    with caplog.at_level("WARNING"):
        assert main(["fit", "--source", str(source), "--target", str(target), "--output", str(tmp_path / "o"),
                     "--dataset", str(corpus), "--num-sequences", "1", "--seq-len", str(seq_len), "--top-k", "1",
                     "--heldout-fraction", "0"]) == 0  # fmt: skip
    warned = [r.getMessage() for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert str(seq_len) in warned[0] and str(limit) in warned[0]


# -- g. library bugs keep their traceback ------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc, user_error",
    [
        (TypeError("bug"), False),
        (KeyError("bug"), False),
        (AttributeError("bug"), False),
        (ImportError("cannot import name 'x' from 'y'"), False),
        (ImportError("plots need matplotlib: pip install matplotlib"), True),
        (ValueError("bad value 3"), True),
        (FileNotFoundError("no such file x"), True),
    ],
)
def test_only_user_errors_are_one_line(exc, user_error, mappers, monkeypatch, capsys):
    def failing(args):
        raise exc

    monkeypatch.setattr(cli, "_run_info", failing)
    monkeypatch.delenv("HF_DEBUG", raising=False)
    if user_error:
        assert_one_line(main(["info", str(mappers[0])]), capsys.readouterr().err, str(exc).strip("'"))
    else:
        with pytest.raises(type(exc)):
            main(["info", str(mappers[0])])


# -- issue 23: the same contract on bad files and paths, table-driven ------------------------------------------


@pytest.fixture(scope="module")
def bad_mappers(mappers, tmp_path_factory):
    """Broken copies of a good mapper folder: NaN weights, no config.json; and a mapper for another model pair."""
    from safetensors.torch import load_file, save_file

    good, _ = mappers
    root = tmp_path_factory.mktemp("bad")
    shutil.copytree(good, root / "nan")
    weights = load_file(root / "nan" / "model.safetensors")
    save_file({k: torch.full_like(v, float("nan")) for k, v in weights.items()}, root / "nan" / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    shutil.copytree(good, root / "no-config")
    (root / "no-config" / "config.json").unlink()
    exact_identity_mapper(tiny_model("qwen3", num_hidden_layers=3)).save_pretrained(root / "other-pair")
    return root


BAD_INPUTS = {
    # case: (argv builder, names builder, hub: "server" | "down")
    "truncated weights": (lambda f: ["info", str(f["broken"])], lambda f: [str(f["broken"] / "model.safetensors"), "truncated"], "down"),
    "NaN weights (info)": (lambda f: ["info", str(f["nan"])], lambda f: [str(f["nan"]), "non-finite"], "down"),
    "NaN weights (demo)": (
        lambda f: ["demo", "--source", str(f["source"]), "--target", str(f["target"]), "--mapper", str(f["nan"])],
        lambda f: [str(f["nan"]), "non-finite"], "down",
    ),
    "missing config.json": (lambda f: ["info", str(f["no-config"])], lambda f: [str(f["no-config"]), "config.json"], "down"),
    "wrong pair": (
        lambda f: ["eval", "--source", str(f["source"]), "--target", str(f["target"]), "--mapper", str(f["other-pair"]),
                   "--text", str(f["corpus"])],
        lambda f: ["num_hidden_layers"], "down",
    ),
    "mapper path typo": (lambda f: ["info", "./mappers/smal-to-large"], lambda f: ["./mappers/smal-to-large", "does not exist"], "down"),
    "model path typo": (
        lambda f: ["demo", "--source", str(f["source"]) + "-typo", "--target", str(f["target"])],
        lambda f: [str(f["source"]) + "-typo", "does not exist"], "down",
    ),
    "Hub id shadowed by a folder, Hub has none": (
        lambda f: ["info", "mappers/typo"], lambda f: ["mappers/typo", "local directory", "not found on the Hub"], "server",
    ),
    "Hub id shadowed by a folder, no network": (
        lambda f: ["info", "mappers/typo"], lambda f: ["mappers/typo", "local directory", "could not reach the Hub"], "down",
    ),
    "mistyped model id": (
        lambda f: ["demo", "--source", "someone/no-such-model", "--target", str(f["target"])],
        lambda f: ["someone/no-such-model", "has no model repo"], "server",
    ),
    "model id, no network": (
        lambda f: ["demo", "--source", "someone/no-such-model", "--target", str(f["target"])],
        lambda f: ["someone/no-such-model", "could not reach the Hub"], "down",
    ),
    "push without a token": (lambda f: ["push", str(f["good"]), "someone/m"], lambda f: ["--token"], "server"),
    # Said before the run, not when a long one ends and would lose its results.
    "eval --json into a missing folder": (
        lambda f: ["eval", "--source", str(f["source"]), "--target", str(f["target"]), "--mapper", str(f["good"]),
                   "--text", str(f["corpus"]), "--json", "results/typo/eval.json"],
        lambda f: ["--json results/typo/eval.json", "does not exist"], "down",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_files_and_paths_are_one_line_naming_them(case, mappers, bad_mappers, pair, tmp_path, monkeypatch, capsys, request,
                                                       retry_waits):  # fmt: skip
    argv_of, names_of, hub = BAD_INPUTS[case]
    request.getfixturevalue("hub_server" if hub == "server" else "unreachable_hub")
    (tmp_path / "mappers" / "small-to-large").mkdir(parents=True)  # a folder that shadows mappers/... Hub ids
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_DEBUG", raising=False)
    good, broken = mappers
    source, target, corpus = pair
    files = {"good": good, "broken": broken, "source": source, "target": target, "corpus": corpus,
             **{p.name: p for p in bad_mappers.iterdir()}}  # fmt: skip
    code = main(argv_of(files))
    out, err = capsys.readouterr()
    assert_one_line(code, err, *names_of(files))
    assert "MiB on disk" not in out  # never a summary of what does not load
    assert retry_waits == [], "retried instead of failing fast"


def test_a_mistyped_model_id_asks_the_hub_once(pair, tmp_path, monkeypatch, capsys, hub_server):
    # was: three requests, and ~30 s of retries when the Hub cannot be reached
    _, target, _ = pair
    monkeypatch.chdir(tmp_path)
    code = main(["demo", "--source", "someone/no-such-model", "--target", str(target)])
    assert_one_line(code, capsys.readouterr().err, "someone/no-such-model")
    assert [path for _, path, _ in hub_server.requests] == ["/api/models/someone/no-such-model"]


def test_a_hub_id_next_to_a_folder_of_its_org_goes_to_the_hub(mappers, tmp_path, monkeypatch, hub_server):
    from hf_kvtransfer import KVMapper

    good, _ = mappers
    repo = f"{hub_server.org}/family-kv"
    KVMapper.from_pretrained(good).push_to_hub(repo, token=hub_server.write_token)
    (tmp_path / hub_server.org / "some-model").mkdir(parents=True)  # e.g. models downloaded under ./Qwen/...
    monkeypatch.chdir(tmp_path)
    loaded = KVMapper.from_pretrained(repo)
    assert loaded.config.selected_layers == KVMapper.from_pretrained(good).config.selected_layers


def test_plan_says_when_it_falls_back_to_the_shipped_configs(capsys, caplog, unreachable_hub):
    with caplog.at_level("WARNING"):
        assert main(["plan", "--source", "Qwen/Qwen3-0.6B", "--target", "Qwen/Qwen3-1.7B"]) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("Qwen/Qwen3-0.6B shipped with hf-kvtransfer" in w for w in warned), warned


# -- issue 39: the common mistakes print a hint, the next step the error line does not already say -----------------


@pytest.fixture(scope="module")
def pair_mapper(pair, tmp_path_factory):
    """A mapper (random weights) whose shapes fit `pair`'s source -> target, saved."""
    from transformers import AutoConfig

    from hf_kvtransfer import KVMapper, MapperConfig

    source, target, _ = pair
    src, tgt = AutoConfig.from_pretrained(source), AutoConfig.from_pretrained(target)
    config = MapperConfig(source_config=src.to_dict(), target_config=tgt.to_dict(),
                          selected_layers=[[t] for t in range(tgt.num_hidden_layers)])  # fmt: skip
    path = tmp_path_factory.mktemp("pair-mapper") / "s2t"
    KVMapper(config).save_pretrained(path)
    return path


HINTED = {
    # case: (argv builder, what the hint must say, given the files and the working directory)
    "mapper path typo": (
        lambda f: ["info", "./mappers/smal-to-large"],
        lambda f, cwd: ["hf-kvtransfer fit ... --output DIR", f"relative paths are read from the current directory, {cwd}"],
    ),
    "model path typo": (
        lambda f: ["demo", "--source", str(f["source"]) + "-typo", "--target", str(f["target"])],
        lambda f, cwd: ["a model is a folder holding config.json"],
    ),
    "mapper for another pair": (
        lambda f: ["eval", "--source", str(f["source"]), "--target", str(f["target"]), "--mapper", str(f["other-pair"]),
                   "--text", str(f["corpus"])],
        lambda f, cwd: [f"hf-kvtransfer fit --source {f['source']} --target {f['target']}", "--mapper"],
    ),
    "reverse mapper for the forward pair": (
        lambda f: ["eval", "--source", str(f["source"]), "--target", str(f["target"]), "--mapper", str(f["s2t"]),
                   "--reverse-mapper", str(f["s2t"]), "--text", str(f["corpus"])],
        lambda f, cwd: [f"hf-kvtransfer fit --source {f['target']} --target {f['source']}", "--reverse-mapper"],
    ),
    "missing calibration file": (
        lambda f: ["fit", "--source", str(f["source"]), "--target", str(f["target"]), "--dataset", "corpus.txt",
                   "--output", "out"],
        lambda f, cwd: ["--dataset takes a local .txt", f"relative paths are read from the current directory, {cwd}"],
    ),
    "missing --text file": (
        lambda f: ["eval", "--source", str(f["source"]), "--target", str(f["target"]), "--mapper", str(f["s2t"]),
                   "--text", "heldout.txt"],
        lambda f, cwd: ["--text takes a text file", "relative paths"],
    ),
    "unknown task": (
        lambda f: ["eval", "--source", str(f["source"]), "--target", str(f["target"]), "--mapper", str(f["s2t"]),
                   "--text", str(f["corpus"]), "--tasks", "recal"],
        lambda f, cwd: ["--tasks perplexity,recall,handoff"],
    ),
    "missing matplotlib": (
        lambda f: ["eval", "--source", str(f["source"]), "--target", str(f["target"]), "--mapper", str(f["s2t"]),
                   "--text", str(f["corpus"]), "--plot", "eval.png"],
        lambda f, cwd: ["leave out --plot"],
    ),
    "unknown model, --offline": (
        lambda f: ["plan", "--source", "someone/no-such-model", "--target", str(f["target"]), "--offline"],
        lambda f, cwd: ["leave out --offline"],
    ),
}


@pytest.mark.parametrize("case", sorted(HINTED))
def test_common_mistakes_print_a_hint(case, mappers, bad_mappers, pair, pair_mapper, tmp_path, monkeypatch, capsys,
                                      unreachable_hub):  # fmt: skip
    argv_of, hints_of = HINTED[case]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_DEBUG", raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails: a missing optional package
    source, target, corpus = pair
    files = {"source": source, "target": target, "corpus": corpus, "s2t": pair_mapper,
             **{p.name: p for p in bad_mappers.iterdir()}}  # fmt: skip
    code = main(argv_of(files))
    out, err = capsys.readouterr()
    line = assert_one_line(code, err)
    hint = err.strip().splitlines()[-1]
    assert hint.startswith("hint: ") and hint != f"hint: {cli._DEBUG_HINT}", err
    for text in hints_of(files, tmp_path):
        assert text in hint, f"{text!r} not in {hint!r}"
    assert hint.removeprefix("hint: ") not in line  # a next step, not the error again
    assert not (tmp_path / "out").exists() and not (tmp_path / "eval.png").exists()
