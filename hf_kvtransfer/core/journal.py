"""Results kept on disk while a long run computes them, so an interrupted run resumes where it stopped: the fit's
probe scores (`fitting/probe_journal.py`) and `eval`'s finished tasks (`evaluation/evaluate.py`).

A result is found again only by what determines it: what was computed (a name and its settings), the mapper's
weights and config, its exact layers and the inputs themselves (hashed); the journal's header names the models, and
a journal of other models is dropped whole. Only results that survive a JSON round trip unchanged are kept (a tuple
or a numpy number is computed again; a NaN, such as the interval of a score taken without a bootstrap, is written as
Python's `json` writes it and comes back as a NaN), so a resumed run reads exactly what the first one computed. A
line cut short by a kill is skipped (that result is computed again).

Example:
    ```python
    journal = ResultJournal("runs/eval.json.journal.jsonl", {"source": model_identity(source)})
    result = journal.score("recall", mapper, 3, items, lambda: passage_recall(...), seed=0)
    ```
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .mapper import KVMapper
from .mapper_config import config_fingerprint

logger = logging.getLogger(__name__)

FORMAT = 1
# Values per weight tensor hashed at each end: enough to tell a retrained checkpoint of the same shapes apart.
SAMPLED_VALUES = 1024


class ResultJournal:
    """Results by key, appended to one JSON-lines file (a header line, then one line per result)."""

    def __init__(self, path: str | os.PathLike, context: dict[str, Any]):
        self.path = Path(path)
        self.context = {"format": FORMAT, **context}
        self.entries: dict[str, Any] = {}
        self.names: dict[str, str | None] = {}  # key -> what was computed (None in a journal written before names)
        self.reused = 0
        self.reused_names: Counter[str | None] = Counter()
        self._fingerprints: dict[int, tuple[KVMapper, str]] = {}  # id -> (the mapper, kept alive; its hash)
        if self.path.is_file():
            self._read()
        if self.entries and not self.path.read_bytes().endswith(b"\n"):
            with self.path.open("a", encoding="utf-8") as f:
                f.write("\n")  # a line cut short by a kill: the next result starts a line of its own
        if not self.entries:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"context": self.context}) + "\n", encoding="utf-8")

    def score(self, what: str, mapper: KVMapper | None, num_exact: int, items: Sequence, compute: Callable[[], dict],
              **settings: Any) -> dict:  # fmt: skip
        """`compute()`'s result for this mapper (None: the target alone), exact layers, items and settings: read back
        when journaled, else computed and appended."""
        key = self._key(what, mapper, num_exact, items, settings)
        if key in self.entries:
            self.reused += 1
            self.reused_names[what] += 1
            return json.loads(self.entries[key])
        result = compute()
        text = _exact_json(result)
        if text is not None:
            self.entries[key], self.names[key] = text, what
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"key": key, "what": what, "result": result}) + "\n")
        return result

    def kept_names(self) -> Counter[str | None]:
        """How many results the journal holds, by what was computed."""
        return Counter(self.names.get(key) for key in self.entries)

    def _key(self, what: str, mapper: KVMapper | None, num_exact: int, items: Sequence, settings: dict[str, Any]) -> str:
        h = hashlib.sha256(json.dumps([what, num_exact, settings], sort_keys=True, default=str).encode())
        h.update(("target alone" if mapper is None else self.fingerprint(mapper)).encode())
        h.update(repr(list(items)).encode())
        return h.hexdigest()

    def fingerprint(self, mapper: KVMapper) -> str:
        """A hash of `mapper`'s config and every weight (kept per mapper object: a mapper is hashed once)."""
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
            logger.info("journal %s belongs to another run (other models or format): starting a new one", self.path)
            return
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut short when the run was killed mid-write: that result is computed again
            self.entries[entry["key"]] = json.dumps(entry["result"])
            self.names[entry["key"]] = entry.get("what")


def _canonical(config) -> str:
    """A mapper config as text that does not depend on the order its dicts were filled in (a model config's keys
    come in another order after a checkpoint is loaded than when it was built)."""
    data = dataclasses.asdict(config)
    if data.get("exact_window") is None:  # unset: the text a journal written before the field holds
        data.pop("exact_window", None)
    return json.dumps(data, sort_keys=True, default=repr)


def model_identity(model) -> dict[str, Any]:
    """What the results of a model depend on: its shapes, dtype and a sample of its weights (both ends of every
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
    """`value` as JSON when reading it back gives `value` itself (a NaN for a NaN), else None (a tuple, a numpy
    number): for JSON's own types, written as Python's `json` writes them, the round trip is exact."""
    return json.dumps(value) if _json_native(value) else None


def _json_native(value: Any) -> bool:
    """Whether `value` is made of what JSON gives back as it was (dicts with str keys, lists, str, int, float, bool,
    None): a tuple or a numpy number would come back as something else."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_native(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_json_native(v) for v in value)
    return value is None or type(value) in (str, int, float, bool)


__all__ = ["ResultJournal", "model_identity"]
