"""Every percentage, speed-up and loss in nats the README, the method, the guides, the results pages, the bundled
families' READMEs and the studies' READMEs under research/ quote comes from a result file.

A figure such as `97.8%`, `1.98x` or `4.75 nats` (or both of `6.95 vs 10.08 nats`) in a page's prose (outside code
blocks and generated tables) must be a value of a result file named in the same section of the page (or in the
page's opening, before its first `##`), as the value itself, as a percentage of a fraction, or rounded; or a figure
of a generated table included in that section (`docs/snippets/`, which `docs/render_tables.py` renders from result
files). A percentage is a fraction times 100, or a number the file itself gives as a percentage: written with a `%`
in a log or a table, or under a key naming the unit (`..._pct`, `...percent`) in JSON. A speed-up is a JSON value,
or in a log or a table a number written with its `x`, or a number printed to 3 or more decimals (a computed ratio)
quoted rounded; a loss likewise, written with its `nats` or printed to 3 or more decimals. So a share worked out from two measurements (`12% less time`) fails unless a file holds it, and a
step count or a millisecond in a long log backs no speed-up, however many numbers the cited files hold. Result files are the files under `research/` in a `results*` folder. Numbers that are not results (a probe's
threshold, a CI's level) are allowed by the patterns in `NOT_RESULTS`, each with its reason.

So a figure whose result file is not in the repository, or not named beside it, fails here; a figure that no
longer matches its file fails too, unless the new value happens to round to it.
"""

from __future__ import annotations

import json
import math
import re
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Pages whose figures are not checked (none: a page whose prose predates the rule would be listed here, with why).
PENDING: list[str] = []
# Pages whose figures are computed from model configs by `hf-kvtransfer plan`, the same on any machine, not measured:
# `tests/test_plan.py` checks them against `plan_transfer`.
COMPUTED = ["docs/guides/plan.md"]
# Pages whose figures are checked: the README, the docs home, the changelog, the method, every guide, every results
# page, the bundled families' READMEs and every study's README under research/.
CHECKED = ["README.md", "docs/index.md", "docs/changelog.md", "docs/method.md", "examples/family/README.md",
           "examples/family_deep/README.md"] + [
    page
    for pattern in ("docs/guides/*.md", "docs/results/*.md", "research/*/README.md")
    for page in sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern))
    if page not in PENDING + COMPUTED
]

# Figures that are settings or goals, not results: a pattern matched around the figure, and why.
NOT_RESULTS = [
    (r"95%\s+(?:bootstrap\s+)?(?:CI|confidence|interval)|95% CIs?\b|\(95% CI", "the level of a confidence interval"),
    (r"paired 95% interval", "the level of a confidence interval"),
    (r">= ?\d+(?:\.\d+)?(?:%|x)", "a goal or a threshold, not a measurement"),
    (r"keeps? 9[05]% of (?:the|its) (?:target's )?copying", "the fit's probe threshold (min_retention)"),
    (r"not 5% below", "the fit's cued-recall margin"),
    (r"last 10% of the\s+sequences|keeps the 90%", "the fit's held-out fraction, a setting"),
    (r"keep 95% of it", "the exact-layer probe's threshold, a setting"),
    (r"chance \(25%\)", "the chance level of a four-way choice"),
    (r"\b1?00?% means", "the ends of a scale, defined"),
    (r"\|\s*\d+%\s*\|\s*\d+%\s*\|\s*\d+%\s*\|", "a training mix's row: each phase's share of a kind of row, a setting"),
]

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
FIGURE = re.compile(r"(?<![\w.\-/\[])(?:(\d+(?:\.\d+)?)\s?-\s?)?(-?\d+(?:\.\d+)?)(%|x\b)")
# A loss in nats, alone or as the second of a pair ("6.95 vs 10.08 nats", "10.51 against 10.53 nats").
NATS = re.compile(
    r"(?<![\w.\-/\[])(?:(-?\d+\.\d+)\s+(?:vs\.?|against|and|to|->)\s+(?:[a-z' ]{0,20}?)?)?(-?\d+\.\d+)\s?(nats)\b"
)
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
GENERATED = re.compile(r"<!-- table:[\w-]+ -->.*?<!-- /table -->", re.S)
INCLUDE = re.compile(r'^--8<-- "([^"]+)"\s*$', re.M)
HEADING = re.compile(r"^#{1,6} ", re.M)
CODE_SPAN = re.compile(r"`([^`]+)`")
BRACES = re.compile(r"\{([^{}]*)\}")


