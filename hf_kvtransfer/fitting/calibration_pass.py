"""The one calibration pass: calibration tokens through both models, handed batch by batch to accumulators.

`calibration_pass` owns everything about running the models over a fixed token sample: pair checks, batching,
the held-out shard (the *last* `num_heldout` sequences), sharding over `torch.distributed` ranks (rank r takes
sequences r, r + world, ... of each shard), progress, Ctrl-C, and resumable checkpoints. What is done with
the stripped states is up to its consumers (anything with `update(batch)`; see `StatisticsAccumulator` and the
MLP fitter's feature collector in `mlp.py`):

- `accumulate.StatisticsAccumulator`: the ridge sufficient statistics of the fit and held-out shards,
  in full or, in two-stage mode, only the Gram/cross blocks a token probe selected. Checkpointed, all-reduced.
- any other consumer (e.g. `mlp.FeatureCollector`: raw features of some tokens) rides along in the same pass.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from ..core.capture import capture_kv, capture_kv_and_inputs
from ..core.mapper_config import config_fingerprint
from ..core.progress import progress_bar
from ..core.rope import check_supported, text_config
from .calibration import sample_hash

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint-rank"


# -- pair checks ----------------------------------------------------------------------------------------------


def check_pair(source: PreTrainedModel, target: PreTrainedModel) -> None:
    """Raise if two models cannot share a token stream (vocabulary) or an architecture is unsupported."""
    for model in (source, target):
        check_supported(text_config(model.config))
    s_vocab, t_vocab = text_config(source.config).vocab_size, text_config(target.config).vocab_size
    if s_vocab != t_vocab:
        raise ValueError(
            f"source and target vocabularies differ ({s_vocab} vs {t_vocab} tokens): KV transfer needs both models "
            "to read the same token ids; pick two models of one family that share a tokenizer"
        )


def check_tokenizers(source_tokenizer, target_tokenizer) -> None:
    """Raise if two tokenizers would turn the same text into different ids (vocabulary or special tokens)."""
    problems = []
    vs, vt = source_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if vs != vt:
        only_s, only_t = sorted(set(vs) - set(vt)), sorted(set(vt) - set(vs))
        moved = sorted(tok for tok in set(vs) & set(vt) if vs[tok] != vt[tok])
        problems.append(
            f"vocabularies differ ({len(vs)} vs {len(vt)} entries; only in source: {only_s[:5]}, only in target: "
            f"{only_t[:5]}, different ids: {moved[:5]})"
        )
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(source_tokenizer, attr, None), getattr(target_tokenizer, attr, None)
        if a != b:
            problems.append(f"{attr} is {a} in the source and {b} in the target")
    sa, ta = sorted(map(str, source_tokenizer.all_special_tokens)), sorted(map(str, target_tokenizer.all_special_tokens))
    if sa != ta:
        problems.append(f"special tokens differ: {sa} vs {ta}")
    if problems:
        raise ValueError(
            "source and target tokenizers differ: " + "; ".join(problems) + ". KV transfer needs both models to read "
            "the same token ids; pick a source and target of one family that share a tokenizer"
        )


# -- calibration data as one token tensor -------------------------------------------------------------------


def as_token_tensor(
    calibration_input_ids: torch.Tensor | Iterable, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[num_sequences, seq_len]` ids (+ mask) from a tensor or an iterable of batches (tensors or dicts with
    `input_ids` / `attention_mask`); batches of different lengths are right-padded and masked."""
    if isinstance(calibration_input_ids, torch.Tensor):
        ids = calibration_input_ids if calibration_input_ids.ndim == 2 else calibration_input_ids.unsqueeze(0)
        return ids, attention_mask
    rows: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for item in calibration_input_ids:
        ids, mask = (item["input_ids"], item.get("attention_mask")) if isinstance(item, dict) else (item, None)
        ids = torch.as_tensor(ids)
        ids = ids if ids.ndim == 2 else ids.unsqueeze(0)
        rows.append((ids, torch.as_tensor(mask).reshape(ids.shape) if mask is not None else None))
    if not rows:
        raise ValueError("the calibration data is empty: pass token ids [num_sequences, seq_len]")
    width = max(ids.shape[1] for ids, _ in rows)
    if all(ids.shape[1] == width for ids, _ in rows) and all(mask is None for _, mask in rows):
        return torch.cat([ids for ids, _ in rows]), None
    # Right padding: causal attention never lets a real token see the pads after it.
    padded = torch.cat([torch.nn.functional.pad(ids, (0, width - ids.shape[1])) for ids, _ in rows])
    masks = [mask if mask is not None else torch.ones_like(ids) for ids, mask in rows]
    return padded, torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks])


# -- consumers ------------------------------------------------------------------------------------------------


