"""Log-likelihood multiple choice with the context in the cache: items, tasks, the one continuation scorer."""

from __future__ import annotations

import json
import os
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from ..core.cache import TransferredCache
from ..core.defaults import resolve_num_recompute_tokens
from ..core.capture import cache_argument, prefill
from ..core.loading import model_device
from ..core.mapper import KVMapper
from ..core.progress import progress_bar
from .metrics import REFEED_WARNING, bootstrap_ci, normalized_retention


@dataclass
class MultipleChoiceItem:
    """One question: a context (goes into the cache) and choices (scored by the target).

    Args:
        context_ids: token ids of the context (at least one token).
        choice_ids: token ids of each choice, as they continue the context.
        label: index of the right choice.
    """

    context_ids: list[int]
    choice_ids: list[list[int]]
    label: int

    def __post_init__(self):
        if not self.context_ids:
            raise ValueError("a multiple-choice item needs a non-empty context (the transferred part)")
        if len(self.choice_ids) < 2 or not all(self.choice_ids):
            raise ValueError(f"need >= 2 non-empty choices, got lengths {[len(c) for c in self.choice_ids]}")
        if not 0 <= self.label < len(self.choice_ids):
            raise ValueError(f"label {self.label} out of range for {len(self.choice_ids)} choices")


def build_continuation_task(
    token_docs: Sequence[Sequence[int]],
    context_len: int = 128,
    continuation_len: int = 16,
    num_choices: int = 4,
    num_items: int = 200,
    gap: int = 0,
    seed: int = 0,
) -> list[MultipleChoiceItem]:
    """A context-dependent multiple-choice task from plain held-out text.

    Each item: `context_len` tokens of one document; the choices are the `continuation_len` tokens that follow
    it (after skipping `gap` tokens) and continuations cut the same way from *other* documents. True and
    distractor continuations are drawn from the same pool of windows, so without the context every choice is
    equally likely to be picked: only a model that reads the context beats chance (1 / num_choices).

    Documents shorter than one window are skipped; with a single long document, it is cut into 1024-token
    pseudo-documents.
    """
    span = context_len + gap + continuation_len
    if len(token_docs) == 1:
        doc = token_docs[0]
        token_docs = [doc[i : i + 1024] for i in range(0, len(doc), 1024)]
    windows = [
        (d, doc[i : i + context_len], doc[i + context_len + gap : i + span])
        for d, doc in enumerate(token_docs)
        for i in range(0, len(doc) - span + 1, span)
    ]
    docs_with_windows = len({w[0] for w in windows})
    if docs_with_windows < num_choices:
        raise ValueError(
            f"the continuation task needs windows of {span} tokens from >= {num_choices} documents, found "
            f"{docs_with_windows}; use more/longer text or smaller --context-len / --num-choices"
        )
    rng = random.Random(seed)
    order = list(range(len(windows)))
    rng.shuffle(order)
    items = []
    for idx in order[:num_items]:
        doc, context, continuation = windows[idx]
        distractors: list[list[int]] = []
        while len(distractors) < num_choices - 1:
            other = windows[rng.randrange(len(windows))]
            if other[0] != doc and other[2] not in distractors:
                distractors.append(list(other[2]))
        label = rng.randrange(num_choices)
        choices = distractors[:label] + [list(continuation)] + distractors[label:]
        items.append(MultipleChoiceItem(list(context), choices, label))
    return items


def _mc_record(record: dict[str, Any], line_no: int) -> tuple[str, list[str], int]:
    """(context, choices, label) from the common JSONL shapes: generic, HellaSwag, ARC, PIQA, WinoGrande."""
    r = record
    if "context" in r and "choices" in r:
        context, choices, label = r["context"], r["choices"], r.get("label", r.get("answer"))
    elif "ctx" in r and "endings" in r:  # HellaSwag
        context, choices, label = r["ctx"], r["endings"], r["label"]
    elif "question" in r and isinstance(r.get("choices"), dict):  # ARC
        labels = list(r["choices"]["label"])
        context, choices = f"Question: {r['question']}\nAnswer:", r["choices"]["text"]
        label = labels.index(r["answerKey"]) if r["answerKey"] in labels else None
    elif "goal" in r and "sol1" in r:  # PIQA
        context, choices, label = f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], r["label"]
    elif "sentence" in r and "option1" in r:  # WinoGrande, scored as a continuation after the blank
        head, _, tail = r["sentence"].partition("_")
        context, choices = head.rstrip(), [f"{r['option1']}{tail}", f"{r['option2']}{tail}"]
        label = int(r["answer"]) - 1
    else:
        raise ValueError(
            f"line {line_no}: unknown multiple-choice record with keys {sorted(r)}; expected "
            "{'context', 'choices', 'label'} or HellaSwag (ctx/endings/label), ARC (question/choices/answerKey), "
            "PIQA (goal/sol1/sol2/label) or WinoGrande (sentence/option1/option2/answer)"
        )
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)
    if not isinstance(label, int):
        raise ValueError(f"line {line_no}: label must be an integer index into the choices, got {label!r}")
    return context, list(choices), label