def _result_files() -> list[Path]:
    files = []
    for path in (ROOT / "research").rglob("*"):
        rel = path.relative_to(ROOT)
        if (
            path.is_file()
            and any(part.startswith("results") for part in rel.parts[:-1])
            and path.suffix in {".json", ".log", ".md", ".txt"}
            and path.name != "README.md"
        ):
            files.append(path)
    return sorted(files)


RESULT_FILES = _result_files()


PERCENT_KEY = re.compile(r"(?:pct|percent)$", re.I)
# A number a log or a Markdown table gives as a percentage, or as a speed-up.
WRITTEN_PERCENT = re.compile(r"(-?\d+(?:\.\d+)?)\s?%")
WRITTEN_SPEEDUP = re.compile(r"(-?\d+(?:\.\d+)?)x\b")
WRITTEN_NATS = re.compile(r"(-?\d+(?:\.\d+)?)\s?nats\b")
# A number a log prints to this many decimals or more is a computed value (a ratio), which prose quotes rounded.
COMPUTED_DECIMALS = 3


def _walk(value, out: list[float], percents: list[float] | None = None) -> None:
    """The numbers of a JSON value into `out`, and those under a key naming a percentage into `percents` too."""
    if isinstance(value, dict):
        for key, item in value.items():
            _walk(item, out, percents)
            if percents is not None and PERCENT_KEY.search(str(key)):
                _walk(item, percents)
    elif isinstance(value, list):
        # A longer list of numbers holds per-item scores, not quoted figures; a list of records (rows) is read.
        if len(value) <= 16 or not all(isinstance(item, (int, float)) for item in value):
            for item in value:
                _walk(item, out, percents)
    elif isinstance(value, bool):
        return
    elif isinstance(value, (int, float)):
        out.append(float(value))
    elif isinstance(value, str):
        out.extend(float(m) for m in NUMBER.findall(value))


def _texts(x: float) -> set[str]:
    """x at 0 to 3 decimals, rounded half-even and half-up."""
    out = set()
    for digits in range(4):
        texts = {f"{x:.{digits}f}"}
        try:
            texts.add(str(Decimal(repr(x)).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)))
        except InvalidOperation:
            pass
        out |= {text.lstrip("-") if float(text) == 0 else text for text in texts}
    return out


def renderings(values, *, percents=(), speedups=None, losses=None) -> dict[str, set[str]]:
    """How a file's values may be quoted: as percentages ('%': a fraction times 100, or one of `percents`, the
    numbers the file gives as percentages, as written), as speed-ups ('x': the value itself, or with `speedups`
    given only those) and as losses ('nats': the value itself, or with `losses` given only those)."""
    out: dict[str, set[str]] = {"%": set(), "x": set(), "nats": set()}
    for value in values:
        if not math.isfinite(value) or abs(value) > 1e9:
            continue
        if abs(value) <= 3:
            out["%"] |= _texts(100 * value)
        if speedups is None:
            out["x"] |= _texts(value)
        if losses is None:
            out["nats"] |= _texts(value)
    for value in percents:
        if math.isfinite(value):
            out["%"] |= _texts(value)
    for value in speedups or ():
        out["x"] |= _texts(value)
    for value in losses or ():
        out["nats"] |= _texts(value)
    return out


def _written(pattern: re.Pattern, text: str) -> list[float]:
    """A log's or a table's numbers written with a unit (its computed values: `_computed_roundings`)."""
    return [float(m) for m in pattern.findall(text)]


def _computed_roundings(text: str) -> set[str]:
    """The numbers of `text` printed to `COMPUTED_DECIMALS` or more decimals, rounded to fewer."""
    out: set[str] = set()
    for token in NUMBER.findall(text):
        decimals = len(token.partition(".")[2].partition("e")[0].partition("E")[0])
        if decimals >= COMPUTED_DECIMALS:
            out |= {t for t in _texts(float(token)) if len(t.partition(".")[2]) < decimals}
    return out


