"""The fit's choice of the exact pass's window (`MapperConfig.exact_window`, `core/local_attention.py`).

Once the exact layers are chosen, the fit asks whether their attention may reach back only a window of tokens: at long
prompts that is most of what the exact pass costs (it grows with prompt x window instead of prompt^2). The content
gate (`content_gate.py`: passage recall and hand-off on probe items, paired against the target's own answers) judges
the chosen configuration with each candidate window, smallest first, and the first it accepts is recorded; none
accepted keeps the whole prompt.

The candidates are powers of two from `FIRST_WINDOW` up to half the shortest probe prompt, so that on every item the
question (among the last tokens, which attend to the whole prompt whatever the window) stands further from the start
of the passage than the window reaches: the gate then measures what the window loses, where a window longer than the
items would pass untested. With one exact layer nothing is searched: its keys and values are computed before any
attention runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..core.mapper import KVMapper
from .content_gate import ContentGate, gate_line, tolerance_points

logger = logging.getLogger(__name__)

# The smallest window tried, in tokens. Below it the windowed attention costs a small share of an exact layer even at
# long prompts (a layer's projections cost as much as attending to several hundred tokens at the widths of real
# models), so a smaller window would risk the content for little.
FIRST_WINDOW = 64


def candidate_windows(gate: ContentGate) -> list[int]:
    """Windows the gate can test on its items: powers of two from `FIRST_WINDOW` to half the shortest probe prompt."""
    shortest = min(len(item.prompt_ids) for items in gate.items.values() for item in items)
    windows, w = [], FIRST_WINDOW
    while w <= shortest // 2:
        windows.append(w)
        w *= 2
    return windows


def with_window(mapper: KVMapper, window: int | None) -> KVMapper:
    """A shallow copy of `mapper` (same weights) whose config records `window`: the caller's mapper is left as it was."""
    return mapper.with_config(exact_window=window)


def choose_exact_window(mapper: KVMapper, gate: ContentGate | None) -> tuple[int | None, dict[str, Any]]:
    """The smallest candidate window the gate accepts for `mapper` at its exact layers (None: the whole prompt), and
    the report: `{"candidates", "tried": [{"window", "gate"}], "chosen", "reason"}`."""
    num_exact, num_layers = mapper.num_exact_layers, mapper.target_layout.num_layers
    report: dict[str, Any] = {"candidates": [], "tried": [], "chosen": None}
    if gate is None:
        return None, {**report, "reason": "no content gate (no tokenizer): the whole prompt"}
    if num_exact < 2 or num_exact >= num_layers:
        why = ("one exact layer's keys and values are computed before any attention" if num_exact < 2 else
               "every layer is exact: the target's own prefill")  # fmt: skip
        return None, {**report, "reason": f"{why}: the whole prompt"}
    report["candidates"] = candidate_windows(gate)
    if not report["candidates"]:
        return None, {**report, "reason": f"the probe's prompts are too short to test a window of {FIRST_WINDOW}"}
    for window in report["candidates"]:
        verdict = gate.judge(with_window(mapper, window), num_exact)
        report["tried"].append({"window": window, "gate": verdict})
        if verdict["accepted"]:
            report["chosen"] = window
            report["reason"] = (f"the smallest window whose passage recall and hand-off stay within "
                                f"{tolerance_points(gate.tolerance)} of the target's own answers (paired 95% interval, probe items)")  # fmt: skip
            return window, report
    return None, {**report, "reason": "no window kept passage recall and hand-off: the whole prompt"}


def with_exact_window(
    mapper: KVMapper, gate: ContentGate | None, window: int | str | None, log: Callable[[str], None] | None = None
) -> KVMapper:
    """`mapper` with its exact pass's window recorded: a given one as is (None: the whole prompt), "auto" from
    `choose_exact_window`, its report in `mapper.report["exact_window"]` and one line logged."""
    if window != "auto":
        return with_window(mapper, window)
    chosen, report = choose_exact_window(mapper, gate)
    out = with_window(mapper, chosen)
    out.report = {**mapper.report, "exact_window": report}
    tried = "; ".join(f"{row['window']}: {gate_line(row['gate'])}" for row in report["tried"])
    (log or logger.info)(f"exact pass window: {'the whole prompt' if chosen is None else f'{chosen} tokens'} "
                         f"({report['reason']}{'; by window ' + tried if tried else ''})")  # fmt: skip
    return out


__all__ = ["FIRST_WINDOW", "candidate_windows", "choose_exact_window", "with_exact_window", "with_window"]
