"""The mapper `demo` fits, kept for the next demo with the same models and options.

A demo without a mapper fits one (minutes on the bundled family, more on the deep pair). It is kept in a folder of
`kept_mapper_root()` named by a hash of what the fit depends on: the two models (their shapes and a sample of their
weights, `core/journal.model_identity`), the calibration text, the fit's options and the library's version. A later
demo with the same hash reads it back instead of fitting again (`demo --exact-layers 4` after `demo`, say); an
interrupted fit leaves its checkpoint and its probe journal there, and the next demo resumes from them.

Example:
    ```python
    options = {"num_sequences": 64, "seq_len": 256}
    folder = kept_mapper_dir(source, target, "calibration.txt", options)
    mapper = read_kept_mapper(folder)
    if mapper is None and writable(folder):
        mapper = fit_mapper(source, target, "calibration.txt", tokenizer=tokenizer,
                            checkpoint_dir=str(folder / CHECKPOINT), **options)
        keep_mapper(mapper, folder)
    ```
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from huggingface_hub import constants

from ..core.hub import CONFIG_NAME
from ..core.journal import model_identity
from ..core.mapper import KVMapper
from ..version import __version__

logger = logging.getLogger(__name__)

CACHE_ENV = "HF_KVTRANSFER_CACHE"
CHECKPOINT = "checkpoint"  # the interrupted fit's statistics and probe journal, inside the kept folder


def kept_mapper_root() -> Path:
    """Where demos keep their fitted mappers: `$HF_KVTRANSFER_CACHE`, else `hf-kvtransfer/` in the Hugging Face
    cache folder (`$HF_HOME`, by default `~/.cache/huggingface`)."""
    return Path(os.environ.get(CACHE_ENV) or Path(constants.HF_HOME) / "hf-kvtransfer") / "demo"


def kept_mapper_dir(source, target, calibration: str | os.PathLike, options: dict[str, Any]) -> Path:
    """The folder of the mapper a demo fits for these models, calibration text and fit options."""
    key = {
        "version": __version__,
        "source": model_identity(source),
        "target": model_identity(target),
        "calibration": hashlib.sha256(Path(calibration).read_bytes()).hexdigest(),
        "options": options,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return kept_mapper_root() / digest[:16]


def read_kept_mapper(folder: Path) -> KVMapper | None:
    """The mapper an earlier demo kept in `folder` (None when there is none, or it does not load: it is fit again)."""
    if not (folder / CONFIG_NAME).is_file():
        return None
    try:
        return KVMapper.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        logger.warning("the mapper kept in %s does not load (%s): fitting it again", folder, exc)
        return None


def writable(folder: Path) -> bool:
    """Whether a demo can keep its mapper in `folder` (made when missing); if not, it says so and keeps nothing."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".writable"
        probe.write_bytes(b"")
        probe.unlink()
        return True
    except OSError as exc:
        logger.warning("demo: cannot keep the fitted mapper in %s (%s); set $%s to a writable folder to keep it",
                       folder, exc, CACHE_ENV)  # fmt: skip
        return False


def keep_mapper(mapper: KVMapper, folder: Path) -> bool:
    """Save a fitted mapper in `folder` for later demos, and drop the checkpoint its fit no longer needs. A failure
    to save is said and the demo goes on with the mapper in memory (the fit is not lost); returns whether it is kept."""
    try:
        mapper.save_pretrained(str(folder))
    except OSError as exc:
        logger.warning("demo: the fitted mapper could not be kept in %s (%s)", folder, exc)
        return False
    shutil.rmtree(folder / CHECKPOINT, ignore_errors=True)
    return True


__all__ = ["CACHE_ENV", "CHECKPOINT", "keep_mapper", "kept_mapper_dir", "kept_mapper_root", "read_kept_mapper", "writable"]
