"""The connector's KV stores (`hf_kvtransfer/integrations/kv_store.py`): no vLLM, no LMCache.

- `FileKVStore`: round trip, longest-prefix lookup, LRU pruning to a byte bound, two readers while a writer writes
  and prunes (separate processes), and half-written or corrupted entries read as misses (and removed), never as KV;
- `LMCacheKVStore` against a fake of LMCache's documented engine API (`store` / `retrieve` / `lookup` with a GPU
  connector and chunked prefix keys), nothing more.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

import pytest
import torch

from conftest import HANG_GUARD_S
from hf_kvtransfer.integrations.kv_store import (
    FileKVStore,
    KVStore,
    LMCacheKVStore,
    prompt_key,
    shard_name,
)

LAYERS, HEADS, DIM = 3, 2, 4


def _tensors(token_ids, rank: int = 0) -> dict[str, torch.Tensor]:
    """KV that encodes (token, layer, rank): a reader can check it got the entry it asked for."""
    ids = torch.as_tensor(token_ids, dtype=torch.float32).view(-1, 1, 1)
    out = {}
    for s in range(LAYERS):
        out[f"key.{s}"] = (ids + 1000 * s + 0.5 * rank).expand(-1, HEADS, DIM).contiguous()
        out[f"value.{s}"] = -out[f"key.{s}"]
    return out


INFO = {"kv_shape": {"num_hidden_layers": LAYERS, "num_key_value_heads": HEADS, "head_dim": DIM}}


def test_file_store_round_trip_and_prefix_lookup(tmp_path):
    store = FileKVStore(tmp_path)
    assert isinstance(store, KVStore)
    a, b = list(range(10, 30)), list(range(10, 40))
    store.put(a, _tensors(a), INFO)
    store.put(b, _tensors(b), INFO)
    assert store.lookup(b + [7, 8]) == len(b)
    assert store.lookup(a + [99]) == len(a)  # b is not a prefix of it
    assert store.lookup([1, 2, 3]) == 0
    assert store.contains(a) and not store.contains(a[:-1])
    got = store.get(a)
    assert got.token_ids == a and got.info["kv_shape"] == INFO["kv_shape"] and got.info["tensor_parallel_size"] == 1
    for name, tensor in _tensors(a).items():
        torch.testing.assert_close(got.shards[0][name], tensor)
    assert store.get(a[:-1]) is None


def test_tensor_parallel_entry_is_complete_only_with_every_shard(tmp_path):
    store = FileKVStore(tmp_path)
    ids = list(range(50))
    store.put(ids, _tensors(ids, 1), INFO, rank=1, world_size=2)
    assert store.lookup(ids) == 0  # rank 0 (and its tokens.json) not written yet
    store.put(ids, _tensors(ids, 0), INFO, rank=0, world_size=2)
    got = store.get(ids)
    assert [s["key.0"][0, 0, 0].item() for s in got.shards] == [0.0, 0.5]


def test_file_store_prunes_least_recently_used_to_its_bound(tmp_path):
    probe = FileKVStore(tmp_path / "probe")
    probe.put(list(range(100)), _tensors(list(range(100))), INFO)
    entry_bytes = probe.nbytes()

    store = FileKVStore(tmp_path / "store", max_bytes=int(3.5 * entry_bytes))
    seqs = [[i] + list(range(1, 100)) for i in range(5)]  # same size, different keys
    for ids in seqs[:3]:
        store.put(ids, _tensors(ids), INFO)
        time.sleep(0.02)
    assert store.get(seqs[0]) is not None  # seqs[0] used now: seqs[1] is the least recently used
    time.sleep(0.02)
    store.put(seqs[3], _tensors(seqs[3]), INFO)
    assert [store.contains(s) for s in seqs[:4]] == [True, False, True, True]
    assert store.nbytes() <= store.max_bytes
    time.sleep(0.02)
    store.put(seqs[4], _tensors(seqs[4]), INFO)
    assert [store.contains(s) for s in seqs] == [True, False, False, True, True]
    assert store.lookup(seqs[2] + [5]) == 0  # a pruned entry is not found any more
    # A writer that died mid-entry (no tokens.json) is removed once stale.
    dead = tmp_path / "store" / prompt_key([9, 9, 9])
    dead.mkdir()
    (dead / shard_name(0, 1)).write_bytes(b"\0" * 64)
    old = time.time() - 3600
    os.utime(dead, (old, old))
    store.prune()
    assert not dead.exists()


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing tokens.json", "wrong ids"])
def test_damaged_entries_are_misses_never_kv(tmp_path, damage):
    store = FileKVStore(tmp_path)
    ids = list(range(40))
    store.put(ids, _tensors(ids), INFO)
    entry = tmp_path / prompt_key(ids)
    shard = entry / shard_name(0, 1)
    data = bytearray(shard.read_bytes())
    if damage == "truncated":  # a half-written file (a writer without the rename)
        shard.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "flipped":  # one bit of tensor data
        data[-5] ^= 0x10
        shard.write_bytes(bytes(data))
    elif damage == "missing tokens.json":
        (entry / "tokens.json").unlink()
    else:
        record = json.loads((entry / "tokens.json").read_text())
        record["token_ids"][3] += 1
        (entry / "tokens.json").write_text(json.dumps(record))
    if damage in ("missing tokens.json", "wrong ids"):
        assert store.lookup(ids + [1]) == 0  # never offered to the engine
    assert store.get(ids) is None
    if damage in ("truncated", "flipped", "wrong ids"):
        assert not entry.exists()  # removed: the next request does not try it again
    store.put(ids, _tensors(ids), INFO)  # the engine recomputes and the source stores it again
    torch.testing.assert_close(store.get(ids).shards[0]["key.1"], _tensors(ids)["key.1"])


def _reader(root: str, seqs: list[list[int]], seconds: float, queue) -> None:
    store = FileKVStore(root)
    hits = misses = 0
    bad = []
    end = time.time() + seconds
    while time.time() < end:
        for ids in seqs:
            if store.lookup(ids + [1]) != len(ids):
                misses += 1
                continue
            got = store.get(ids)
            if got is None:
                misses += 1  # pruned between lookup and get: a miss, as it should be
                continue
            hits += 1
            want = _tensors(ids)
            if any(not torch.equal(got.shards[0][k], v) for k, v in want.items()):
                bad.append(ids[0])
    queue.put((hits, misses, bad))


def test_two_consumers_while_a_producer_writes_and_prunes(tmp_path):
    seqs = [[i] + list(range(1, 200)) for i in range(6)]
    probe = FileKVStore(tmp_path / "probe")
    probe.put(seqs[0], _tensors(seqs[0]), INFO)
    store = FileKVStore(tmp_path / "store", max_bytes=3 * probe.nbytes())  # room for 3 of the 6
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    readers = [ctx.Process(target=_reader, args=(str(store.root), seqs, 6.0, queue)) for _ in range(2)]
    for p in readers:
        p.start()
    end = time.time() + 6.0
    while time.time() < end:
        for ids in seqs:
            store.put(ids, _tensors(ids), INFO)
    results = [queue.get(timeout=HANG_GUARD_S) for _ in readers]
    for p in readers:
        p.join(timeout=HANG_GUARD_S)
    for hits, misses, bad in results:
        assert bad == []  # every entry read back is the one asked for, whole
        assert hits > 0
    assert store.nbytes() <= store.max_bytes


# -- LMCache, faked from its documented API only ----------------------------------------------------------------


class _MemoryObj:
    def __init__(self, shape, dtype):
        self.tensor = torch.empty(shape, dtype=dtype)


class FakeLMCacheEngine:
    """What LMCache documents of `LMCacheEngine`: tokens cut into `chunk_size` chunks, each keyed by the hash of the
    prefix up to its end; `store(tokens, **kwargs)` copies each chunk out through the GPU connector's `from_gpu`,
    `retrieve(tokens, **kwargs)` back through `to_gpu` and returns a bool mask of the tokens found; `lookup(tokens)`
    is the length of the stored prefix, in whole chunks. A last partial chunk is not stored (LMCache's
    `save_unfull_chunk` default)."""

    def __init__(self, gpu_connector, chunk_size: int = 16, dtype=torch.float32, max_chunks: int | None = None):
        self.connector, self.chunk_size, self.dtype, self.max_chunks = gpu_connector, chunk_size, dtype, max_chunks
        self.chunks: dict[str, _MemoryObj] = {}

    def _keys(self, tokens: torch.Tensor):
        for start in range(0, len(tokens), self.chunk_size):
            end = min(start + self.chunk_size, len(tokens))
            yield start, end, prompt_key(tokens[:end].tolist())

    def store(self, tokens: torch.Tensor, mask=None, **kwargs) -> None:
        for start, end, key in self._keys(tokens):
            if end - start < self.chunk_size:
                break
            obj = _MemoryObj(self.connector.get_shape(end - start), self.dtype)
            self.connector.from_gpu(obj, start, end, **kwargs)
            self.chunks[key] = obj
            if self.max_chunks is not None and len(self.chunks) > self.max_chunks:
                self.chunks.pop(next(iter(self.chunks)))  # evict the oldest

    def retrieve(self, tokens: torch.Tensor, mask=None, **kwargs) -> torch.Tensor:
        found = torch.zeros(len(tokens), dtype=torch.bool)
        for start, end, key in self._keys(tokens):
            obj = self.chunks.get(key)
            if obj is None:
                break
            self.connector.to_gpu(obj, start, end, **kwargs)
            found[start:end] = True
        return found

    def lookup(self, tokens: torch.Tensor, search_range=None, pin: bool = False) -> int:
        hit = 0
        for _, end, key in self._keys(tokens):
            if key not in self.chunks:
                break
            hit = end
        return hit


def _lmcache_store(**engine_kwargs):
    connector = LMCacheKVStore.gpu_connector(LAYERS, HEADS * DIM)
    engine = FakeLMCacheEngine(connector, **engine_kwargs)
    return LMCacheKVStore(engine, LAYERS, HEADS, DIM, torch.float32, INFO), engine


def test_lmcache_store_round_trip_through_the_documented_api():
    store, _ = _lmcache_store()
    assert isinstance(store, KVStore)
    ids = list(range(100, 148))  # 3 chunks of 16
    store.put(ids, _tensors(ids), INFO)
    assert store.contains(ids) and store.lookup(ids + [5, 6]) == 48
    assert store.lookup(ids[:40]) == 32 and store.lookup(ids[:20] + [0] * 30) == 16  # prefixes in whole chunks
    got = store.get(ids)
    assert got.info["kv_shape"] == INFO["kv_shape"]
    for name, tensor in _tensors(ids).items():
        torch.testing.assert_close(got.shards[0][name], tensor)
    torch.testing.assert_close(store.get(ids[:32]).shards[0]["key.2"], _tensors(ids[:32])["key.2"])
    assert store.get(ids[:40]) is None  # its last 8 tokens are not a stored chunk
    odd = list(range(500, 540))  # 2.5 chunks: the last half chunk is not stored
    store.put(odd, _tensors(odd), INFO)
    assert store.lookup(odd) == 32 and not store.contains(odd)


@pytest.mark.vllm
def test_real_lmcache_engine_when_installed():
    """The same through LMCache's own engine (CPU memory backend), where LMCache is installed: the vLLM environment
    (`.ci/vllm` installs it there; marked `vllm` so it runs there)."""
    pytest.importorskip("lmcache.v1.cache_engine", reason="LMCache is not installed")
    from hf_kvtransfer.integrations.kv_store import build_lmcache_store

    store = build_lmcache_store("test-real", LAYERS, HEADS, DIM, {"chunk_size": 16, "max_local_cpu_size": 0.05})
    ids = list(range(300, 348))
    store.put(ids, _tensors(ids), INFO)
    assert store.lookup(ids + [1]) == 48 and store.lookup(ids[:40]) == 32
    for name, tensor in _tensors(ids).items():
        torch.testing.assert_close(store.get(ids).shards[0][name], tensor)
    assert store.get(list(range(900, 948))) is None
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    LMCacheEngineBuilder.destroy("hf-kvtransfer-test-real")  # now, not at exit (after pytest closed its streams)


def test_lmcache_store_evicted_chunk_is_a_miss():
    store, engine = _lmcache_store(max_chunks=4)
    a, b = list(range(0, 48)), list(range(1000, 1032))  # 3 chunks, then 2: the first of a is evicted
    store.put(a, _tensors(a), INFO)
    store.put(b, _tensors(b), INFO)
    assert store.lookup(a) == 0 and store.get(a) is None
    torch.testing.assert_close(store.get(b).shards[0]["value.2"], _tensors(b)["value.2"])
    with pytest.raises(NotImplementedError, match="FileKVStore"):
        store.put(a, _tensors(a), INFO, rank=0, world_size=2)
