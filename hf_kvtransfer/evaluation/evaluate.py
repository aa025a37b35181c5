"""Does the target still do what it would have done with its own prefill? Retention, diagnostics, drift.

Every score is reported three ways, side by side (the docs' evaluation protocol):

- **target**: the target model with its own prefill of the context (the ceiling),
- **transfer**: the context prefilled by the source and mapped into the target's cache,
- **floor**: the target without the context (perplexity), or chance (multiple choice),

with `retention = transfer / target` and `normalized_retention = (transfer - floor) / (target - floor)`,
the share of what the context is worth to the target that survives the transfer. Perplexity scores are
compared in log space (mean negative log-likelihood per token, lower is better), so the normalized
retention of perplexity is `(nll_floor - nll_transfer) / (nll_floor - nll_target)`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from ..core.cache import TransferredCache
from ..core.defaults import resolve_num_recompute_tokens
from ..core.journal import ResultJournal, model_identity
from ..core.capture import cache_argument, capture_kv, prefill, stripped_kv
from ..core.loading import model_device
from ..core.map_inputs import exact_layers_needed
from ..core.mapper import KVMapper
from ..core.options import with_options
from ..core.progress import progress_bar
from .content import greedy_agreement, handoff, passage_recall, recall_by_depth, repeated_span_retention
from .metrics import REFEED_WARNING, bootstrap_ci, normalized_retention
from .multiple_choice import MultipleChoiceItem, build_continuation_task, multiple_choice
from .tasks import NEEDLE_POSITIONS, handoff_items, needle_grid, passage_recall_items, repeated_span_items

logger = logging.getLogger(__name__)

__all__ = [
    "EVAL_TASKS",
    "eval_journal",
    "evaluate",
    "kv_r2",
    "multi_turn_drift",
    "prefix_perplexity",
    "resolve_tasks",
    "split_documents",
    "text_windows",
]

def _attention_modules(model: PreTrainedModel) -> list[nn.Module]:
    body = getattr(model, "base_model", model)
    layers = getattr(body, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError(
            f"cannot find `layers[i].self_attn` in {type(model).__name__}; attention-output cosine needs a "
            "transformers decoder with the usual module names"
        )
    return [layer.self_attn for layer in layers]


class _AttentionRecorder:
    """Forward hooks that keep each attention module's output `[batch, seq, hidden]` of the last call."""

    def __init__(self, model: PreTrainedModel):
        self.outputs: list[torch.Tensor | None] = []
        self._handles = []
        for idx, module in enumerate(_attention_modules(model)):
            self.outputs.append(None)
            self._handles.append(module.register_forward_hook(self._hook(idx)))

    def _hook(self, idx: int) -> Callable:
        def hook(module, args, output):
            self.outputs[idx] = (output[0] if isinstance(output, tuple) else output).detach().float()

        return hook

    def take(self) -> list[torch.Tensor]:
        out, self.outputs = self.outputs, [None] * len(self.outputs)
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


# -- text -> token windows -------------------------------------------------------------------------------


def split_documents(text: str, separator: str | None = "<|endoftext|>") -> list[str]:
    """Split a text file into documents at lines holding only `separator` (the bundled family's format).

    Without a separator line the whole text is one document.
    """
    if separator:
        docs = [d.strip("\n") for d in text.split(f"\n{separator}\n")]
        docs = [d for d in docs if d.strip()]
        if docs:
            return docs
    return [text] if text.strip() else []