@dataclass
class CalibrationBatch:
    """What the pass hands its consumers: one batch of RoPE-stripped states, lists of
    `[batch, kv_heads, seq, head_dim]` per layer, with the shard (`"train"` / `"heldout"`) and sequence rows."""

    part: str
    rows: list[int]
    attention_mask: torch.Tensor | None
    source_keys: list[torch.Tensor]
    source_values: list[torch.Tensor]
    target_keys: list[torch.Tensor]
    target_values: list[torch.Tensor]
    # Asked for by consumers (`target_hidden_layers`, `target_key_projections`): the target's residual stream entering
    # those layers `{layer: [batch, seq, hidden]}` and its keys before the key norm, per layer.
    target_hidden: dict[int, torch.Tensor] | None = None
    target_key_projections: list[torch.Tensor] | None = None

    def states(self, kind: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`(source states, target states)` of `kind` ('key' or 'value')."""
        return (self.source_keys, self.target_keys) if kind == "key" else (self.source_values, self.target_values)


class CalibrationConsumer(Protocol):
    """Receives every batch of the pass. Checkpointable consumers also implement `run_key`, `ready`,
    `checkpoint_state` and `load_checkpoint_state`; `end_of_data` and `finish` run once after the last batch."""

    name: str
    checkpointable: bool

    def update(self, batch: CalibrationBatch) -> None: ...


def dist_info(group=None) -> tuple[int, int]:
    """`(rank, world_size)` under `torch.distributed`, `(0, 1)` without it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


# -- checkpoints ----------------------------------------------------------------------------------------------


def _json_roundtrip(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _save_checkpoint(path: Path, consumers, done: int, run: dict) -> None:
    """One safetensors file holding every checkpointable consumer's state and the progress: temp file, rename."""
    tensors, meta = {}, {"run": run, "done": done, "consumers": {}}
    for c in consumers:
        state, info = c.checkpoint_state()
        tensors.update({f"{c.name}/{k}": v for k, v in state.items()})
        meta["consumers"][c.name] = info
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"checkpoint": json.dumps(meta, sort_keys=True)})
    os.replace(tmp, path)


def read_checkpoint_state(path: str | os.PathLike, device="cpu") -> tuple[dict, dict[str, torch.Tensor]]:
    """`(metadata, tensors)` of a `calibration_pass` checkpoint: metadata has `run`, `done` and `consumers`
    (each checkpointable consumer's state description); tensors are prefixed `"<consumer name>/"`."""
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {})["checkpoint"])
    # Fresh (aligned) copies: BLAS may take another kernel, and round differently, on the file buffer's
    # alignment, and a resumed run must add up exactly as an uninterrupted one.
    return meta, {name: t.clone() for name, t in load_file(str(path), device=str(device)).items()}


def checkpoint_path(checkpoint_dir: str | os.PathLike, group=None) -> Path:
    """This rank's checkpoint file in `checkpoint_dir`."""
    rank, world = dist_info(group)
    return Path(checkpoint_dir) / f"{CHECKPOINT_PREFIX}{rank}-of-{world}.safetensors"


def remove_checkpoints(checkpoint_dir: str | os.PathLike) -> None:
    """Delete the checkpoint files `calibration_pass` wrote (and the directory if it is then empty)."""
    path = Path(checkpoint_dir)
    for file in path.glob(f"{CHECKPOINT_PREFIX}*.safetensors"):
        file.unlink(missing_ok=True)
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()


