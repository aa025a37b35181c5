"""core/progress.py: a bar on a terminal redraws in place; on a file or a pipe it writes plain lines, rarely."""

import importlib
import io

import pytest

from hf_kvtransfer.core.progress import progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def bars_on(monkeypatch):
    """Progress bars allowed (the suite's conftest switches them off through huggingface_hub)."""
    monkeypatch.setattr(importlib.import_module("huggingface_hub.utils.tqdm"), "HF_HUB_DISABLE_PROGRESS_BARS", False)


def test_a_bar_in_a_log_writes_lines_that_log_lines_do_not_join(bars_on, monkeypatch):
    from hf_kvtransfer.core import progress

    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    log = io.StringIO()
    bar = progress_bar(total=4, desc="calibration", unit="tok", stream=log)
    for _ in range(2):
        bar.update()
    log.write("a log line\n")  # what the fit's log prints while the bar runs
    inner = progress_bar(total=2, desc="inner", stream=log, position=1, leave=False)  # a nested bar moves the cursor
    inner.update(2)
    inner.close()
    bar.update(2)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert "a log line" in lines and all(line.startswith(("calibration:", "inner:", "a log line")) for line in lines)
    assert lines[-1].startswith("calibration: 100%") and "4/4" in lines[-1]
    assert len(lines) == len(set(lines))  # closing does not repeat the last line


def test_a_bar_in_a_log_is_quiet_between_its_intervals(bars_on):
    """1,000 updates well inside one interval (30 s): the first line and the last, not one line per update."""
    log = io.StringIO()
    bar = progress_bar(total=1000, desc="probe", stream=log)
    for _ in range(1000):
        bar.update()
    bar.close()
    lines = log.getvalue().splitlines()
    assert 2 <= len(lines) <= 4 and lines[0].startswith("probe:   0%") and "1000/1000" in lines[-1], lines


def test_a_bar_on_a_terminal_redraws_in_place(bars_on):
    term = _Terminal()
    bar = progress_bar(total=3, desc="eval", stream=term, mininterval=0)
    bar.update(3)
    bar.close()
    assert "\r" in term.getvalue() and "eval: 100%" in term.getvalue()


@pytest.mark.parametrize("hub_off", [False, True])
def test_nothing_is_written_when_switched_off(hub_off, monkeypatch):
    """`enabled=False`, or huggingface_hub's switch (`HF_HUB_DISABLE_PROGRESS_BARS=1`, as the suite runs) off."""
    monkeypatch.setattr(importlib.import_module("huggingface_hub.utils.tqdm"), "HF_HUB_DISABLE_PROGRESS_BARS", hub_off)
    log = io.StringIO()
    bar = progress_bar(total=3, desc="eval", stream=log, enabled=hub_off)  # one of the two switches off
    bar.update(3)
    bar.close()
    assert log.getvalue() == ""


def _segments(text: str) -> list[str]:
    """What a terminal shows line by line once redraws are resolved, roughly: the pieces between \\r and \\n."""
    return [piece for piece in text.replace("\r", "\n").split("\n") if piece.strip()]


def test_a_line_printed_while_a_bar_runs_keeps_its_own_line(bars_on):
    """On a terminal a plain print lands after the bar's last redraw, on its line; `write_line` makes the bar step
    aside. In a log the bar's lines and the printed line are separate lines either way."""
    from hf_kvtransfer.core.progress import write_line

    term = _Terminal()
    bar = progress_bar(total=3, desc="probe", stream=term, mininterval=0)
    bar.update()
    print("glued", file=term, end="\n")
    write_line("apart", stream=term)
    bar.update(2)
    bar.close()
    pieces = _segments(term.getvalue())
    assert "apart" in pieces and "glued" not in pieces and any(p.endswith("glued") for p in pieces)
    log = io.StringIO()
    bar = progress_bar(total=3, desc="probe", stream=log)
    write_line("apart", stream=log)
    bar.update(3)
    bar.close()
    assert "apart" in log.getvalue().splitlines()


def test_the_cli_log_handler_writes_each_record_on_its_own_line(bars_on, capsys):
    import logging

    from hf_kvtransfer.core.progress import LineHandler

    logger = logging.getLogger("hf_kvtransfer.test_progress")
    handler = LineHandler()
    logger.addHandler(handler)
    try:
        logger.warning("a record")
    finally:
        logger.removeHandler(handler)
    assert "a record\n" in capsys.readouterr().err


def test_transformers_bars_print_lines_off_a_terminal(bars_on, monkeypatch):
    """transformers' own bar ("Loading weights") through the hook `transformers_bars_as_lines` sets: lines in a log,
    left alone on a terminal."""
    from transformers.utils import logging as transformers_logging

    from hf_kvtransfer.core.progress import transformers_bars_as_lines

    monkeypatch.setattr(transformers_logging, "_tqdm_active", True)
    monkeypatch.setattr(transformers_logging, "_tqdm_hook", None)
    transformers_bars_as_lines(_Terminal())
    assert transformers_logging._tqdm_hook is None
    log = io.StringIO()
    transformers_bars_as_lines(log)
    for _ in transformers_logging.tqdm(range(3), desc="Loading weights"):
        pass
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and lines and all(line.startswith("Loading weights:") for line in lines), lines
    assert "3/3" in lines[-1]


def test_a_bar_without_an_estimate_shows_no_rate_or_time_left(bars_on):
    """The configuration probe's counts take from no time to minutes: its bar must not extrapolate a time left."""
    log = io.StringIO()
    bar = progress_bar(total=23, desc="configuration probe", unit="exact-layer counts", stream=log, estimate=False)
    bar.update(3)
    bar.close()
    last = log.getvalue().splitlines()[-1]
    assert last.startswith("configuration probe: 3/23 exact-layer counts [") and "so far]" in last, last
    assert "<" not in last and "/s" not in last and "s/" not in last, last
    with_estimate = io.StringIO()
    bar = progress_bar(total=23, desc="probe", stream=with_estimate)
    bar.update(3)
    bar.close()
    assert "<" in with_estimate.getvalue().splitlines()[-1]  # the default bar does estimate (the check above can fail)
