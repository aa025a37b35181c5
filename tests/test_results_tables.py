"""The results tables of the README and the docs say what their result files say.

`docs/render_tables.py` renders each table from the JSONs and logs a study wrote. These tests fail when a committed
snippet (`docs/snippets/*.md`) or a generated block of the README differs from what the result files give (run
`python docs/render_tables.py` to update them), when a page includes a snippet that does not exist, or when a table
names a result file that is not in the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


def _renderer():
    return load_script(ROOT / "docs" / "render_tables.py")


render_tables = _renderer()


@pytest.mark.parametrize("name", sorted(render_tables.TABLES))
def test_snippet_is_what_its_result_files_give(name: str):
    path = render_tables.SNIPPETS / f"{name}.md"
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing: run python docs/render_tables.py"
    assert path.read_text(encoding="utf-8") == render_tables.render(name), (
        f"{path.relative_to(ROOT)} differs from its result files: run python docs/render_tables.py"
    )


def test_readme_tables_are_what_their_result_files_give():
    readme = render_tables.README.read_text(encoding="utf-8")
    blocks = [m.group("name") for m in render_tables.BLOCK.finditer(readme)]
    assert blocks, "README.md has no generated table (<!-- table:NAME --> ... <!-- /table -->)"
    expected = render_tables.readme_with_tables(readme, {name: render_tables.render(name) for name in blocks})
    assert readme == expected, "a generated table in README.md differs from its result files: run python docs/render_tables.py"


def test_every_generated_table_names_its_results():
    for name in render_tables.TABLES:
        last = render_tables.render(name).rstrip("\n").splitlines()[-1]
        assert last.startswith("Results: "), f"table {name!r} does not end with its result files"
        for result in render_tables.RESULTS.values():
            if result.path in last:
                assert f"({result.date})" in last and result.command in last


def test_result_files_exist_and_have_a_date():
    for key, result in render_tables.RESULTS.items():
        assert (ROOT / result.path).is_file(), f"RESULTS[{key!r}] names a missing file: {result.path}"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", result.date), f"RESULTS[{key!r}] has no date"
        assert result.command.strip(), f"RESULTS[{key!r}] has no command"


def test_included_snippets_exist():
    include = re.compile(r'^--8<-- "([^"]+)"', re.M)
    for page in (ROOT / "docs").rglob("*.md"):
        for path in include.findall(page.read_text(encoding="utf-8")):
            assert (ROOT / path).is_file(), f"{page.relative_to(ROOT)} includes a missing snippet: {path}"


def test_check_mode_reports_a_stale_snippet(tmp_path, monkeypatch):
    monkeypatch.setattr(render_tables, "SNIPPETS", tmp_path)
    monkeypatch.setattr(render_tables, "README", tmp_path / "README.md")
    (tmp_path / "README.md").write_text("no tables\n", encoding="utf-8")
    assert render_tables.main([]) == 0  # writes every snippet
    assert render_tables.main(["--check"]) == 0
    (tmp_path / "time-split.md").write_text("| an old table |\n", encoding="utf-8")
    assert render_tables.main(["--check"]) == 1