class _GracefulInterrupt:
    """Turn the first SIGINT into a flag checked between batches (so a checkpoint is written); the second one
    interrupts at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        logger.warning("interrupt received: finishing the current batch and writing a checkpoint (Ctrl-C again to abort)")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


# -- the pass -------------------------------------------------------------------------------------------------


@torch.no_grad()
def calibration_pass(
    source: PreTrainedModel,
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    consumers: Sequence[CalibrationConsumer] = (),
    *,
    stride: int = 4,
    batch_size: int = 8,
    num_heldout: int = 0,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 64,
    progress: bool = True,
    group=None,
) -> None:
    """Run both models over a fixed token sample once and hand every batch of stripped states to `consumers`.

    The last `num_heldout` sequences form the held-out shard (`batch.part == "heldout"`). Under
    `torch.distributed` (torchrun, accelerate launch) rank r takes sequences r, r + world, ... of each shard;
    checkpointable consumers all-reduce in `finish`. With `checkpoint_dir`, each rank saves its consumers'
    state every `checkpoint_every` sequences (atomic rename), on SIGINT and on errors, and a call with the same
    arguments resumes from there; the result equals an uninterrupted run.

    Args:
        input_ids: `[num_sequences, seq_len]` token ids (e.g. from `calibration.build_calibration`).
        attention_mask: optional `[num_sequences, seq_len]` mask (1 = real token).
        consumers: objects with `update(CalibrationBatch)` (e.g. `StatisticsAccumulator`).
        stride: recorded in the run key (consumers choose their own tokens).
    """
    check_pair(source, target)
    _check_pass_arguments(input_ids, stride, batch_size, checkpoint_every, num_heldout)
    saving = [c for c in consumers if getattr(c, "checkpointable", False)]
    if checkpoint_dir is not None and len(saving) != len(consumers):
        names = [getattr(c, "name", type(c).__name__) for c in consumers if c not in saving]
        raise ValueError(f"checkpoints cannot hold the state of {names}: drop checkpoint_dir (and stats_dir) for this fit")
    rank, world = dist_info(group)
    run = {
        "sample_sha256": _sample_hash_of_all_ranks(input_ids, world, group),
        "mask_sha256": sample_hash(attention_mask.long()) if attention_mask is not None else None,
        "stride": stride,
        "num_heldout": num_heldout,
        "world_size": world,
        "source": config_fingerprint(source.config),
        "target": config_fingerprint(target.config),
    }
    for c in saving:
        run.update(c.run_key())
    path = checkpoint_path(checkpoint_dir, group) if checkpoint_dir is not None else None
    done = _resume(path, run, saving) if path is not None and path.is_file() else 0
    order = _sequence_order(input_ids.shape[0], num_heldout, rank, world)
    state = _PassState(source, target, input_ids, attention_mask, consumers, saving, path, run, len(order), done)
    seq_len = input_ids.shape[1]
    bar = progress_bar(
        total=len(order) * seq_len, initial=done * seq_len, desc="calibration", unit="tok", unit_scale=True,
        enabled=progress and rank == 0,
    )  # fmt: skip
    state.run_batches(_batches(order[done:], batch_size), checkpoint_every, bar)
    bar.close()
    state.finish()


def _check_pass_arguments(
    input_ids: torch.Tensor, stride: int, batch_size: int, checkpoint_every: int, num_heldout: int
) -> None:
    """Raise on a sample that is not `[num_sequences, seq_len]` or an option out of its range."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [num_sequences, seq_len], got shape {list(input_ids.shape)}")
    if stride < 1 or batch_size < 1 or checkpoint_every < 1:
        raise ValueError(f"stride, batch_size and checkpoint_every must be >= 1, got {stride}, {batch_size}, {checkpoint_every}")
    num_sequences = input_ids.shape[0]
    if not 0 <= num_heldout < num_sequences:
        raise ValueError(f"num_heldout must be in [0, {num_sequences}) (the number of sequences), got {num_heldout}")


def _sample_hash_of_all_ranks(input_ids: torch.Tensor, world: int, group) -> str:
    """`sample_hash(input_ids)`, checked to be the same on every one of `world` ranks."""
    digest = sample_hash(input_ids)
    if world > 1:
        import torch.distributed as dist

        digests = [None] * world
        dist.all_gather_object(digests, digest, group=group)
        if len(set(digests)) != 1:
            raise ValueError(f"ranks built different calibration samples ({digests}); every rank must read the same data")
    return digest


def _resume(path: Path, run: dict, saving: Sequence[CalibrationConsumer]) -> int:
    """Load the checkpoint at `path` into the checkpointable consumers `saving`; the sequences it has done.
    Raises if it belongs to another `run` (models, data or options). A checkpoint that also holds the sums of
    consumers this pass does not run (a fit with `--exact-layers N` after one that searched the residual's maps)
    is resumed for the sums this pass needs: the rest go unused."""
    meta, tensors = read_checkpoint_state(path)
    expected, stored = _json_roundtrip(run), meta["run"]
    unused = sorted(set(meta["consumers"]) - {c.name for c in saving})
    diffs = sorted(k for k in set(expected) | set(stored)
                   if expected.get(k) != stored.get(k) and not (k not in expected and unused))  # fmt: skip
    if diffs:
        raise ValueError(
            f"checkpoint {path} belongs to a different fit (differs in: {', '.join(diffs)}); rerun with the same "
            "models, data and options to resume it, or delete it (or choose another --stats-dir) to start over"
        )
    for c in saving:
        prefix = f"{c.name}/"
        state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        c.load_checkpoint_state(state, meta["consumers"][c.name], str(path))
    done = int(meta["done"])
    logger.warning("resuming from %s: %d sequences of this rank already done%s", path, done,
                   f" (its {', '.join(unused)} sums unused by this fit)" if unused else "")  # fmt: skip
    return done


def _sequence_order(num_sequences: int, num_heldout: int, rank: int, world: int) -> list[tuple[str, int]]:
    """This rank's `(shard, sequence)` in pass order: its fit sequences, then its held-out ones (the last
    `num_heldout`)."""
    num_train = num_sequences - num_heldout
    order = [("train", i) for i in range(rank, num_train, world)]
    order += [("heldout", i) for i in range(num_train + rank, num_sequences, world)]
    return order


