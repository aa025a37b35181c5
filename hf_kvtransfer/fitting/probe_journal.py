"""The fit's probe scores kept on disk while it runs, so an interrupted fit resumes its probe where it stopped.

After the calibration pass (checkpointed by `calibration_pass`), a fit with `num_exact_layers="auto"` scores its
candidates: repeated spans, cued recall and the content gate's passage recall and hand-off, each a forward of both
models over a few hundred items per candidate. On the deep bundled pair that took 1,993 s of a 2,870 s fit. Each
score is appended to a journal beside the calibration checkpoint; a rerun of the same fit reads it back instead of
scoring again, so Ctrl-C, a lost session or an out-of-memory error costs at most the score that was running.

A score is found again only by what determines it: what was scored (the probe's name and settings), the
candidate's weights and config, its exact layers and the items themselves (hashed). Anything else changed (another
candidate, other items, other models) misses and is scored afresh; the journal of other models is dropped whole.
Only results that survive a JSON round trip unchanged are kept (a result with a NaN is scored again), so a resumed
fit reads exactly what the first one computed and decides alike. The journal is deleted with the checkpoint when the
fit's mapper is written.

Example:
    ```python
    journal = ProbeJournal.for_fit("runs/fit-checkpoint", source, target)
    mapper, report = choose_configuration(source, target, base, ids, candidates=candidates, journal=journal)
    ```
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core.mapper import KVMapper, config_fingerprint

logger = logging.getLogger(__name__)

JOURNAL_PREFIX = "probe-journal-rank"
FORMAT = 1
# Values per weight tensor hashed at each end: enough to tell a retrained checkpoint of the same shapes apart.
SAMPLED_VALUES = 1024


class ProbeJournal:
    """Scores by key, appended to one JSON-lines file (a header line, then one line per score)."""

    def __init__(self, path: str | os.PathLike, context: dict[str, Any]):
        self.path = Path(path)
        self.context = {"format": FORMAT, **context}
        self.entries: dict[str, Any] = {}
        self.reused = 0
        self._fingerprints: dict[int, tuple[KVMapper, str]] = {}  # id -> (the mapper, kept alive; its hash)
        if self.path.is_file():
            self._read()
        if self.entries and not self.path.read_bytes().endswith(b"\n"):
            with self.path.open("a", encoding="utf-8") as f:
                f.write("\n")  # a line cut short by a kill: the next score starts a line of its own
        if not self.entries:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"context": self.context}) + "\n", encoding="utf-8")

    @classmethod
    def for_fit(cls, checkpoint_dir: str | os.PathLike, source, target, rank: int = 0, world: int = 1) -> "ProbeJournal":
        """This rank's journal in a fit's checkpoint directory, for this pair of models."""
        context = {"source": _model_identity(source), "target": _model_identity(target)}
        return cls(Path(checkpoint_dir) / f"{JOURNAL_PREFIX}{rank}-of-{world}.jsonl", context)

    def score(self, what: str, mapper: KVMapper, num_exact: int, items: Sequence, compute: Callable[[], dict],
              **settings: Any) -> dict:  # fmt: skip
        """`compute()`'s result for this candidate, exact layers and items: read back when journaled, else computed
        and appended."""
        key = self._key(what, mapper, num_exact, items, settings)
        if key in self.entries:
            self.reused += 1
            return json.loads(self.entries[key])
        result = compute()
        text = _exact_json(result)
        if text is not None:
            self.entries[key] = text
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"key": key, "result": result}, allow_nan=False) + "\n")
        return result

    def _key(self, what: str, mapper: KVMapper, num_exact: int, items: Sequence, settings: dict[str, Any]) -> str:
        h = hashlib.sha256(json.dumps([what, num_exact, settings], sort_keys=True, default=str).encode())
        h.update(self._fingerprint(mapper).encode())
        h.update(repr(list(items)).encode())
        return h.hexdigest()

    def _fingerprint(self, mapper: KVMapper) -> str:
        kept = self._fingerprints.get(id(mapper))
        if kept is None or kept[0] is not mapper:
            h = hashlib.sha256(_canonical(mapper.config).encode())
            for name, tensor in sorted(mapper.state_dict().items()):
                t = tensor.detach().cpu().contiguous().reshape(-1)
                h.update(f"{name}:{t.dtype}:{tuple(tensor.shape)}".encode())
                h.update(t.view(torch.uint8).numpy().tobytes())
            kept = self._fingerprints[id(mapper)] = (mapper, h.hexdigest())
        return kept[1]

    def _read(self) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines()
        try:
            header = json.loads(lines[0]) if lines else {}
        except ValueError:
            header = {}
        if header.get("context") != json.loads(json.dumps(self.context)):
            logger.info("probe journal %s belongs to another fit (other models or format): starting a new one", self.path)
            return
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut short when the fit was killed mid-write: that score runs again
            self.entries[entry["key"]] = json.dumps(entry["result"], allow_nan=False)


def scored(journal: ProbeJournal | None, what: str, mapper: KVMapper, num_exact: int, items: Sequence,
           compute: Callable[[], dict], **settings: Any) -> dict:  # fmt: skip
    """`journal.score(...)`, or `compute()` without a journal."""
    if journal is None:
        return compute()
    return journal.score(what, mapper, num_exact, items, compute, **settings)


def remove_journals(checkpoint_dir: str | os.PathLike) -> None:
    """Delete the probe journals in `checkpoint_dir` (with the calibration checkpoints, once the mapper is written)."""
    for file in Path(checkpoint_dir).glob(f"{JOURNAL_PREFIX}*.jsonl"):
        file.unlink(missing_ok=True)


def _canonical(config) -> str:
    """A mapper config as text that does not depend on the order its dicts were filled in (a model config's keys
    come in another order after a checkpoint is loaded than when it was built)."""
    data = dataclasses.asdict(config)
    if data.get("exact_window") is None:  # unset: the text a journal written before the field holds
        data.pop("exact_window", None)
    return json.dumps(data, sort_keys=True, default=repr)


def _model_identity(model) -> dict[str, Any]:
    """What the scores of a model depend on: its shapes, dtype and a sample of its weights (both ends of every
    tensor, so a retrained checkpoint of the same shapes is told apart without reading all of a large model)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}".encode())
        if p.device.type == "meta":
            continue  # offloaded (accelerate): its shape is all there is to read here
        flat = p.detach().reshape(-1)
        h.update(torch.cat([flat[:SAMPLED_VALUES], flat[-SAMPLED_VALUES:]]).float().cpu().numpy().tobytes())
    return {"config": config_fingerprint(model.config), "dtype": str(model.dtype), "weights_sample": h.hexdigest()}


def _exact_json(value: Any) -> str | None:
    """`value` as JSON when reading it back gives `value` itself, else None (a tuple, a numpy number, a NaN)."""
    if not _json_native(value):
        return None
    try:
        text = json.dumps(value, allow_nan=False)
    except ValueError:
        return None
    return text if json.loads(text) == value else None


def _json_native(value: Any) -> bool:
    """Whether `value` is made of what JSON gives back as it was (dicts with str keys, lists, str, int, float, bool,
    None): a tuple or a numpy number would come back as something else."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_native(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_json_native(v) for v in value)
    return value is None or type(value) in (str, int, float, bool)


__all__ = ["JOURNAL_PREFIX", "ProbeJournal", "remove_journals", "scored"]
