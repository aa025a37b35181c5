"""The fit's quality decision: does a configuration keep what `eval` measures, within a stated tolerance?

A candidate configuration (a mapper and its exact layers) is scored on the tasks `hf-kvtransfer eval` reports about
content, passage recall and hand-off (`evaluation/content.py`, the same functions), on items of the `"probe"` split
(`evaluation/tasks.py`: the eval split's kind of made-up facts from a seed stream of its own, so the items the fit
decides on are not the items `eval` then reports), with distractors cut from the fit's held-out calibration text.
Each item is scored twice, by the target from its own prefill and through the transfer, and the decision is on the
paired difference of accuracy (candidate - own, per item), task by task:

- **accepted** when the lower end of its 95% bootstrap interval is above `-tolerance` on every task (the probe
  rules out a loss larger than the tolerance);
- **rejected** when the estimate itself is a loss of `tolerance` or more on a task, or when the interval still
  reaches below `-tolerance` after the items are extended (a loss the probe cannot rule out is not accepted).

Sample size follows the measured variance: the first `num_items` items per task; a candidate that is undecided then
(estimate within the tolerance, interval not) is scored on as many more items as its paired differences' spread
says the interval needs (`required_items`), at most `max_items`. Everything is a function of the seed, the items and
the models: no clock, so two runs decide alike whatever else the machine is doing.

Example:
    ```python
    gate = ContentGate(source, target, tokenizer, heldout_texts, tolerance=0.05)
    verdict = gate.judge(mapper, num_exact_layers=3)
    verdict["accepted"], verdict["tasks"]["recall"]["difference_ci"]
    ```
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from transformers import PreTrainedModel

from ..core.mapper import KVMapper
from ..evaluation.content import handoff, passage_recall
from ..evaluation.metrics import gap_recovered_over_items, mean_and_ci, retention_over_items
from ..evaluation.tasks import handoff_items, passage_recall_items
from .probe_journal import ProbeJournal, scored

logger = logging.getLogger(__name__)

# The tasks the gate scores: what `eval` reports about content, by eval's task names.
GATE_TASKS = ("recall", "handoff")
PROBE_SPLIT = "probe"
# Default: a configuration may lose at most 5 points of accuracy against the target's own answers on each task
# (FitConfig.exact_layers_tolerance, `fit --exact-layers-tolerance`).
DEFAULT_TOLERANCE = 0.05
# The items of the first stage per task (FitConfig.exact_layers_items) and the most the gate extends to, as a
# multiple of them.
DEFAULT_GATE_ITEMS = 150
MAX_ITEMS_FACTOR = 4
# z of the two-sided 95% interval the decision reads (its lower end is a one-sided 97.5% bound).
Z95 = 1.96


def required_items(differences: Sequence[float], tolerance: float, z: float = Z95) -> int | None:
    """Items whose 95% interval of the mean paired difference would end above `-tolerance`, at the measured mean
    and spread (normal approximation; None when the mean itself is not above `-tolerance`)."""
    d = np.asarray(differences, dtype=np.float64)
    margin = float(d.mean()) + tolerance
    if margin <= 0:
        return None
    sd = float(d.std(ddof=1)) if d.size > 1 else 0.0
    return max(d.size, math.ceil((z * sd / margin) ** 2))


def tolerance_points(tolerance: float) -> str:
    """A tolerance as the gate applies it, in points of accuracy (0.05 -> `5 points`; not a relative 5%)."""
    return f"{100 * tolerance:g} points"


class ContentGate:
    """Scores candidate configurations on probe-split recall and hand-off items, paired with the target's own.

    Args:
        source, target: the pair (the source answers the hand-off's first question, as in `eval`).
        tokenizer: the family's tokenizer (the items are text).
        texts: documents the distractors are cut from (the fit's held-out calibration text); None: generated filler.
        tolerance: the largest loss of accuracy (a fraction: 0.05 = 5 points) a candidate may have, per task.
        num_items: items per task of the first stage.
        max_items: the most items per task an undecided candidate is extended to (default 4 x `num_items`).
        seed: the items' and the bootstrap's seed.
        journal: scores kept on disk (`probe_journal.ProbeJournal`, the fit's), read back when a fit is rerun.
    """

    def __init__(
        self, source: PreTrainedModel, target: PreTrainedModel, tokenizer, texts: Sequence[str] | None = None, *,
        tolerance: float = DEFAULT_TOLERANCE, num_items: int = DEFAULT_GATE_ITEMS, max_items: int | None = None,
        seed: int = 0, journal: ProbeJournal | None = None,
    ):  # fmt: skip
        if not 0 < tolerance < 1:
            raise ValueError(f"tolerance must be a fraction of accuracy in (0, 1) (0.05 = 5 points), got {tolerance}")
        if num_items < 2:
            raise ValueError(f"the gate needs at least 2 items per task, got num_items={num_items}")
        self.source, self.target, self.tolerance, self.seed = source, target, tolerance, seed
        self.num_items = num_items
        self.max_items = max(num_items, max_items if max_items is not None else MAX_ITEMS_FACTOR * num_items)
        texts = [t for t in (texts or []) if t.strip()] or None
        # Items are prefix-stable (item i does not depend on how many are drawn): the stages are slices of one list.
        self.items = {
            "recall": passage_recall_items(tokenizer, self.max_items, seed=seed, distractor_texts=texts, split=PROBE_SPLIT),
            "handoff": handoff_items(tokenizer, self.max_items, seed=seed, distractor_texts=texts, split=PROBE_SPLIT),
        }
        self._own: dict[tuple[str, int, int], dict[str, Any]] = {}  # (task, start, stop) -> a result to reuse
        self.journal = journal

    def _score(self, task: str, mapper: KVMapper, num_exact: int, start: int, stop: int) -> dict[str, Any]:
        fn = passage_recall if task == "recall" else handoff
        key = (task, start, stop)
        items = self.items[task][start:stop]
        result = scored(self.journal, f"gate {task}", mapper, num_exact, items, lambda: fn(
            self.source, self.target, mapper, items, num_exact_layers=num_exact, progress=False,
            reference=self._own.get(key), num_bootstrap=0, seed=self.seed,
        ), seed=self.seed)  # fmt: skip
        if key not in self._own or "source_alone" not in self._own[key]["correct_per_item"]:
            self._own[key] = result  # the settings no candidate changes (the source alone too, once scored)
        return result

    def _per_item(self, task: str, mapper: KVMapper, num_exact: int, stops: list[int]) -> dict[str, np.ndarray]:
        parts = [self._score(task, mapper, num_exact, a, b) for a, b in zip([0] + stops[:-1], stops)]
        return {name: np.concatenate([p["correct_per_item"][name] for p in parts]) for name in parts[0]["correct_per_item"]}

    def _task_verdict(self, correct: dict[str, np.ndarray]) -> dict[str, Any]:
        d = correct["transfer"] - correct["own"]
        diff = mean_and_ci(d, 1000, self.seed)
        low = diff["ci"][0]
        decided = "accepted" if math.isfinite(low) and low > -self.tolerance else (
            "rejected" if diff["mean"] <= -self.tolerance else "undecided")  # fmt: skip
        own = float(correct["own"].mean())
        retention = retention_over_items(correct["own"], correct["transfer"], correct["no_context"], num_bootstrap=1000,
                                         seed=self.seed)  # fmt: skip
        alone = correct.get("source_alone")
        gap = {} if alone is None else gap_recovered_over_items(correct["own"], correct["transfer"], alone,
                                                                num_bootstrap=1000, seed=self.seed)  # fmt: skip
        return {"num_items": int(d.size), "own_accuracy": own, "transfer_accuracy": float(correct["transfer"].mean()),
                "no_context_accuracy": float(correct["no_context"].mean()),
                "source_alone_accuracy": None if alone is None else float(alone.mean()), "difference": diff["mean"],
                "difference_ci": diff["ci"], "retention": retention.get("retention"),
                "retention_ci": retention.get("retention_ci"), "gap_recovered": gap.get("gap_recovered"),
                "gap_recovered_ci": gap.get("gap_recovered_ci"), "decision": decided,
                "required_items": required_items(d, self.tolerance)}  # fmt: skip

    def check_context(self) -> dict[str, Any]:
        """The gate's precondition, before a fit's calibration pass: the target's own passage recall on the first
        stage's probe items is more than the tolerance above its answer without the passage, else
        `ContextUnusedError`; a pair the gate cannot judge then fails in the time of this one measurement, not after
        the pass. The scores become the reference every candidate's recall reuses. (Hand-off's own answer follows
        the source's answer to its first question, so hand-off is checked when the first candidate is scored.)

        Returns:
            `{"num_items", "own_accuracy", "no_context_accuracy"}` of passage recall.
        """
        items = self.items["recall"][: self.num_items]
        result = scored(self.journal, "gate recall", None, 0, items, lambda: passage_recall(
            None, self.target, None, items, progress=False, num_bootstrap=0, seed=self.seed,
        ), seed=self.seed)  # fmt: skip
        correct = result["correct_per_item"]
        found = {"num_items": len(items), "own_accuracy": float(np.mean(correct["own"])),
                 "no_context_accuracy": float(np.mean(correct["no_context"]))}  # fmt: skip
        self._check_context_matters("recall", found)
        self._own.setdefault(("recall", 0, self.num_items), result)
        return found

    def _check_context_matters(self, task: str, verdict: dict[str, Any]) -> None:
        """Refuse to judge when the target's own accuracy is within the tolerance of its accuracy without the
        context: a transfer that loses the whole context would then pass (a broken model run, e.g. a dtype or device
        the models do not run correctly on, or a target that barely reads its context)."""
        own, blind = verdict["own_accuracy"], verdict["no_context_accuracy"]
        if own - blind > self.tolerance:
            return
        name = "hand-off" if task == "handoff" else "passage recall"
        raise ContextUnusedError(
            f"content gate: the target's own {name} on {verdict['num_items']} probe items ({own:.1%}) is not "
            f"{tolerance_points(self.tolerance)} above its answer without the context ({blind:.1%}), so the gate cannot tell a "
            "transfer that keeps the content from one that loses it; check that both models run correctly with this "
            "device and dtype (e.g. --dtype float32), or fix the exact layers (--exact-layers N) to fit without it"
        )

    def judge(self, mapper: KVMapper, num_exact_layers: int, *, every_task: bool = False) -> dict[str, Any]:
        """The gate's verdict on `mapper` with `num_exact_layers` exact layers (`every_task`: score both tasks even
        when the first rejects, as a calibration study wants).

        Returns:
            `{"accepted": bool, "tolerance", "tasks": {task: {"num_items", "own_accuracy", "transfer_accuracy",
            "source_alone_accuracy", "difference", "difference_ci", "retention", "retention_ci", "gap_recovered",
            "gap_recovered_ci", "decision", "required_items"}}}`;
            `difference` is the mean of (transfer - own) per item, in accuracy (-0.1 = 10 points lost).
        """
        tasks: dict[str, Any] = {}
        for task in GATE_TASKS:
            stops = [self.num_items]
            verdict = self._task_verdict(self._per_item(task, mapper, num_exact_layers, stops))
            self._check_context_matters(task, verdict)
            if verdict["decision"] == "undecided" and self.max_items > self.num_items:
                # Sized from this candidate's measured spread, with a fifth more for the estimate's own noise.
                want = min(self.max_items, math.ceil(1.2 * (verdict["required_items"] or self.max_items)))
                stops.append(max(want, self.num_items + 1))
                verdict = self._task_verdict(self._per_item(task, mapper, num_exact_layers, stops))
            if verdict["decision"] == "undecided":
                verdict["decision"] = "rejected"
                verdict["why"] = f"a loss of {tolerance_points(self.tolerance)} is not ruled out on {verdict['num_items']} items"
            tasks[task] = verdict
            if verdict["decision"] == "rejected" and not every_task:
                break  # one task that loses the content rejects the candidate: the other need not be scored
        return {"accepted": all(tasks.get(t, {}).get("decision") == "accepted" for t in GATE_TASKS),
                "tolerance": self.tolerance, "tasks": tasks}  # fmt: skip


class ContextUnusedError(ValueError):
    """The target answers the gate's items no better with their context than without: the gate cannot judge."""


def heldout_texts(tokenizer, input_ids, attention_mask=None) -> list[str]:
    """The held-out calibration rows `[num_sequences, seq_len]` as text: what the gate cuts its distractors from."""
    rows = []
    for i, row in enumerate(input_ids.tolist()):
        if attention_mask is not None:
            row = [t for t, m in zip(row, attention_mask[i].tolist()) if m]
        rows.append(tokenizer.decode(row, skip_special_tokens=True))
    return [r for r in rows if r.strip()]


def gate_line(verdict: dict[str, Any] | None) -> str:
    """`recall -1.3 [-4.0, +1.3] pts, hand-off ...: accepted` (the fit's log and the card)."""
    if not verdict:
        return "not judged"
    parts = []
    for task, v in verdict["tasks"].items():
        low, high = v["difference_ci"]
        gap = "" if v.get("gap_recovered") is None else f" (gap recovered {100 * v['gap_recovered']:.0f}%)"
        parts.append(f"{'hand-off' if task == 'handoff' else task} {100 * v['difference']:+.1f} "
                     f"[{100 * low:+.1f}, {100 * high:+.1f}] pts on {v['num_items']}{gap}")  # fmt: skip
    return ", ".join(parts) + (": accepted" if verdict["accepted"] else ": rejected")


__all__ = ["DEFAULT_GATE_ITEMS", "DEFAULT_TOLERANCE", "GATE_TASKS", "ContentGate", "ContextUnusedError", "gate_line",
           "heldout_texts", "required_items", "tolerance_points"]
