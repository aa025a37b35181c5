"""Mapper weights on disk: one `model.safetensors`, or shards plus an index, in transformers' layout.

A mapper larger than `max_shard_size` is written as `model-00001-of-0000N.safetensors` ... and
`model.safetensors.index.json` (`{"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}`, the format
transformers and the Hub read). Loading reads either layout tensor by tensor through `safetensors.safe_open`
(memory-mapped), so no second full copy of the weights is ever held; every file is checked against the index and
the expected tensors, and errors name the file at fault.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

__all__ = [
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHT_PATTERNS",
    "checkpoint_info",
    "has_weights",
    "load_weights",
    "parse_size",
    "save_weights",
    "weight_files",
]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# What a Hub download must fetch (huggingface_hub allow_patterns, fnmatch syntax).
WEIGHT_PATTERNS = [WEIGHTS_NAME, INDEX_NAME, "model-?????-of-?????.safetensors"]
DEFAULT_MAX_SHARD_SIZE = "5GB"

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as `"5GB"` (10^9, as transformers), `"500MB"`, `"2GiB"` (2^30), `"100KB"`.

    Example:
        ```python
        >>> parse_size("5GB"), parse_size("500MB"), parse_size("1GiB"), parse_size(1024)
        (5000000000, 500000000, 1073741824, 1024)
        ```
    """
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size must be a positive int or a size like '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"max_shard_size must be a positive int (bytes) or a size like '5GB', '500MB', '2GiB', got {size!r}"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _weight_names(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_RE.match(p.name)]


