"""Progress on long work: the one progress-bar factory of the library (calibration, the fit's probes, eval, bench).

A bar shows only when the caller's `enabled` is on and huggingface_hub's switch allows it
(`HF_HUB_DISABLE_PROGRESS_BARS=1` silences every bar). On a terminal it redraws in place. Written to a file or a pipe
(a log, `nohup`, CI) a redraw-in-place bar piles its carriage returns into one long line that log lines get glued
to, so there it prints a plain line instead, at most every `LOG_INTERVAL_S` seconds. Lines printed while a bar runs go
through `write_line` (the CLI's log, and its logging handler `LineHandler`), so that on a terminal they do not join
the bar either; off a terminal the CLI has transformers' own bars print lines too (`transformers_bars_as_lines`).

Example:
    ```python
    bar = progress_bar(total=len(items), desc="passage recall", unit="item", enabled=progress)
    for item in items:
        ...
        bar.update()
    bar.close()
    ```
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from huggingface_hub.utils import tqdm

# How often a bar written to a file or a pipe prints its line.
LOG_INTERVAL_S = 30.0
# A bar off a terminal: a line at most every LOG_INTERVAL_S, drawn in ASCII at a fixed width.
_LOG_OPTIONS = {"mininterval": LOG_INTERVAL_S, "maxinterval": LOG_INTERVAL_S, "ascii": True, "ncols": 100}
# A bar whose steps differ too much in cost for a time-left estimate to mean anything: counts and time so far only.
_NO_ESTIMATE = "{desc}: {n_fmt}/{total_fmt} {unit} [{elapsed} so far]"
# What a bar writes to redraw in place or move between nested bars: a carriage return, cursor-up escapes.
_REDRAW = re.compile(r"\r|\x1b\[A")


class _Lines:
    """A text stream that takes a bar's redraws and writes each as a line of its own."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._last = ""

    def write(self, text: str) -> int:
        for line in _REDRAW.split(text):
            line = line.rstrip()
            if line.strip() and line != self._last:  # closing redraws the last state: once is enough
                self._stream.write(line + "\n")
                self._last = line
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


def progress_bar(iterable: Iterable | None = None, *, desc: str, enabled: bool = True,
                 stream: TextIO | None = None, estimate: bool = True, **options: Any) -> tqdm:  # fmt: skip
    """A tqdm bar labelled `desc` (`options`: tqdm's, e.g. `total`, `unit`, `unit_scale`, `initial`), shown when
    `enabled`; on a `stream` (default stderr) that is not a terminal, one plain line every `LOG_INTERVAL_S` seconds.
    `estimate=False` for steps of very different cost (some skipped at once, some taking minutes): the bar then shows
    the steps done and the time so far, and no rate or time left that the next step would belie."""
    stream = stream if stream is not None else sys.stderr
    if not estimate:
        options = {"bar_format": _NO_ESTIMATE, **options}
    if not _is_terminal(stream):
        options = {**_LOG_OPTIONS, **options}
        stream = _Lines(stream)
    return tqdm(iterable, desc=desc, disable=not enabled, file=stream, **options)


def write_line(line: str, stream: TextIO | None = None) -> None:
    """Print `line` on a line of its own beside any running bar: on a terminal the bars step aside and redraw below it
    (a plain print would be glued to the bar's last redraw); elsewhere a plain line."""
    stream = stream if stream is not None else sys.stderr
    if _is_terminal(stream):
        tqdm.write(line, file=stream)
    else:
        print(line, file=stream, flush=True)


class LineHandler(logging.Handler):
    """A logging handler that writes each record with `write_line`: for applications (the CLI installs it; the library
    adds no handlers)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_line(self.format(record))
        except Exception:  # noqa: BLE001 - logging's contract: a handler reports its own failures
            self.handleError(record)


def transformers_bars_as_lines(stream: TextIO | None = None) -> None:
    """Off a terminal, transformers' own bars ("Loading weights") print plain lines like the library's (through
    transformers' tqdm hook; a transformers without one is left as it is). For applications: the CLI calls it (the
    library leaves transformers' settings alone)."""
    from transformers.utils import logging as transformers_logging

    set_hook = getattr(transformers_logging, "set_tqdm_hook", None)
    if _is_terminal(stream if stream is not None else sys.stderr) or set_hook is None:
        return

    def as_lines(factory, args, kwargs):
        if "file" in kwargs or kwargs.get("disable"):
            return factory(*args, **kwargs)
        lines = _Lines(stream if stream is not None else sys.stderr)  # stderr as it is when the bar starts
        return factory(*args, **{**_LOG_OPTIONS, **kwargs, "file": lines})

    set_hook(as_lines)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


__all__ = ["LOG_INTERVAL_S", "LineHandler", "progress_bar", "transformers_bars_as_lines", "write_line"]
