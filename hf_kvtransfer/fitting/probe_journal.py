"""The fit's probe scores kept on disk while it runs, so an interrupted fit resumes its probe where it stopped.

A fit with `num_exact_layers="auto"` scores the target alone before its calibration pass (does it copy, does it
read the gate's passages: `fit._checked_gate`), then, after the pass (checkpointed by `calibration_pass`), its
candidates: repeated spans, cued recall and the content gate's passage recall and hand-off, each a forward of both
models over a few hundred items per candidate. On the deep bundled pair that took 1,993 s of a 2,870 s fit. Each
score is appended to a journal (`core/journal.py`) beside the calibration checkpoint; a rerun of the same fit reads
it back instead of scoring again, so Ctrl-C, a lost session or an out-of-memory error costs at most the score that
was running. A score is read back only for the same candidate weights and config, exact layers, items and models, so
a resumed fit decides as the first one would have. The journal is deleted with the checkpoint when the fit's mapper
is written.

Example:
    ```python
    journal = ProbeJournal.for_fit("runs/fit-checkpoint", source, target)
    mapper, report = choose_configuration(source, target, base, ids, candidates=candidates, journal=journal)
    ```
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..core.journal import ResultJournal, model_identity
from ..core.mapper import KVMapper

JOURNAL_PREFIX = "probe-journal-rank"


class ProbeJournal(ResultJournal):
    """The probe's scores of one fit rank (`ResultJournal`: by candidate, exact layers, items and settings)."""

    @classmethod
    def for_fit(cls, checkpoint_dir: str | os.PathLike, source, target, rank: int = 0, world: int = 1) -> "ProbeJournal":
        """This rank's journal in a fit's checkpoint directory, for this pair of models."""
        context = {"source": model_identity(source), "target": model_identity(target)}
        return cls(Path(checkpoint_dir) / f"{JOURNAL_PREFIX}{rank}-of-{world}.jsonl", context)


def scored(journal: ProbeJournal | None, what: str, mapper: KVMapper | None, num_exact: int, items: Sequence,
           compute: Callable[[], dict], **settings: Any) -> dict:  # fmt: skip
    """`journal.score(...)`, or `compute()` without a journal."""
    if journal is None:
        return compute()
    return journal.score(what, mapper, num_exact, items, compute, **settings)


def remove_journals(checkpoint_dir: str | os.PathLike) -> None:
    """Delete the probe journals in `checkpoint_dir` (with the calibration checkpoints, once the mapper is written)."""
    for file in Path(checkpoint_dir).glob(f"{JOURNAL_PREFIX}*.jsonl"):
        file.unlink(missing_ok=True)


__all__ = ["JOURNAL_PREFIX", "ProbeJournal", "remove_journals", "scored"]
