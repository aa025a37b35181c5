"""The README's quickstart runs as written (on the bundled model family), and its demo transcript is what the demo
printed.

Its fit runs the content probe on fewer items than the default (16 of 64 per probe, as the example scripts' tests
do): the same code path at a quarter of the scoring; the numbers the README prints come from the defaults.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _quickstart_code() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- quickstart:[^>]*-->\s*```python\n(.*?)```", readme, re.S)
    assert match, "README.md lost its quickstart block"
    return match.group(1)


def test_readme_quickstart_runs(tmp_path, monkeypatch, capsys):
    if not (ROOT / "examples/family/large/model.safetensors").is_file():
        pytest.fail("examples/family is missing: the bundled model family must be committed")
    code = _quickstart_code()
    import hf_kvtransfer

    fit_mapper, fits = hf_kvtransfer.fit_mapper, []

    def fewer_probe_items(*args, **kwargs):
        fits.append(kwargs.setdefault("exact_layers_items", 16))
        return fit_mapper(*args, **kwargs)

    monkeypatch.setattr(hf_kvtransfer, "fit_mapper", fewer_probe_items)  # what `from hf_kvtransfer import` finds
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out
    assert (tmp_path / "mappers/small-to-large/model.safetensors").is_file()
    assert printed.startswith("[") and len(printed) > 10
    assert fits == [16]  # the block's one fit, with the fewer items


def test_readme_demo_transcript_is_what_the_demo_printed():
    """The demo's transcript in the README is what `format_demo` prints from the result file the README cites for it:
    each stretch between "..." lines, joined and whitespace-normalised, appears in that printout. A demo re-run, or a
    change to what the demo prints, shows up here until the README quotes the new output."""

    from hf_kvtransfer.commands.demo import format_demo

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```\n\$ hf-kvtransfer demo[^\n]*\n(.*?)```", text, re.S).group(1)
    cited = re.search(r"It printed \(.*?`(research/[^`]+\.json)`\)", text, re.S).group(1)
    result = json.loads((ROOT / cited).read_text(encoding="utf-8"))
    printed = " ".join(format_demo(result).split())
    stretches = [" ".join(s.split()) for s in re.split(r"^\.\.\.$", block, flags=re.M)]
    assert all(stretches) and len(stretches) > 1
    for stretch in stretches:
        assert stretch in printed, f"README quotes a demo line that {cited} does not print: {stretch[:200]}"