@lru_cache(maxsize=None)
def file_figures(path: Path) -> dict[str, frozenset[str]]:
    text = path.read_text(encoding="utf-8", errors="replace")
    values: list[float] = []
    percents: list[float] = []
    if path.suffix == ".json":
        try:
            _walk(json.loads(text), values, percents)
        except json.JSONDecodeError:
            values = []
    if values:
        return {kind: frozenset(v) for kind, v in renderings(values, percents=percents).items()}
    values = [float(m) for m in NUMBER.findall(text)]
    percents = _written(WRITTEN_PERCENT, text)
    figures = renderings(values, percents=percents, speedups=_written(WRITTEN_SPEEDUP, text),
                         losses=_written(WRITTEN_NATS, text))  # fmt: skip
    computed = _computed_roundings(text)
    figures["x"] |= computed
    figures["nats"] |= computed
    return {kind: frozenset(v) for kind, v in figures.items()}


def _expand(token: str) -> list[str]:
    match = BRACES.search(token)
    if not match:
        return [token]
    head, tail = token[: match.start()], token[match.end() :]
    return [e for option in match.group(1).split(",") for e in _expand(head + option + tail)]


def cited_files(text: str) -> set[Path]:
    """Result files a text names in code spans: repository paths (globs, braces, a folder's own files), or their
    tails (`family_v4/eval_s2l.md`, `results/x.json`, a bare file name)."""
    found: set[Path] = set()
    for span in CODE_SPAN.findall(text):
        for raw in span.split():
            raw = raw.strip("\"'()[],;").rstrip(".:")
            for token in _expand(raw):
                if not token or token.startswith("-"):
                    continue
                if token.startswith("research/"):
                    for match in ROOT.glob(token.rstrip("/")):
                        if match.is_dir():  # the files directly in it: naming a study's folder is no citation
                            found |= {f for f in RESULT_FILES if f.parent == match}
                        elif match in RESULT_FILES:
                            found.add(match)
                elif re.search(r"\.(json|log|md|txt)$|\*|/$", token):
                    tail = token.strip("/")
                    if not tail or tail == "*":
                        continue
                    for f in RESULT_FILES:
                        rel = f.relative_to(ROOT).as_posix()
                        if f.match(tail) or rel.endswith("/" + tail) or f"/{tail}/" in rel:
                            found.add(f)
    return found


def _allowed(text: str, start: int, end: int) -> bool:
    window = text[max(0, start - 40) : end + 40]
    return any(
        m.start() <= start - max(0, start - 40) < m.end() or m.start() < end - max(0, start - 40) <= m.end()
        for pattern, _ in NOT_RESULTS
        for m in re.finditer(pattern, window)
    )


def _sections(text: str) -> list[str]:
    """The page split at its headings (fenced blocks first taken out, so a `# comment` is no heading)."""
    return HEADING.split(FENCE.sub("", text))


def unbacked_figures(raw: str) -> list[str]:
    """The figures of a page's text that no result file named in their section (or the opening) holds."""
    sections = _sections(raw)
    opening = cited_files(re.split(r"^#{2,6} ", FENCE.sub("", raw), maxsplit=1, flags=re.M)[0])
    missing = []
    for section in sections:
        known: dict[str, set[str]] = {"%": set(), "x": set(), "nats": set()}
        for path in opening | cited_files(section):
            for kind, figures in file_figures(path).items():
                known[kind] |= figures
        generated = [(ROOT / snippet).read_text(encoding="utf-8") for snippet in INCLUDE.findall(section)]
        for text in generated + GENERATED.findall(section):
            for kind in known:
                known[kind] |= {m.group(0) for m in NUMBER.finditer(text)}
        prose = INCLUDE.sub("", GENERATED.sub("", section))
        title = section.splitlines()[0] if section.strip() else ""
        for match in [*FIGURE.finditer(prose), *NATS.finditer(prose)]:
            if _allowed(prose, match.start(), match.end()):
                continue
            kind = match.group(3)
            for number in (match.group(1), match.group(2)):
                if number is not None and number not in known[kind] and number.lstrip("-") not in known[kind]:
                    missing.append(f"{number}{kind} (section {title[:50]!r})")
    return missing