def save_weights(
    state_dict: Mapping[str, torch.Tensor],
    directory: str | os.PathLike,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Write `state_dict` to `directory` as `model.safetensors`, or as shards + index when it is larger than
    `max_shard_size` (bytes of tensor data per shard; a tensor larger than that gets a shard of its own).

    Shards are filled in the state dict's order, like transformers. Weight files of an earlier save that this one
    does not rewrite (a single file replaced by shards or the other way round, a different shard count) are
    removed, so a directory never holds two versions of the weights.

    Args:
        state_dict: tensor name -> tensor (any device; written from CPU, contiguous).
        directory: where to write (created if needed).
        max_shard_size: an int (bytes) or a string like `"5GB"`, `"500MB"` (see `parse_size`).
        metadata: string metadata stored in every file's safetensors header.

    Returns:
        The file names written, weights first, then the index if sharded.
    """
    limit = parse_size(max_shard_size)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", **(metadata or {})}
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in state_dict.items():
        nbytes = _nbytes(tensor)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        names = [WEIGHTS_NAME]
    else:
        names = [SHARD_NAME.format(index=i + 1, count=len(shards)) for i in range(len(shards))]
    for old in _weight_names(path):
        if old.name not in names:
            old.unlink()
    for file_name, keys in zip(names, shards):
        tensors = {k: state_dict[k].detach().to("cpu").contiguous() for k in keys}
        save_file(tensors, str(path / file_name), metadata=metadata)
        del tensors
    if len(shards) == 1:
        return names
    index = {
        "metadata": {"total_size": sum(_nbytes(t) for t in state_dict.values())},
        "weight_map": {k: file_name for file_name, keys in zip(names, shards) for k in keys},
    }
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*names, INDEX_NAME]


def _read_index(path: Path) -> dict[str, str]:
    index_path = path / INDEX_NAME
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{index_path} is not valid JSON ({exc}); re-save or re-download the mapper") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path} has no valid 'weight_map' ({{tensor name: shard file}}); re-save the mapper")
    for file_name in set(weight_map.values()):
        if Path(file_name).name != file_name or not file_name.endswith(".safetensors"):
            raise ValueError(f"{index_path} names shard {file_name!r}: shards must be .safetensors files next to it")
    return weight_map


def weight_files(directory: str | os.PathLike) -> list[Path]:
    """The weight files of a mapper directory: the shards its index names (sharded), else `model.safetensors`;
    `[]` when there are none. Files the index names need not exist yet (`load_weights` says which is missing)."""
    path = Path(directory)
    if (path / INDEX_NAME).is_file():
        return [path / f for f in sorted(set(_read_index(path).values()))]
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    return []


def has_weights(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds `model.safetensors` or a shard index."""
    path = Path(directory)
    return (path / WEIGHTS_NAME).is_file() or (path / INDEX_NAME).is_file()


def checkpoint_info(directory: str | os.PathLike) -> dict[str, Any]:
    """`{"files": [...], "num_shards": n, "total_size": bytes on disk}` of a mapper directory's weights."""
    files = weight_files(directory)
    return {
        "files": [f.name for f in files],
        "num_shards": len(files) if (Path(directory) / INDEX_NAME).is_file() else 0,
        "total_size": sum(f.stat().st_size for f in files if f.is_file()),
    }


def _read_file(
    file: Path, device: torch.device | str, weight_map: dict[str, str] | None,
    expected: Mapping[str, tuple[int, ...] | torch.Size] | None, state: dict[str, torch.Tensor], origin: dict[str, str],
) -> None:
    """`load_weights`' reading of one file: its tensors into `state` (and their file's name into `origin`), checked
    against the index's `weight_map`, the tensors already read and the `expected` shapes."""
    try:
        with safe_open(str(file), framework="pt", device=str(device)) as handle:
            names = list(handle.keys())
            if weight_map is not None:
                listed = {k for k, f in weight_map.items() if f == file.name}
                if set(names) != listed:
                    raise ValueError(
                        f"{file} does not hold the tensors {INDEX_NAME} assigns to it (missing "
                        f"{sorted(listed - set(names))[:5]}, not listed {sorted(set(names) - listed)[:5]}); "
                        "the shards come from different saves: re-save or re-download the mapper"
                    )
            for name in names:
                if name in state:
                    raise ValueError(f"tensor {name} is in both {origin[name]} and {file.name}; re-save the mapper")
                if expected is not None and name in expected:
                    shape = tuple(handle.get_slice(name).get_shape())
                    if shape != tuple(expected[name]):
                        raise ValueError(
                            f"weights in {file}: {name} has shape {list(shape)}, config implies "
                            f"{list(expected[name])} (config.json and weights do not match)"
                        )
                state[name] = handle.get_tensor(name)
                origin[name] = file.name
    except SafetensorError as exc:
        raise ValueError(
            f"{file} is truncated or not a valid safetensors file ({exc}); re-download the mapper "
            "(force_download=True) or re-save it"
        ) from exc


def _check_complete(
    path: Path, files: list[Path], expected: Mapping[str, tuple[int, ...] | torch.Size], state: dict[str, torch.Tensor],
    origin: dict[str, str],
) -> None:
    """`load_weights`' last check: the `files` of `path` held every `expected` tensor and no other."""
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        where = ", ".join(f.name for f in files)
        parts = [f"missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}"] if missing else []
        parts += [f"unexpected tensors {[f'{k} (in {origin[k]})' for k in extra[:5]]}"] if extra else []
        raise ValueError(f"weights in {path} ({where}) do not match its config.json: " + "; ".join(parts))


def load_weights(
    directory: str | os.PathLike,
    device: torch.device | str = "cpu",
    expected: Mapping[str, tuple[int, ...] | torch.Size] | None = None,
) -> dict[str, torch.Tensor]:
    """Read a mapper directory's weights (single file or shards), one tensor at a time from the memory-mapped files.

    Args:
        directory: holds `model.safetensors` or `model.safetensors.index.json` and its shards.
        device: where the tensors go.
        expected: tensor name -> shape; when given, a missing, extra or mis-shaped tensor is an error naming the file.

    Returns:
        tensor name -> tensor.

    Raises:
        FileNotFoundError: no weights, or a shard the index names is missing (the message names it).
        ValueError: a truncated or corrupt file, a file whose tensors disagree with the index, a tensor in two files,
            or (with `expected`) missing / extra / mis-shaped tensors; the message names the file.
    """
    path = Path(directory)
    sharded = (path / INDEX_NAME).is_file()
    weight_map = _read_index(path) if sharded else None
    files = weight_files(path)
    if not files:
        raise FileNotFoundError(f"{path} holds no mapper weights: expected {WEIGHTS_NAME} or {INDEX_NAME} and its shards")
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(
                f"shard {file.name} named by {INDEX_NAME} is missing from {path}; re-download the mapper "
                "(force_download=True) or re-save it"
            )
        _read_file(file, device, weight_map, expected, state, origin)
    if expected is not None:
        _check_complete(path, files, expected, state, origin)
    return state
