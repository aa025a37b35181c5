"""The docs name only files that exist, and no tracked text points outside the repository.

`mkdocs build --strict` (in `.ci/run`) checks the links between docs pages; it cannot check repository paths, which
the pages mention as code (`research/defaults/README.md`) because links to files outside `docs/` break a strict
build. This test checks those, in the docs pages and in every README.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = ("examples/", "research/", "hf_kvtransfer/", "tests/", "docs/")
# Built from parts so that this file does not match its own check.
FORBIDDEN = ("DES" + "IGN", "../" + "shared")

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_BRACES = re.compile(r"\{([^{}]*)\}")


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [name for name in out.decode().split("\0") if name]


def _pages() -> list[Path]:
    """The docs pages and the repository's READMEs (tracked ones: a fitted mapper's model card is not a page)."""
    pages = set((ROOT / "docs").rglob("*.md"))
    pages |= {ROOT / name for name in _tracked() if Path(name).name == "README.md"}
    return sorted(p for p in pages if p.is_file())


def _expand(path: str) -> list[str]:
    """`a.{md,json}` -> `a.md`, `a.json` (shell brace expansion, the docs' shorthand)."""
    match = _BRACES.search(path)
    if not match:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [expanded for option in match.group(1).split(",") for expanded in _expand(head + option + tail)]


def _exists(path: str) -> bool:
    if any(ch in path for ch in "*?["):
        return any(ROOT.glob(path.rstrip("/")))
    return (ROOT / path).exists()


def repo_paths(text: str) -> list[str]:
    """Repository paths named in inline code spans (fenced blocks hold commands whose outputs need not exist)."""
    text = _FENCE.sub("", text)
    paths = []
    for span in _CODE_SPAN.findall(text):
        for token in span.split():
            token = token.strip("\"'()[],;").rstrip(".:")
            if token.startswith(PREFIXES) and "<" not in token and "..." not in token:
                paths.append(token)
    return paths


def test_repo_paths_extraction():
    text = "see `research/x/README.md`, `python tests/a.py --x` and `eval_{a,b}.md`\n```bash\nresearch/out.json\n```"
    assert repo_paths(text) == ["research/x/README.md", "tests/a.py"]
    assert _expand("r/eval.{md,json}") == ["r/eval.md", "r/eval.json"]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_named_repo_paths_exist(page: Path):
    missing = [
        path
        for named in repo_paths(page.read_text(encoding="utf-8"))
        for path in _expand(named)
        if not _exists(path)
    ]
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_no_tracked_text_points_outside_the_repository():
    files = _tracked()
    if not files:
        pytest.skip("not a git checkout")
    offenders = []
    for name in files:
        path = ROOT / name
        if not path.is_file() or path.stat().st_size > 5_000_000:
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary
            continue
        text = data.decode("utf-8", errors="replace")
        offenders += [f"{name}: {word!r}" for word in FORBIDDEN if word in text]
    assert not offenders, "tracked text refers to files outside the repository: " + ", ".join(offenders)