def _tokenize_documents(tokenizer, documents: Sequence[str]) -> list[list[int]]:
    return [tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"] for doc in documents]


def text_windows(token_docs: Sequence[Sequence[int]], window: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping `window`-token windows from each document (no window crosses a document boundary).

    Returns:
        `[num_windows, window]` token ids; with `max_windows`, an evenly spaced subset (deterministic).
    """
    rows = [doc[i : i + window] for doc in token_docs for i in range(0, len(doc) - window + 1, window)]
    if not rows:
        longest = max((len(d) for d in token_docs), default=0)
        raise ValueError(
            f"no document has {window} tokens (longest: {longest}); use a longer text or a smaller --prefix-len"
        )
    if max_windows is not None and len(rows) > max_windows:
        keep = np.linspace(0, len(rows) - 1, max_windows).round().astype(int)
        rows = [rows[i] for i in keep]
    return torch.tensor(rows, dtype=torch.long)


# -- prefix-conditioned perplexity -----------------------------------------------------------------------


@torch.no_grad()
def prefix_perplexity(
    source: PreTrainedModel,
    target: PreTrainedModel,
    mapper: KVMapper,
    input_ids: torch.Tensor,
    prefix_len: int | None = None,
    num_recompute_tokens: int | None = None,
    batch_size: int = 8,
    diagnostics: bool = True,
    num_bootstrap: int = 1000,
    seed: int = 0,
    progress: bool = True,
    num_exact_layers: int | None = None,
) -> dict[str, Any]:
    """Prefix-conditioned perplexity (the paper's WikiText-2 protocol) and the diagnostics on the same tokens.

    Each row of `input_ids` is a window of `2 * prefix_len` tokens. The second half is scored by the target
    (tokens `prefix_len + 1 ..` end, each given everything before it) on top of a cache of the first half:

    - `target`: the target's own prefill of the prefix,
    - `transfer`: the source's prefill mapped by `mapper` (`TransferredCache`),
    - `floor`: no prefix at all (the second half alone).

    All three feed the target the same tokens and score the same positions, so they differ only in the cache.

    Args:
        input_ids: `[num_windows, 2 * prefix_len]` token ids (see `text_windows`).
        prefix_len: prefix length T (default: half the window).
        num_recompute_tokens: the last W prefix tokens are recomputed by the target instead of transferred
            (default: `TransferredCache`'s, 32 or half a shorter prefix; 0: the whole prefix is transferred).
        num_exact_layers: the target's first layers computed by the target itself (default: the mapper's, as in
            `TransferredCache`); 0 measures the mapper alone.
        diagnostics: also compute logit KL / top-1 agreement against the target's own prefill and the
            per-layer cosine of the target's attention outputs (mapped vs. own KV).
        num_bootstrap: resamples over windows for the 95% confidence intervals.

    Returns:
        A dict with `nll` / `perplexity` per setting, `retention`, `normalized_retention` and their `*_ci`,
        and with diagnostics `logit_kl`, `top1_agreement`, `attention_cosine` (one value per target layer).
    """
    t, r = _prefix_and_recompute(input_ids, prefix_len, num_recompute_tokens, mapper, num_exact_layers)
    run = _PerplexityRun(source, target, mapper, t, r, num_exact_layers)
    per_window, sums = run.score(input_ids, batch_size, diagnostics, progress)
    num_windows, window = input_ids.shape
    result: dict[str, Any] = {
        "num_windows": num_windows,
        "prefix_len": t,
        "scored_tokens_per_window": window - t - 1,
        "num_recompute_tokens": r,
        "num_exact_layers": mapper.resolve_num_exact_layers(num_exact_layers),
        "nll": {name: float(v.mean()) for name, v in per_window.items()},
        "perplexity": {name: float(np.exp(v.mean())) for name, v in per_window.items()},
        # per window, for paired comparisons of settings on the same windows
        "nll_per_window": {name: v.tolist() for name, v in per_window.items()},
    }
    result.update(_perplexity_retention(per_window, num_bootstrap, seed))
    if sums is not None:
        result.update(sums.result(num_windows * (window - t)))
    return result


def _prefix_and_recompute(
    input_ids: torch.Tensor, prefix_len: int | None, num_recompute_tokens: int | None, mapper: KVMapper,
    num_exact_layers: int | None,
) -> tuple[int, int]:
    """`(prefix_len, num_recompute_tokens)` of `prefix_perplexity`'s windows, defaults resolved; raises on windows
    or values it cannot score."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [num_windows, 2 * prefix_len], got shape {list(input_ids.shape)}")
    window = input_ids.shape[1]
    prefix_len = prefix_len if prefix_len is not None else window // 2
    if not 1 <= prefix_len <= window - 2:
        raise ValueError(f"prefix_len must leave >= 2 tokens to score in a {window}-token window, got {prefix_len}")
    num_recompute_tokens = resolve_num_recompute_tokens(num_recompute_tokens, prefix_len, mapper, num_exact_layers)
    if not 0 <= num_recompute_tokens < prefix_len:
        raise ValueError(f"num_recompute_tokens must be in [0, {prefix_len}), got {num_recompute_tokens}")
    return prefix_len, num_recompute_tokens


class _Diagnostics:
    """The diagnostics of `prefix_perplexity`, summed over batches: logit KL and top-1 agreement of the transfer
    against the target's own prefill, and the per-layer cosine of the target's attention outputs."""

    def __init__(self):
        self.kl_sum, self.agree_sum, self.num_tokens = 0.0, 0.0, 0
        self.cos_sum: torch.Tensor | None = None

    def add(self, own_logits: torch.Tensor, trans_logits: torch.Tensor, own_attn, trans_attn, r: int, num_labels: int):
        own_logp, trans_logp = own_logits.log_softmax(-1), trans_logits.log_softmax(-1)
        self.kl_sum += float((own_logp.exp() * (own_logp - trans_logp)).sum(-1).sum())
        self.agree_sum += float((own_logits.argmax(-1) == trans_logits.argmax(-1)).sum())
        self.num_tokens += num_labels
        # Cosine per token over the fed positions, summed per layer.
        cos = torch.stack(
            [F.cosine_similarity(a[:, r:], b[:, r:], dim=-1).sum() for a, b in zip(own_attn, trans_attn)]
        ).double().cpu()
        self.cos_sum = cos if self.cos_sum is None else self.cos_sum + cos

    def result(self, num_positions: int) -> dict[str, Any]:
        """`logit_kl`, `top1_agreement` (per scored token) and `attention_cosine` (over `num_positions` fed ones)."""
        return {
            "logit_kl": self.kl_sum / self.num_tokens,
            "top1_agreement": self.agree_sum / self.num_tokens,
            "attention_cosine": (self.cos_sum / num_positions).tolist(),
        }


@dataclass(frozen=True)
class _PerplexityRun:
    """`prefix_perplexity` on windows with a prefix of `t` tokens, the last `r` of them recomputed by the target."""

    source: PreTrainedModel
    target: PreTrainedModel
    mapper: KVMapper
    t: int
    r: int
    num_exact_layers: int | None

    def score(
        self, input_ids: torch.Tensor, batch_size: int, diagnostics: bool, progress: bool
    ) -> tuple[dict[str, np.ndarray], _Diagnostics | None]:
        """Mean NLL per window of each setting (`target`, `transfer`, `floor`), and the diagnostics if asked for."""
        nll = {"target": [], "transfer": [], "floor": []}
        sums = _Diagnostics() if diagnostics else None
        recorder = _AttentionRecorder(self.target) if diagnostics else None
        bar = progress_bar(total=input_ids.shape[0], desc="prefix perplexity", unit="window", enabled=progress)
        try:
            for start in range(0, input_ids.shape[0], batch_size):
                ids = input_ids[start : start + batch_size].to(model_device(self.target))
                logits, attention = self.logits(ids, recorder)
                labels = ids[:, self.t + 1 :]
                for name, value in logits.items():
                    token_nll = F.cross_entropy(value.transpose(1, 2), labels, reduction="none")  # (B, T-1)
                    nll[name].append(token_nll.mean(-1).double().cpu())
                if sums is not None:
                    sums.add(logits["target"], logits["transfer"], *attention, self.r, labels.numel())
                bar.update(ids.shape[0])
        finally:
            bar.close()
            if recorder:
                recorder.remove()
        return {name: torch.cat(v).numpy() for name, v in nll.items()}, sums

    def logits(self, ids: torch.Tensor, recorder: _AttentionRecorder | None) -> tuple[dict[str, torch.Tensor], tuple]:
        """The target's logits at the scored positions of a batch of windows in each setting, and its attention
        outputs `(own, transfer)` (None without `recorder`)."""
        target, t, r = self.target, self.t, self.r
        feed = ids[:, t - r :]
        # Feed position r + j predicts token t + j + 1.
        own_cache = prefill(target, ids[:, : t - r]) if t - r > 0 else DynamicCache()
        own_logits = target(feed, use_cache=True, **{cache_argument(target): own_cache}).logits[:, r:-1].float()
        own_attn = recorder.take() if recorder else None

        src_cache = prefill(self.source, ids[:, :t].to(model_device(self.source)))
        cache = TransferredCache(
            src_cache, self.mapper, num_recompute_tokens=r, num_exact_layers=self.num_exact_layers, model=target
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=REFEED_WARNING)
            trans_logits = target(feed, use_cache=True, **{cache_argument(target): cache}).logits[:, r:-1].float()
        trans_attn = recorder.take() if recorder else None

        floor_logits = target(ids[:, t:], use_cache=False).logits[:, :-1].float()
        if recorder:
            recorder.take()
        return {"target": own_logits, "transfer": trans_logits, "floor": floor_logits}, (own_attn, trans_attn)


def _perplexity_retention(per_window: dict[str, np.ndarray], num_bootstrap: int, seed: int) -> dict[str, Any]:
    own, trans, floor = per_window["target"], per_window["transfer"], per_window["floor"]

    def retention(idx):
        # Scores are 1 / perplexity: the ratio of perplexities, target over transfer.
        return float(np.exp(own[idx].mean() - trans[idx].mean()))

    def normalized(idx):
        return normalized_retention(-trans[idx].mean(), -own[idx].mean(), -floor[idx].mean())

    every = np.arange(len(own))
    if own.mean() >= floor.mean():
        logger.warning(
            "the target's own prefix does not lower its loss (nll %.4f with prefix vs %.4f without): floor-normalized "
            "retention is undefined; use longer windows or a model that uses its context",
            own.mean(),
            floor.mean(),
        )
    return {
        "context_gain_nats": float(floor.mean() - own.mean()),
        "retention": retention(every),
        "retention_ci": bootstrap_ci(retention, len(own), num_bootstrap, seed),
        "normalized_retention": normalized(every),
        "normalized_retention_ci": bootstrap_ci(normalized, len(own), num_bootstrap, seed),
    }


# -- K/V R^2 on evaluation tokens ------------------------------------------------------------------------


@torch.no_grad()
def kv_r2(
    source: PreTrainedModel,
    target: PreTrainedModel,
    mapper: KVMapper,
    input_ids: torch.Tensor,
    batch_size: int = 8,
    progress: bool = True,
) -> dict[str, list[float]]:
    """Out-of-sample R^2 of the transferred (RoPE-stripped) keys and values against the target's own, per layer.

    The transferred ones are what `TransferredCache` holds once it has converted the prompt (all of it but the last
    token, which a transfer leaves to the target), with the fewest exact layers the maps can run with: every layer's
    map for maps of the source's K/V alone (also the layers a transfer computes itself), and for maps that read what
    exact layers compute (the target's residual stream) those layers the target's own. Head-averaged like the fit
    R^2 in the mapper config.

    Returns:
        `{"key": [L_t], "value": [L_t]}`.
    """
    tgt = mapper.target_layout
    fewest = exact_layers_needed(mapper.config)[0]
    sums: dict[str, dict[str, torch.Tensor]] = {}
    count = 0
    bar = progress_bar(total=input_ids.shape[0], desc="K/V R^2", unit="window", enabled=progress)
    for start in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[start : start + batch_size]
        cache = TransferredCache(prefill(source, ids), mapper, num_recompute_tokens=1, num_exact_layers=fewest,
                                 model=target, gate=False).convert_all()  # fmt: skip
        mapped = stripped_kv(target, cache)
        own = capture_kv(target, ids.to(model_device(target)))
        held = mapped[0][0].shape[2]
        count += ids.shape[0] * held
        for t in range(tgt.num_layers):
            for kind, pred, true in (("key", mapped[0][t], own[0][t]), ("value", mapped[1][t], own[1][t])):
                y = true[:, :, :held].transpose(1, 2).flatten(0, 1).flatten(1).double().cpu()  # (N, H*D)
                p = pred.transpose(1, 2).flatten(0, 1).flatten(1).double().cpu()
                acc = sums.setdefault(f"{kind}{t}", {"sse": 0, "sy": 0, "syy": 0})
                acc["sse"] = acc["sse"] + ((y - p) ** 2).sum(0)
                acc["sy"] = acc["sy"] + y.sum(0)
                acc["syy"] = acc["syy"] + (y * y).sum(0)
        bar.update(ids.shape[0])
    bar.close()
    out: dict[str, list[float]] = {"key": [], "value": []}
    for kind in out:
        for t in range(tgt.num_layers):
            acc = sums[f"{kind}{t}"]
            sst = (acc["syy"] - acc["sy"] ** 2 / count).reshape(tgt.num_kv_heads, -1).sum(-1)
            sse = acc["sse"].reshape(tgt.num_kv_heads, -1).sum(-1)
            out[kind].append(float(torch.where(sst > 0, 1 - sse / sst.clamp_min(1e-30), torch.ones_like(sst)).mean()))
    return out


# -- multi-turn handoff ----------------------------------------------------------------------------------


@torch.no_grad()
def multi_turn_drift(
    source: PreTrainedModel,
    target: PreTrainedModel,
    mapper: KVMapper,
    reverse_mapper: KVMapper,
    input_ids: torch.Tensor,
    num_turns: int = 4,
    first: str = "source",
    batch_size: int = 8,
    progress: bool = True,
) -> dict[str, Any]:
    """Alternate source and target turn by turn, carrying one cache across every switch, and measure drift.

    The token stream of each row is cut into `num_turns` equal turns. Turn 0 is read by `first`, turn 1 by the
    other model, and so on; at each switch the whole cache so far (the other model's own turns and what was
    mapped into it before) is mapped into the next model's cache (`mapper`: source -> target,
    `reverse_mapper`: target -> source), so errors can accumulate. Each turn's logits are compared with those
    of the same model reading the whole conversation itself (its standalone prefill).

    Returns:
        `{"turns": [{"turn", "model", "logit_kl", "top1_agreement", "nll", "nll_standalone"}, ...]}`.
    """
    if first not in ("source", "target"):
        raise ValueError(f"first must be 'source' or 'target', got {first!r}")
    num_rows, length = input_ids.shape
    turn_len = length // num_turns
    if num_turns < 2 or turn_len < 2:
        raise ValueError(f"need >= 2 turns of >= 2 tokens, got {num_turns} turns from {length} tokens")
    models = {"source": source, "target": target}
    mappers = {("source", "target"): mapper, ("target", "source"): reverse_mapper}
    roles = [first if i % 2 == 0 else ("target" if first == "source" else "source") for i in range(num_turns)]
    sums = [{"kl": 0.0, "agree": 0.0, "nll": 0.0, "nll_standalone": 0.0, "tokens": 0} for _ in range(num_turns)]
    bar = progress_bar(total=num_rows, desc="multi-turn", unit="conversation", enabled=progress)
    for start in range(0, num_rows, batch_size):
        ids = input_ids[start : start + batch_size, : turn_len * num_turns]
        _conversation_turns(models, mappers, roles, ids, turn_len, sums)
        bar.update(ids.shape[0])
    bar.close()
    turns = [
        {
            "turn": i,
            "model": roles[i],
            "logit_kl": s["kl"] / s["tokens"],
            "top1_agreement": s["agree"] / s["tokens"],
            "nll": s["nll"] / s["scored"],
            "nll_standalone": s["nll_standalone"] / s["scored"],
        }
        for i, s in enumerate(sums)
    ]
    return {"num_conversations": num_rows, "num_turns": num_turns, "turn_len": turn_len, "turns": turns}


def _conversation_turns(
    models: dict[str, PreTrainedModel], mappers: dict[tuple[str, str], KVMapper], roles: list[str], ids: torch.Tensor,
    turn_len: int, sums: list[dict[str, float]],
) -> None:
    """A batch of conversations, turn `i` read by `models[roles[i]]` on the cache carried over (mapped at each
    switch): each turn's scores against the model's standalone prefill added to `sums[i]`."""
    # Standalone: each model over the whole conversation; causal, so its slice for turn i is what it
    # would compute with its own prefill of turns 0..i-1.
    standalone = {
        role: model(ids.to(model_device(model)), use_cache=False).logits.float().cpu()
        for role, model in models.items()
        if role in roles
    }
    cache, prev = DynamicCache(), None
    for i, role in enumerate(roles):
        model = models[role]
        if prev is not None and prev != role:
            # the conversation so far, so the new model computes its exact layers from the ids
            cache = TransferredCache(
                cache, mappers[(prev, role)], num_recompute_tokens=0,
                input_ids=ids[:, : i * turn_len].to(model_device(model)), model=model,
            )
        chunk = ids[:, i * turn_len : (i + 1) * turn_len].to(model_device(model))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=REFEED_WARNING)
            logits = model(chunk, use_cache=True, **{cache_argument(model): cache}).logits.float().cpu()
        # Next-token loss inside the turn (the last position's label is the next turn's first token).
        labels = ids[:, i * turn_len + 1 : (i + 1) * turn_len + 1]
        _add_turn_scores(sums[i], logits, standalone[role][:, i * turn_len : (i + 1) * turn_len], labels)
        sums[i]["tokens"] += chunk.numel()
        prev = role


def _add_turn_scores(sums: dict[str, float], logits: torch.Tensor, ref: torch.Tensor, labels: torch.Tensor) -> None:
    """Adds a turn's logit KL and top-1 agreement against the standalone logits `ref`, and both next-token losses."""
    logp, ref_logp = logits.log_softmax(-1), ref.log_softmax(-1)
    sums["kl"] += float((ref_logp.exp() * (ref_logp - logp)).sum(-1).sum())
    sums["agree"] += float((logits.argmax(-1) == ref.argmax(-1)).sum())
    width = labels.shape[1]
    sums["nll"] += float(F.cross_entropy(logits[:, :width].transpose(1, 2), labels, reduction="sum"))
    sums["nll_standalone"] += float(F.cross_entropy(ref[:, :width].transpose(1, 2), labels, reduction="sum"))
    sums["scored"] = sums.get("scored", 0) + labels.numel()


# -- everything at once ----------------------------------------------------------------------------------

# The tasks `evaluate` runs, by name (`--tasks` of `hf-kvtransfer eval`). multiple-choice and multi-turn need their
# inputs (a task file, a reverse mapper); the rest are built from the evaluation text. depth (passage recall over
# context lengths x needle positions) runs only when asked for: it scores a grid of cells.
EVAL_TASKS = ("perplexity", "continuation", "repeat", "recall", "handoff", "agreement", "depth", "multiple-choice",
              "multi-turn")
_ASKED_ONLY = ("depth",)


def resolve_tasks(
    tasks: Sequence[str] | str | None,
    *,
    multiple_choice: bool = False,
    multi_turn: bool = False,
    continuation: bool = True,
) -> list[str]:
    """The tasks `evaluate` runs: `tasks` checked (names of `EVAL_TASKS`, a list or a comma-separated string), or
    by default every task that applies (multiple-choice with a task file, multi-turn with a reverse mapper, the
    continuation task unless `continuation=False`; depth only when asked for).

    Raises:
        ValueError: an unknown name, or multiple-choice / multi-turn asked for without their input.
    """
    if tasks is None:
        return [
            t for t in EVAL_TASKS
            if t not in _ASKED_ONLY and (t != "multiple-choice" or multiple_choice) and (t != "multi-turn" or multi_turn)
            and (t != "continuation" or continuation)
        ]  # fmt: skip
    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else [str(t).strip() for t in tasks]
    names = [t for t in names if t]
    unknown = [t for t in names if t not in EVAL_TASKS]
    if unknown or not names:
        raise ValueError(f"unknown task(s) {', '.join(map(repr, unknown)) or '(none given)'}; choose from {', '.join(EVAL_TASKS)}")
    if "multiple-choice" in names and not multiple_choice:
        raise ValueError("the multiple-choice task needs a task file (--mc FILE / multiple_choice_items)")
    if "multi-turn" in names and not multi_turn:
        raise ValueError("the multi-turn task needs a target -> source mapper (--reverse-mapper / reverse_mapper)")
    return [t for t in EVAL_TASKS if t in names]  # one order, whatever order they were asked in


def _content_items(tokenizer, documents: list[str], token_docs: list[list[int]], tasks: list[str],
                   cfg: EvalConfig) -> dict[str, Any]:
    """The items of the content tasks asked for, all built before any model runs: a text or tokenizer they cannot
    be built from fails at once."""
    items: dict[str, Any] = {}
    num_items, prefix_len, seed = cfg.num_content_items, cfg.prefix_len, cfg.seed
    if "repeat" in tasks:
        eos = getattr(tokenizer, "eos_token_id", None)
        stream = [t for doc in token_docs for t in list(doc) + ([eos] if eos is not None else [])]
        items["repeat"] = repeated_span_items(tokenizer, stream, num_items, seed=seed, prefix_len=prefix_len)
    try:
        if "recall" in tasks:
            items["recall"] = passage_recall_items(tokenizer, num_items, seed=seed, distractor_texts=documents)
        if "handoff" in tasks:
            items["handoff"] = handoff_items(tokenizer, num_items, seed=seed, distractor_texts=documents)
    except ValueError as exc:
        raise ValueError(
            f"the recall and handoff items cannot be built with this tokenizer: {exc}; leave those tasks out "
            "with --tasks (e.g. --tasks perplexity,continuation,repeat,agreement)"
        ) from exc
    if "agreement" in tasks:
        items["agreement"] = text_windows(token_docs, prefix_len, num_items)
    if "depth" in tasks:
        items["depth"] = needle_grid(tokenizer, cfg.depth_lengths, tuple(NEEDLE_POSITIONS), cfg.depth_items, seed,
                                     distractor_texts=documents)  # fmt: skip
    return items


@dataclass(frozen=True)
class EvalConfig:
    """The options of `evaluate` (each one also accepted as a keyword of `evaluate`).

    Attributes:
        tasks: names from `EVAL_TASKS` (a list or "recall,handoff"); default: every task that applies
            (`resolve_tasks`).
        prefix_len: T of the prefix-conditioned perplexity (windows of 2T tokens), also the prefix of the
            repeated-span items and the prompt length of the greedy-agreement prompts.
        max_windows: cap on perplexity windows (evenly spaced).
        num_recompute_tokens: context tokens the target recomputes in every transfer (default: `TransferredCache`'s,
            32 or half a shorter context; recall, agreement and the choice tasks: at least 1, the target must be fed
            the prompt's last token).
        num_exact_layers: the target's first layers it computes itself in every transfer (default: the mapper's,
            as in `TransferredCache`).
        continuation: build and score the continuation task from `text` (when `tasks` is None).
        context_len, continuation_len, num_choices, num_items: the continuation task's items.
        num_content_items: items of each content task (repeat, recall, handoff, agreement prompts); the
            recall and hand-off distractors are cut from the documents of `text`.
        max_new_tokens: tokens generated per prompt by the greedy-agreement task.
        depth_lengths: context lengths of the depth task (recall with the passage at the start, middle and end).
        depth_items: items per cell of the depth task (the same facts in every cell).
        num_turns, turn_len, max_conversations: the multi-turn handoff's conversations.
        batch_size, num_bootstrap, seed, progress: batching, bootstrap resamples, seed and progress bars.
    """

    tasks: Sequence[str] | str | None = None
    prefix_len: int = 128
    max_windows: int | None = 256
    num_recompute_tokens: int | None = None
    num_exact_layers: int | None = None
    continuation: bool = True
    context_len: int = 128
    continuation_len: int = 16
    num_choices: int = 4
    num_items: int = 200
    num_content_items: int = 600
    max_new_tokens: int = 16
    depth_lengths: Sequence[int] = (512, 1024)
    depth_items: int = 100
    num_turns: int = 4
    turn_len: int = 64
    max_conversations: int = 32
    batch_size: int = 8
    num_bootstrap: int = 1000
    seed: int = 0
    progress: bool = True


def evaluate(
    source: PreTrainedModel,
    target: PreTrainedModel,
    mapper: KVMapper,
    tokenizer,
    text: str,
    config: EvalConfig | None = None,
    *,
    multiple_choice_items: Sequence[MultipleChoiceItem] | None = None,
    reverse_mapper: KVMapper | None = None,
    journal: ResultJournal | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Run the evaluation suite for one (source, target, mapper) on a text: perplexity, tasks, diagnostics.

    Args:
        tokenizer: the family's tokenizer (source and target share it).
        text: evaluation text, documents separated by lines holding only the tokenizer's EOS token (the
            bundled family's `heldout.txt`); otherwise one document.
        config: the options (`EvalConfig`); any of its fields may be given as a keyword instead (`tasks=...`).
        multiple_choice_items: a task to score too (e.g. `load_multiple_choice("hellaswag.jsonl", tok)`).
        reverse_mapper: a target -> source mapper; enables the multi-turn handoff.
        journal: keeps each finished task's results on disk (`eval_journal`): a task this journal holds for the same
            models, mapper, text and options is read back instead of run again, so an interrupted run resumes.
            Its results are then as JSON gives them back (lists, not tuples), read back or not.

    Returns:
        A JSON-serializable dict: `prefix_perplexity`, `kv_r2`, `continuation`, `multiple_choice`, `multi_turn`,
        `repeated_span`, `passage_recall`, `handoff`, `greedy_agreement`, `recall_by_depth` (those run) and a
        `config` block;
        `reporting.evaluation_markdown` / `plot_evaluation` render it.

    Example:
        ```python
        results = evaluate(small, large, mapper, tokenizer, open("heldout.txt").read(), tasks="perplexity,recall")
        print(evaluation_markdown(results))
        ```
    """
    cfg = with_options(EvalConfig, config, options, "evaluate")
    selected = _selected_tasks(cfg, multiple_choice_items, reverse_mapper)
    documents = split_documents(text, getattr(tokenizer, "eos_token", None))
    docs = _tokenize_documents(tokenizer, documents)
    results: dict[str, Any] = {"config": _config_block(cfg, mapper, docs, selected)}
    content = _content_items(tokenizer, documents, docs, selected, cfg)
    run = _TaskRun(source, target, mapper, cfg, tokenizer, documents, docs, content, multiple_choice_items, reverse_mapper,
                   journal)  # fmt: skip
    for name in _TASKS:
        if name in selected:
            results.update(_task_results(run, name))
    # What each task's transfers used (the default resolves per prompt length: 32, at most half a shorter prompt).
    results["config"]["num_recompute_tokens_used"] = {
        name: res["num_recompute_tokens"]
        for name, res in results.items()
        if name != "config" and isinstance(res, dict) and "num_recompute_tokens" in res
    }
    return results


def eval_journal(path: str | os.PathLike, source: PreTrainedModel, target: PreTrainedModel) -> ResultJournal:
    """The journal of `evaluate`'s finished tasks at `path` for these two models (`core/journal.py`)."""
    return ResultJournal(path, {"kind": "eval", "source": model_identity(source), "target": model_identity(target)})


def _task_results(run: _TaskRun, name: str) -> dict[str, Any]:
    """What task `name` adds to the results: run, or read back from the run's journal (`_TaskRun.score`: keyed by
    the task's items and the options it reads)."""
    task = _TASKS[name]

    def compute() -> dict[str, Any]:
        out: dict[str, Any] = {}
        task.step(run, out)
        return out

    return run.score(name, run.content.get(name), compute, task.options)


def _selected_tasks(cfg: EvalConfig, multiple_choice_items, reverse_mapper) -> list[str]:
    """The tasks to run (`resolve_tasks`), warning about inputs given for tasks left out."""
    selected = resolve_tasks(
        cfg.tasks, multiple_choice=bool(multiple_choice_items), multi_turn=reverse_mapper is not None,
        continuation=cfg.continuation,
    )  # fmt: skip
    if cfg.tasks is not None:
        ignored = [name for name, given in (("multiple-choice", multiple_choice_items), ("multi-turn", reverse_mapper))
                   if given and name not in selected]  # fmt: skip
        if ignored:
            logger.warning("inputs of %s given but not in tasks: not run", ", ".join(ignored))
    return selected


def _config_block(cfg: EvalConfig, mapper: KVMapper, docs, selected: list[str]) -> dict[str, Any]:
    return {
        "source": mapper.config.source_model_id,
        "target": mapper.config.target_model_id,
        "top_k": mapper.config.top_k,
        "ridge_lambda": mapper.config.ridge_lambda,
        "num_exact_layers": mapper.resolve_num_exact_layers(cfg.num_exact_layers),
        "exact_window": mapper.config.exact_window,
        "num_recompute_tokens": "default" if cfg.num_recompute_tokens is None else cfg.num_recompute_tokens,
        "num_documents": len(docs),
        "num_tokens": sum(len(d) for d in docs),
        "seed": cfg.seed,
        "tasks": selected,
    }


@dataclass
class _TaskRun:
    """What every task of one `evaluate` call is run with."""

    source: PreTrainedModel
    target: PreTrainedModel
    mapper: KVMapper
    cfg: EvalConfig
    tokenizer: Any
    documents: list[str]  # the evaluation text's documents
    docs: list[list[int]]  # their token ids
    content: dict[str, Any]  # the content tasks' items (`_content_items`)
    multiple_choice_items: Sequence[MultipleChoiceItem] | None
    reverse_mapper: KVMapper | None
    journal: ResultJournal | None = None  # finished tasks (and depth cells) kept on disk (`eval_journal`)

    def score(self, what: str, items: Any, compute: Callable[[], dict[str, Any]], options: Sequence[str]) -> dict[str, Any]:
        """`compute()`, or its result read back from the journal when it holds `what` for the same mapper, exact
        layers, inputs (the text's tokens, `items`, the choice items, the reverse mapper) and values of `options`.
        With a journal the result is as JSON gives it back (lists, not tuples), read back or not."""
        if self.journal is None:
            return compute()
        values = {k: getattr(self.cfg, k) for k in options}
        reverse = self.journal.fingerprint(self.reverse_mapper) if self.reverse_mapper is not None else None
        items = items.tolist() if isinstance(items, torch.Tensor) else items  # a tensor's repr elides its middle
        digest = hashlib.sha256(repr((self.docs, items, self.multiple_choice_items, reverse)).encode()).hexdigest()
        num_exact = self.mapper.resolve_num_exact_layers(self.cfg.num_exact_layers)
        return self.journal.score(what, self.mapper, num_exact, [digest], lambda: json.loads(json.dumps(compute())),
                                  **values)  # fmt: skip

    @property
    def models(self) -> tuple:
        return self.source, self.target, self.mapper

    @property
    def common(self) -> dict[str, Any]:
        """The keywords of the tasks that hand the target a prompt's transferred cache."""
        cfg = self.cfg
        return dict(num_exact_layers=cfg.num_exact_layers, num_bootstrap=cfg.num_bootstrap, seed=cfg.seed,
                    progress=cfg.progress)  # fmt: skip

    @property
    def fed(self) -> int | None:
        """Recomputed tokens of the tasks predicting from the prompt's last position, which the target must be fed
        (recall, agreement, the choice tasks)."""
        n = self.cfg.num_recompute_tokens
        return None if n is None else max(1, n)


def _perplexity(run: _TaskRun, results: dict[str, Any]) -> None:
    cfg = run.cfg
    windows = text_windows(run.docs, 2 * cfg.prefix_len, cfg.max_windows)
    results["prefix_perplexity"] = prefix_perplexity(
        *run.models, windows, cfg.prefix_len, cfg.num_recompute_tokens, cfg.batch_size, **run.common
    )
    results["kv_r2"] = kv_r2(*run.models, windows[:, : cfg.prefix_len], cfg.batch_size, progress=cfg.progress)


def _continuation(run: _TaskRun, results: dict[str, Any]) -> None:
    cfg = run.cfg
    items = build_continuation_task(run.docs, cfg.context_len, cfg.continuation_len, cfg.num_choices, cfg.num_items,
                                    seed=cfg.seed)  # fmt: skip
    results["continuation"] = multiple_choice(
        *run.models, items, num_recompute_tokens=run.fed, desc="continuation task", **run.common
    )
    results["continuation"].update(context_len=cfg.context_len, continuation_len=cfg.continuation_len)


def _repeat(run: _TaskRun, results: dict[str, Any]) -> None:
    results["repeated_span"] = repeated_span_retention(
        *run.models, run.content["repeat"], num_recompute_tokens=run.cfg.num_recompute_tokens,
        batch_size=run.cfg.batch_size, **run.common,
    )  # fmt: skip


def _recall(run: _TaskRun, results: dict[str, Any]) -> None:
    results["passage_recall"] = passage_recall(*run.models, run.content["recall"], num_recompute_tokens=run.fed, **run.common)


def _handoff(run: _TaskRun, results: dict[str, Any]) -> None:
    results["handoff"] = handoff(
        *run.models, run.content["handoff"], num_recompute_tokens=run.cfg.num_recompute_tokens, **run.common
    )


def _agreement(run: _TaskRun, results: dict[str, Any]) -> None:
    results["greedy_agreement"] = greedy_agreement(
        *run.models, run.content["agreement"], run.cfg.max_new_tokens, num_recompute_tokens=run.fed,
        batch_size=run.cfg.batch_size, **run.common,
    )  # fmt: skip


def _depth(run: _TaskRun, results: dict[str, Any]) -> None:
    cfg = run.cfg
    results["recall_by_depth"] = recall_by_depth(
        *run.models, run.tokenizer, grid=run.content["depth"], seed=cfg.seed, num_recompute_tokens=run.fed,
        num_exact_layers=cfg.num_exact_layers, num_bootstrap=cfg.num_bootstrap, progress=cfg.progress,
        score_cell=lambda items, compute: run.score(DEPTH_CELL, items, compute, _TASKS["depth"].options),
    )  # fmt: skip


def _multiple_choice(run: _TaskRun, results: dict[str, Any]) -> None:
    results["multiple_choice"] = multiple_choice(*run.models, run.multiple_choice_items, num_recompute_tokens=run.fed, **run.common)


def _multi_turn(run: _TaskRun, results: dict[str, Any]) -> None:
    cfg = run.cfg
    conversations = text_windows(run.docs, cfg.num_turns * cfg.turn_len, cfg.max_conversations)
    results["multi_turn"] = multi_turn_drift(
        run.source, run.target, run.mapper, run.reverse_mapper, conversations, cfg.num_turns, batch_size=cfg.batch_size,
        progress=cfg.progress,
    )  # fmt: skip


class _Task(NamedTuple):
    step: Callable[[_TaskRun, dict[str, Any]], None]
    options: tuple[str, ...]  # the `EvalConfig` fields the step reads (its items are keyed by what they hold)


# What an eval journal keeps a finished cell of the depth task as (the task itself is kept under its name).
DEPTH_CELL = "depth cell"

# Read by every task that hands the target a transferred cache (`_TaskRun.common`; `progress` changes no result).
_COMMON = ("num_exact_layers", "num_bootstrap", "seed")

# The tasks of `evaluate` in the order they run (and their results appear). An eval journal keys each task by the
# options it reads, so a rerun with another value of an option that only other tasks read keeps its results.
_TASKS: dict[str, _Task] = {
    "perplexity": _Task(_perplexity, ("prefix_len", "max_windows", "num_recompute_tokens", "batch_size", *_COMMON)),
    "continuation": _Task(_continuation, ("context_len", "continuation_len", "num_choices", "num_items",
                                          "num_recompute_tokens", *_COMMON)),  # fmt: skip
    "repeat": _Task(_repeat, ("num_recompute_tokens", "batch_size", *_COMMON)),
    "recall": _Task(_recall, ("num_recompute_tokens", *_COMMON)),
    "handoff": _Task(_handoff, ("num_recompute_tokens", *_COMMON)),
    "agreement": _Task(_agreement, ("max_new_tokens", "num_recompute_tokens", "batch_size", *_COMMON)),
    "depth": _Task(_depth, ("num_recompute_tokens", *_COMMON)),
    "multiple-choice": _Task(_multiple_choice, ("num_recompute_tokens", *_COMMON)),
    "multi-turn": _Task(_multi_turn, ("num_turns", "turn_len", "max_conversations", "batch_size")),
}