def test_figure_pattern():
    found = [(m.group(1), m.group(2), m.group(3)) for m in FIGURE.finditer("97.8% [94.8, 1.5x] 2.6-2.8x 500 x 1024, 0x1f")]
    assert found == [(None, "97.8", "%"), (None, "1.5", "x"), ("2.6", "2.8", "x")]


def test_nats_pattern():
    text = "copy NLL 6.95 vs 10.08 nats, held-out loss 4.75 nats; 3.87 for the control, 2 nats"
    assert [(m.group(1), m.group(2)) for m in NATS.finditer(text)] == [("6.95", "10.08"), (None, "4.75")]


def test_a_loss_without_its_result_file_fails():
    cited = "`research/family_builder/results/deep_pin4_long/target_done.json`"
    assert unbacked_figures(f"# A page\n\nCopy 6.95 vs 10.08 nats, held-out 4.749 nats ({cited}).\n") == []
    assert unbacked_figures(f"# A page\n\nHeld-out 4.76 vs 4.75 nats ({cited}).\n") == ["4.76nats (section 'A page')"]


def test_renderings_of_a_fraction():
    assert {"97.8", "98", "97.77"} <= renderings([0.97774])["%"]
    assert "1.98" in renderings([1.97619])["x"] and "1.98" not in renderings([1.97619])["%"]
    assert "97.8" not in renderings([97.8])["%"] and "97.8" in renderings([], percents=[97.8])["%"]


def test_a_number_backs_a_percentage_only_where_its_file_gives_it_as_one(tmp_path):
    """A log's bare `45` (a count, a step, a millisecond) backs no `45%`; its `45%` does, and so does a JSON value
    under a key naming the unit (`decode_overhead_pct: 0.67` backs 0.7%) besides any fraction (0.45 backs 45%)."""
    log = tmp_path / "run.log"
    log.write_text("step 45: 12.5 ms, retention 97.8%, 3.96x, ratio 1.660109\n")
    figures = file_figures(log)
    assert "45" not in figures["%"] and {"97.8", "98"} <= figures["%"]
    # a speed-up: written with its x, or a computed ratio rounded; not a step count or a millisecond
    assert {"3.96", "4", "1.66", "1.7"} <= figures["x"] and not {"45", "12.5", "1.660109"} & figures["x"]
    assert {"1.66", "1.7"} <= figures["nats"] and not {"45", "12.5"} & figures["nats"]
    report = tmp_path / "bench.json"
    report.write_text(json.dumps({"decode_overhead_pct": 0.67297, "steps": 45, "recall": 0.45}))
    figures = file_figures(report)
    assert {"0.7", "45"} <= figures["%"] and "4500" not in figures["%"] and "67.3" in figures["%"]


def test_a_figure_without_its_result_file_fails():
    cited = "`research/content_at_speed/results/recompute_1_vs_32_small_to_large.json`"
    text = (
        f"# A page\n\nRecall 97.8% ({cited}).\n\n"
        "## Another section\n\nRecall 97.8% again, 12.34% here, and 95% CI [1, 2].\n\n"
        "## A third\n\nRecall 97.8%.\n"
    )
    assert unbacked_figures(text) == ["12.34% (section 'Another section')"]
    assert unbacked_figures(text.replace(f"Recall 97.8% ({cited}).", "No file named here.")) == [
        "97.8% (section 'Another section')",
        "12.34% (section 'Another section')",
        "97.8% (section 'A third')",
    ]


def test_pending_pages_exist():
    assert all((ROOT / page).is_file() for page in PENDING), "PENDING names a page that is gone"


@pytest.mark.parametrize("page", CHECKED)
def test_quoted_figures_come_from_result_files(page: str):
    missing = unbacked_figures((ROOT / page).read_text(encoding="utf-8"))
    assert not missing, (
        f"{page} quotes figures that no result file named in the same section holds (name the file in a code span, "
        f"render the table from it with docs/render_tables.py, or drop the figure): {missing}"
    )