def _batches(order: Sequence[tuple[str, int]], batch_size: int) -> list[tuple[str, list[int]]]:
    """`order` as batches `(shard, rows)` of at most `batch_size` sequences, none across two shards."""
    batches: list[tuple[str, list[int]]] = []
    for part, i in order:
        if batches and batches[-1][0] == part and len(batches[-1][1]) < batch_size:
            batches[-1][1].append(i)
        else:
            batches.append((part, [i]))
    return batches


@dataclass
class _PassState:
    """One rank's pass: the models, the sample, the consumers (`saving`: the checkpointable ones), the checkpoint
    file (`path`, None without checkpoints) with the `run` key it belongs to, and the progress: `done` of this
    rank's `total` sequences through the pass, `saved` of them in the checkpoint."""

    source: PreTrainedModel
    target: PreTrainedModel
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    consumers: Sequence[CalibrationConsumer]
    saving: list[CalibrationConsumer]
    path: Path | None
    run: dict
    total: int
    done: int = 0
    saved: int = field(init=False)
    # What consumers need of the target beyond its K/V (the residual-input statistics: `residual_stats.py`).
    hidden_layers: tuple[int, ...] = field(init=False)
    key_projections: bool = field(init=False)

    def __post_init__(self):
        self.saved = self.done
        self.hidden_layers = tuple(sorted({j for c in self.consumers for j in getattr(c, "target_hidden_layers", ())}))
        self.key_projections = any(getattr(c, "target_key_projections", False) for c in self.consumers)

    def ready(self) -> bool:
        return all(getattr(c, "ready", True) for c in self.saving)

    def checkpoint(self) -> None:
        _save_checkpoint(self.path, self.saving, self.done, self.run)

    def capture(self, part: str, rows: list[int]) -> CalibrationBatch:
        """Both models' stripped states of the sequences `rows` (and the target's inputs the consumers need)."""
        ids = self.input_ids[rows]
        mask = self.attention_mask[rows] if self.attention_mask is not None else None
        src_k, src_v = capture_kv(self.source, ids, mask)
        if self.hidden_layers or self.key_projections:
            tgt_k, tgt_v, tgt_h, tgt_p = capture_kv_and_inputs(
                self.target, ids, mask, hidden_layers=self.hidden_layers, key_projections=self.key_projections
            )
        else:
            (tgt_k, tgt_v), tgt_h, tgt_p = capture_kv(self.target, ids, mask), None, None
        return CalibrationBatch(part, rows, mask, src_k, src_v, tgt_k, tgt_v, tgt_h, tgt_p)

    def run_batches(self, batches: list[tuple[str, list[int]]], checkpoint_every: int, bar) -> None:
        """Hand every batch to the consumers, checkpointing every `checkpoint_every` sequences, on errors and on
        Ctrl-C (then raising `KeyboardInterrupt`)."""
        seq_len = self.input_ids.shape[1]
        with _GracefulInterrupt() as interrupt:
            for part, rows in batches:
                was_ready = self.ready()
                try:
                    batch = self.capture(part, rows)
                except BaseException:
                    # Sums are untouched by this batch: keep what is done (OOM, Ctrl-C twice, a bad batch, ...).
                    if self.path is not None and self.done > self.saved and was_ready:
                        self.checkpoint()
                    raise
                for c in self.consumers:
                    c.update(batch)
                self.done += len(rows)
                bar.update(len(rows) * seq_len)
                if not self.ready():
                    if interrupt.requested:
                        raise KeyboardInterrupt("interrupted during the two-stage probe (no checkpoint yet: it restarts)")
                    continue
                due = not was_ready or self.done - self.saved >= checkpoint_every or self.done == self.total
                if self.path is not None and (interrupt.requested or due):
                    self.checkpoint()
                    self.saved = self.done
                if interrupt.requested:
                    bar.close()
                    raise KeyboardInterrupt(
                        f"interrupted after {self.done} of {self.total} sequences; checkpoint in {self.path}"
                    )

    def finish(self) -> None:
        """After the last batch: the consumers' `end_of_data`, the last checkpoint, their `finish`."""
        for c in self.consumers:
            if hasattr(c, "end_of_data"):
                c.end_of_data()
        if self.path is not None and (self.done > self.saved or self.done == 0):
            self.checkpoint()
        for c in self.consumers:
            if hasattr(c, "finish"):
                c.finish()


__all__ = [
    "CalibrationBatch",
    "CalibrationConsumer",
    "as_token_tensor",
    "calibration_pass",
    "check_pair",
    "check_tokenizers",
    "checkpoint_path",
    "dist_info",
    "read_checkpoint_state",
    "remove_checkpoints",
]
