"""What the vLLM connector did with each request, told to the caller, and the prefix-cache namespace of transferred
requests. Imports no vLLM: the connector (`vllm_connector`) fills these records and returns them.

Every request a target engine serves gets one status, returned in the request output's `kv_transfer_params` under
`"hf_kvtransfer"`:

- `applied`: the target's KV of a stored prefix was built by the mapper (its exact layers computed, the rest mapped)
  or read back from an earlier transfer through the prefix cache; the record names the mapper, its revision, the
  exact layers and how many prompt tokens were mapped, reused and computed by the engine;
- `fallback`: the engine prefilled the prompt itself, and `reason` says why (no stored prefix, a store entry
  missing or failing its checksum at load time, a mapper that maps no layer, the request turned the transfer off);
- `unsupported`: a request the connector does not transfer (a LoRA adapter, multimodal inputs, prompt
  embeddings, prompt log-probabilities); the engine prefills it itself;
- `failed`: a store entry could not be loaded and vLLM's `kv_load_failure_policy` is `"fail"`: vLLM fails the
  request (its output ends with finish reason `error`; the reason is in the engine's log).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import asdict, dataclass

from ..core.status import APPLIED, FAILED, FALLBACK, UNSUPPORTED

NO_STORED_PREFIX = "no stored prefix"
PREFIX_GONE = "the stored prefix was removed before the request was scheduled"
TOO_SHORT = "the stored prefix is no longer than the tokens the target recomputes"
ENTRY_MISSING = "store entry missing at load time; the engine computed those tokens"
ENTRY_CORRUPTED = "store entry failed its checksum at load time (removed); the engine computed those tokens"
MAPPER_MAPS_NOTHING = "the mapper computes every target layer exactly, so a transfer saves nothing"
TURNED_OFF = "the request turned the transfer off (kv_transfer_params={'hf_kvtransfer': {'transfer': False}})"
LOAD_FAILED_POLICY_FAIL = ("its transfer was not used (its store entry could not be loaded, or the quality gate "
                           "turned it down) and kv_load_failure_policy='fail'")
QUALITY_GATE = ("quality gate: the mapper's prediction of the tokens the engine computed scored below the mapper's "
                "threshold; the engine computed the prompt itself")


@dataclass
class RequestTransfer:
    """One request's transfer as the target engine's scheduler sees it; `as_params()` is what the caller gets.

    Token counts are of the prompt: `matched_tokens` stored, `mapped_tokens` written by the connector (exact layers
    computed, the others mapped), `reused_tokens` read from the prefix cache (blocks an earlier transfer of the
    same prefix wrote or computed on top of its mapped KV), `recomputed_tokens` prefilled by the engine itself.
    """

    status: str
    reason: str | None = None
    matched_tokens: int = 0
    mapped_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    gate_score: float | None = None  # with a quality gate: its score and threshold
    gate_threshold: float | None = None

    def fall_back(self, reason: str) -> None:
        self.status, self.reason = FALLBACK, reason
        self.recomputed_tokens += self.mapped_tokens + self.reused_tokens
        self.mapped_tokens = self.reused_tokens = 0

    def as_params(self, mapper: dict) -> dict:
        """The caller's record: status, reason and token counts, and for `applied` the mapper's identity."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if self.status == APPLIED:
            out.update(mapper)
        return out

    @property
    def counter_key(self) -> str:
        return self.status if self.reason is None else f"{self.status}: {self.reason}"


class StatusCounts(Counter):
    """Requests by status, and by `status: reason` for the ones with a reason."""

    def add(self, record: RequestTransfer) -> None:
        self[record.status] += 1
        if record.reason is not None:
            self[record.counter_key] += 1


def transfer_salt(mapper_id: str, mapper_revision: str | None, num_exact_layers: int,
                  num_recompute_tokens: int | None) -> str:  # fmt: skip
    """The prefix-cache namespace of the requests a connector transfers: a name of what their KV depends on."""
    key = json.dumps([mapper_id, mapper_revision, num_exact_layers, num_recompute_tokens])
    return "hf-kvtransfer:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def salted(user_salt: str | None, namespace: str) -> str:
    """A request's cache salt once transferred: the caller's own salt (tenant isolation) kept in front."""
    return namespace if not user_salt else f"{user_salt}|{namespace}"


def unsupported_reason(request) -> str | None:
    """Why the connector does not transfer `request` (a vLLM `Request`), or None."""
    if getattr(request, "lora_request", None) is not None:
        return "a LoRA adapter (the exact layers and the mapper are of the base model)"
    if getattr(request, "mm_features", None):
        return "multimodal inputs (the store is keyed by token ids only)"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings (no token ids to key the store)"
    if getattr(request, "skip_reading_prefix_cache", False):
        return "a request that skips cached KV (vLLM's default for prompt_logprobs)"
    return None


def transfer_requested(kv_transfer_params: dict | None) -> bool:
    """False when the request's `kv_transfer_params` turn the transfer off: `{"hf_kvtransfer": {"transfer": False}}`."""
    ours = (kv_transfer_params or {}).get("hf_kvtransfer")
    return not (isinstance(ours, dict) and ours.get("transfer") is False)


__all__ = ["APPLIED", "FAILED", "FALLBACK", "UNSUPPORTED", "RequestTransfer", "StatusCounts", "salted",
           "transfer_requested", "transfer_salt", "unsupported_reason"]  # fmt: skip
