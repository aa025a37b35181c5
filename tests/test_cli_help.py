"""Every subcommand's `--help` ends with an example that its own parser accepts."""

import shlex

import pytest

from conftest import HANG_GUARD_S
from hf_kvtransfer.commands import cli


def _subcommands() -> dict:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return dict(action.choices)


@pytest.mark.parametrize("name", sorted(_subcommands()))
def test_help_ends_with_a_parsable_example(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([name, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "example:" in text
    example = text.split("example:", 1)[1].replace("\\\n", " ")
    commands = [line.strip() for line in example.splitlines() if line.strip().startswith("hf-kvtransfer ")]
    assert any(shlex.split(c, comments=True)[1] == name for c in commands), f"no `hf-kvtransfer {name} ...` example:\n{example}"
    for command in commands:  # each example parses (arguments known, required ones present)
        cli.build_parser().parse_args(shlex.split(command, comments=True)[1:])


def test_building_the_parser_imports_neither_torch_nor_transformers():
    """`hf-kvtransfer --help` stays fast (torch + transformers take seconds to import): checked by what gets
    imported, not by timing, so a loaded machine cannot make it flaky."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, hf_kvtransfer.commands.cli as c; c.build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'numpy') if m in sys.modules))"
    )
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"imported while building the parser: {done.stdout.strip()}"
    # The exports still resolve (lazily) to the real classes.
    import hf_kvtransfer
    from hf_kvtransfer.core.mapper import KVMapper

    assert hf_kvtransfer.KVMapper is KVMapper and "KVMapper" in dir(hf_kvtransfer)


# -- issue 23: the first commands a newcomer types ---------------------------------------------------------------

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_main_help_and_a_bare_command_print_the_usage(capsys):
    # An unescaped % in a subcommand's help ("95% CIs") made both crash in argparse's formatting.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "95% CIs" in out and "example:" in out
    assert cli.main([]) == 2
    assert "usage: hf-kvtransfer" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--debug", "info", "x"], ["info", "x", "--debug"], ["info", "--debug", "x"]])
def test_debug_works_before_or_after_the_subcommand(argv):
    args = cli.build_parser().parse_args(argv)
    assert args.debug is True and args.mapper == "x"
    assert cli.build_parser().parse_args(["info", "x"]).debug is False
    assert cli.build_parser().parse_args(["info", "x", "-v"]).verbose is True


def test_debug_after_the_subcommand_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_DEBUG", raising=False)
    with pytest.raises(OSError, match="does not exist"):
        cli.main(["info", "./no-such-mapper", "--debug"])


def test_the_debug_hint_only_when_the_line_does_not_say_everything(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_DEBUG", raising=False)
    assert cli.main(["info", "./no-such-mapper"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("error: local directory ./no-such-mapper does not exist"), lines
    # this library's line says everything: a hint, if any, is the next step (a mistyped path's), not --debug
    assert len(lines) == 2 and lines[1].startswith("hint: a mapper is a folder") and "--debug" not in lines[1], lines

    def third_party(args):  # an error worded by another library: its traceback may say more
        import json

        json.loads("{")

    monkeypatch.setattr(cli, "_run_info", third_party)
    assert cli.main(["info", "x"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[1] == f"hint: {cli._DEBUG_HINT}", lines


def _all_examples() -> list[str]:
    """Every `hf-kvtransfer ...` line of the main --help and of each subcommand's --help, in that order."""
    parser = cli.build_parser()
    texts = [parser.epilog] + [sub.epilog for sub in _subcommands().values()]
    lines = []
    for text in texts:
        body = text.split("example:", 1)[1].replace("\\\n", " ")
        lines += [" ".join(line.split()) for line in body.splitlines() if line.strip().startswith("hf-kvtransfer ")]
    return lines


# Extra flags that make a long example cheap (argparse keeps the last value of a repeated option).
_TINY = {
    "fit": ["--num-sequences", "6", "--seq-len", "48", "--exact-layers", "1", "--heldout-fraction", "0"],
    "eval": ["--items", "2", "--max-windows", "2", "--num-items", "2", "--prefix-len", "64", "--context-len", "32",
             "--max-new-tokens", "2", "--turns", "2", "--turn-len", "8", "--depth-items", "2", "--depth-lengths", "256"],
    "demo": ["--num-sequences", "6", "--seq-len", "48", "--recall-items", "2", "--max-new-tokens", "2",
             "--exact-layers-items", "8"],
}  # fmt: skip
# Examples only parsed, with their local paths checked: timing runs (bench), and models or mappers on the real Hub
# (plan runs: it has the shipped configs of those models).
_PARSE_ONLY = re.compile(r"^hf-kvtransfer bench |^hf-kvtransfer (?!plan ).*(Qwen/|meta-llama/)")


# Slow (every example of every --help, the deep pair's demo among them: about 9 minutes on 2 cores; .ci/run runs it).
@pytest.mark.slow
def test_every_help_example_runs_from_the_repository_root(tmp_path, monkeypatch, capsys, hub_server):
    """Each example as printed, from a folder laid out like the repository root (examples/ is the repository's):
    fits, solves, infos, evals, demos, pushes (to the test Hub, as its org) and plans run with tiny sizes; bench and
    the examples naming real Hub models are parsed and the local paths they name exist."""
    import shlex

    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_TOKEN", hub_server.write_token)
    monkeypatch.delenv("HF_KVTRANSFER_FAMILY", raising=False)
    examples = _all_examples()
    names = {shlex.split(line)[1] for line in examples}
    assert names == set(_subcommands()), names
    # Producers first (fit/solve write what info/eval/demo/push read), in the order the help prints them.
    order = {"fit": 0, "solve": 1}
    ran = []
    # An example printed twice (`hf-kvtransfer demo` in the main help and in demo's) runs once.
    for line in sorted(dict.fromkeys(examples), key=lambda line: order.get(shlex.split(line)[1], 2)):
        argv = shlex.split(line.replace("my-org/", f"{hub_server.org}/"), comments=True)[1:]
        for token in argv:
            if token.startswith("examples/"):
                assert Path(token).exists(), f"{line}: {token} does not exist in the repository"
        cli.build_parser().parse_args(argv)
        if _PARSE_ONLY.search(line):
            continue
        code = cli.main(argv + _TINY.get(argv[0], []))
        captured = capsys.readouterr()
        assert code == 0, f"{line}\n{captured.err[-2000:]}"
        ran.append(argv[0])
    assert set(ran) == set(_subcommands()) - {"bench"}, ran


# -- issue 39: every option says what it does -----------------------------------------------------------------


def _options_without_help(parser) -> list[str]:
    import argparse

    return [
        "/".join(action.option_strings) for action in parser._actions
        if action.option_strings and action.help != argparse.SUPPRESS and not (action.help or "").strip()
    ]  # fmt: skip


def test_every_option_of_every_subcommand_has_help():
    parser = cli.build_parser()
    missing = {"hf-kvtransfer": _options_without_help(parser)}
    missing.update({name: _options_without_help(sub) for name, sub in _subcommands().items()})
    assert not {name: options for name, options in missing.items() if options}, missing
    # the walk reaches the options that had none (eval's and demo's --device, eval's --seed, fit's --trust-remote-code)
    walked = {(name, flag) for name, sub in _subcommands().items() for a in sub._actions for flag in a.option_strings}
    assert {("eval", "--device"), ("demo", "--device"), ("eval", "--seed"), ("fit", "--trust-remote-code")} <= walked