def load_multiple_choice(path: str | os.PathLike, tokenizer, limit: int | None = None) -> list[MultipleChoiceItem]:
    """Read a multiple-choice JSONL file and tokenize it (choices continue the context after a space)."""
    items = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            context, choices, label = _mc_record(json.loads(line), line_no)
            ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
            if not ctx and tokenizer.bos_token_id is not None:
                ctx = [tokenizer.bos_token_id]
            chs = [tokenizer(" " + c.lstrip(), add_special_tokens=False)["input_ids"] for c in choices]
            items.append(MultipleChoiceItem(ctx, chs, label))
            if limit is not None and len(items) >= limit:
                break
    if not items:
        raise ValueError(f"{path} holds no multiple-choice records")
    return items


@torch.no_grad()
def score_continuations(
    model: PreTrainedModel, feed_prefix: list[int], continuations: list[list[int]], cache, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-likelihood of each continuation given `cache` + `feed_prefix` (at least one token: it predicts the
    first continuation token); continuations batched, right-padded (a causal model's real tokens never attend to
    pads after them, so no mask is needed). The one scorer behind multiple choice and the lm-eval adapter.

    Returns:
        `(log-prob sums [n] float64, greedy [n] bool: whether greedy decoding would produce each continuation)`.
    """
    device = model_device(model)
    width = max(len(c) for c in continuations)
    feed = torch.full((len(continuations), len(feed_prefix) + width), pad_id, dtype=torch.long, device=device)
    for row, cont in enumerate(continuations):
        feed[row, : len(feed_prefix)] = torch.tensor(feed_prefix)
        feed[row, len(feed_prefix) : len(feed_prefix) + len(cont)] = torch.tensor(cont)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=REFEED_WARNING)
        logits = model(feed, use_cache=cache is not None, **{cache_argument(model): cache}).logits.float()
    logits = logits[:, len(feed_prefix) - 1 : -1]
    logp = logits.log_softmax(-1)
    scores = torch.empty(len(continuations), dtype=torch.float64)
    greedy = torch.empty(len(continuations), dtype=torch.bool)
    for row, cont in enumerate(continuations):
        tok = torch.tensor(cont, device=device)
        scores[row] = logp[row, torch.arange(len(cont), device=device), tok].sum().double().cpu()
        greedy[row] = bool((logits[row, : len(cont)].argmax(-1) == tok).all())
    return scores, greedy


_MODES = ("target", "transfer", "no_context")  # the caches the choices are scored on


@torch.no_grad()
def multiple_choice(
    source: PreTrainedModel,
    target: PreTrainedModel,
    mapper: KVMapper,
    items: Sequence[MultipleChoiceItem],
    num_recompute_tokens: int | None = None,
    num_bootstrap: int = 1000,
    seed: int = 0,
    progress: bool = True,
    desc: str = "multiple choice",
    num_exact_layers: int | None = None,
) -> dict[str, Any]:
    """Log-likelihood multiple choice with the context in the cache and the choices scored by the target.

    Per item the target is fed the last `num_recompute_tokens` context tokens (at least 1: it must predict
    the first choice token; default: `TransferredCache`'s, 32 or half a shorter context) and then each choice, on
    top of a cache of the rest of the context:

    - `target`: its own prefill,
    - `transfer`: the source's prefill through `mapper`,
    - `no_context`: no cache (the same fed tokens only), a check that the task needs the context.

    `acc` picks the highest total log-likelihood, `acc_norm` the highest per-token mean. The floor is chance.
    `num_exact_layers`: the target's first layers it computes itself in the transfer (default: the mapper's).

    Returns:
        `{"acc": {...}, "acc_norm": {...}, "chance", "retention", "normalized_retention" (+ `_ci`, on acc),
        "num_recompute_tokens", "num_exact_layers"}`.
    """
    if num_recompute_tokens is not None and num_recompute_tokens < 1:
        raise ValueError("multiple choice needs num_recompute_tokens >= 1 (the target predicts the first choice token)")
    correct = {m: [] for m in _MODES}
    correct_norm = {m: [] for m in _MODES}
    used = set()
    bar = progress_bar(total=len(items), desc=desc, unit="item", enabled=progress)
    for item in items:
        r = min(resolve_num_recompute_tokens(num_recompute_tokens, len(item.context_ids), mapper, num_exact_layers), len(item.context_ids))
        used.add(r)
        for mode, (right, right_norm) in _score_item(source, target, mapper, item, r, num_exact_layers).items():
            correct[mode].append(right)
            correct_norm[mode].append(right_norm)
        bar.update(1)
    bar.close()
    chance = float(np.mean([1 / len(item.choice_ids) for item in items]))
    acc = {m: np.array(v, dtype=np.float64) for m, v in correct.items()}
    result: dict[str, Any] = {
        "num_items": len(items),
        "num_recompute_tokens": next(iter(used)) if len(used) == 1 else sorted(used),
        "num_exact_layers": mapper.resolve_num_exact_layers(num_exact_layers),
        "chance": chance,
        "acc": {m: float(v.mean()) for m, v in acc.items()},
        "acc_norm": {m: float(np.mean(v)) for m, v in correct_norm.items()},
    }
    result.update(_retentions(acc, chance, num_bootstrap, seed))
    return result


def _score_item(
    source: PreTrainedModel, target: PreTrainedModel, mapper: KVMapper, item: MultipleChoiceItem, r: int,
    num_exact_layers: int | None,
) -> dict[str, tuple[bool, bool]]:
    """Per mode (`_MODES`), whether the highest total and the highest per-token log-likelihood pick `item`'s label,
    the target fed the last `r` context tokens and each choice on top of that mode's cache of the rest."""
    pad_id = 0
    ctx = torch.tensor([item.context_ids])
    n = len(item.choice_ids)
    lengths = torch.tensor([len(c) for c in item.choice_ids], dtype=torch.float64)
    head = item.context_ids[-r:]
    caches: dict[str, Any] = {"no_context": None}
    own = prefill(target, ctx[:, :-r].to(model_device(target))) if len(item.context_ids) > r else DynamicCache()
    own.batch_repeat_interleave(n)
    caches["target"] = own
    src = prefill(source, ctx.to(model_device(source)))
    caches["transfer"] = TransferredCache(src, mapper, num_recompute_tokens=r, num_exact_layers=num_exact_layers,
                                          model=target)
    picks = {}
    for mode in _MODES:
        scores, _ = score_continuations(target, head, item.choice_ids, caches[mode], pad_id)
        picks[mode] = (int(scores.argmax()) == item.label, int((scores / lengths).argmax()) == item.label)
    return picks


def _retentions(acc: dict[str, np.ndarray], chance: float, num_bootstrap: int, seed: int) -> dict[str, Any]:
    """The transfer's accuracy over the target's own (`retention`) and over it above `chance`
    (`normalized_retention`), each with its bootstrap interval (`_ci`) over the items."""
    num_items = len(acc["target"])

    def retention(idx):
        own = acc["target"][idx].mean()
        return float(acc["transfer"][idx].mean() / own) if own > 0 else float("nan")

    def normalized(idx):
        return normalized_retention(acc["transfer"][idx].mean(), acc["target"][idx].mean(), chance)

    every = np.arange(num_items)
    return {
        "retention": retention(every),
        "retention_ci": bootstrap_ci(retention, num_items, num_bootstrap, seed),
        "normalized_retention": normalized(every),
        "normalized_retention_ci": bootstrap_ci(normalized, num_items, num_bootstrap, seed),
    }


__all__ = [
    "MultipleChoiceItem",
    "build_continuation_task",
    "load_multiple_choice",
    "multiple_choice",
    "score_continuations",
]
