"""Every subcommand's `--help` ends with an example that its own parser accepts."""

import shlex

import pytest

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
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"imported while building the parser: {done.stdout.strip()}"
    # The exports still resolve (lazily) to the real classes.
    import hf_kvtransfer
    from hf_kvtransfer.core.mapper import KVMapper

    assert hf_kvtransfer.KVMapper is KVMapper and "KVMapper" in dir(hf_kvtransfer)
