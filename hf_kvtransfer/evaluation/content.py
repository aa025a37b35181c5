"""Content evaluations: does the target still *use* what the transferred cache holds?

Perplexity on ordinary text rewards a cache that is merely plausible. The items of `tasks.py` can only be scored
well by a model that reads its context: a repeated span is predictable only by copying its first occurrence, a
passage fact only by looking it up. Each evaluation here scores the target on the same items three ways:

- **own**: the target with its own prefill of the context (the ceiling),
- **transfer**: the context prefilled by the source and mapped into the target's cache (`TransferredCache`),
- **no_context**: the target without the information (first occurrence replaced, passage left out, hand-off
  question asked alone): the floor,
- **source_alone** (passage recall and hand-off): the source model answering the same items itself, with its own
  prefill — what a deployment gets if it does not switch,

with 95% bootstrap intervals over items and the floor-normalized retention `(transfer - no_context) /
(own - no_context)` (`metrics.retention_over_items`, resampling items jointly). Where the context is worth nothing
to the target, retention is None with the reason, never a ratio of noise. Beside it, recall and hand-off report the
share of the source-to-target gap the transfer recovers, `(transfer - source_alone) / (own - source_alone)`
(`metrics.gap_recovered_over_items`): retention says the content survived, gap recovered says the switch was worth
it. It is None with the reason where the target is no better than the source on the items.

`greedy_agreement` compares generations instead: stock `generate` from the target's own prefill vs. from a
`TransferredCache`, token for token.

With `source=None, mapper=None`, `repeated_span_retention`, `passage_recall` and `handoff` measure the target alone
(own and no context): whether a model reads its context at all (`research/family_builder/family_context.py`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from huggingface_hub.utils import tqdm
from transformers import DynamicCache, PreTrainedModel

from ..core.cache import TransferredCache
from ..core.defaults import resolve_num_recompute_tokens
from ..core.capture import cache_argument, prefill
from ..core.loading import dtype_name, model_device
from ..core.mapper import KVMapper
from .metrics import REFEED_WARNING, gap_recovered_over_items, mean_and_ci, retention_over_items
from .multiple_choice import score_continuations
from .tasks import NEEDLE_POSITIONS, HandoffItem, PassageRecallItem, RepeatedSpanItem, needle_recall_items

__all__ = ["SETTINGS", "greedy_agreement", "handoff", "passage_recall", "recall_by_depth", "repeated_span_retention"]

SETTINGS = ("own", "transfer", "no_context")


# -- shared pieces ---------------------------------------------------------------------------------------


def _settings(source: PreTrainedModel | None, mapper: KVMapper | None) -> tuple[str, ...]:
    if (source is None) != (mapper is None):
        raise ValueError(
            "pass both source and mapper to measure the transfer, or neither to measure the target alone "
            f"(got source={'a model' if source is not None else None}, mapper={'a mapper' if mapper is not None else None})"
        )
    return SETTINGS if mapper is not None else ("own", "no_context")


def _answer_settings(source: PreTrainedModel | None, mapper: KVMapper | None) -> tuple[str, ...]:
    """The settings of recall and hand-off: with a transfer, the source answering alone too."""
    settings = _settings(source, mapper)
    return settings + ("source_alone",) if mapper is not None else settings


def _check_items(items: Sequence[Any], kind: type, what: str) -> list[Any]:
    items = list(items)
    if not items:
        raise ValueError(f"{what} needs at least one item, got none")
    if not all(isinstance(item, kind) for item in items):
        raise TypeError(f"{what} takes {kind.__name__} items (hf_kvtransfer.evaluation.tasks), got {type(items[0]).__name__}")
    return items


def _ids(rows: Sequence[Sequence[int]] | Sequence[int], model: PreTrainedModel) -> torch.Tensor:
    ids = torch.tensor(rows, dtype=torch.long, device=model_device(model))
    return ids if ids.ndim == 2 else ids.unsqueeze(0)


def _own_cache(target: PreTrainedModel, ids: torch.Tensor, num_recompute_tokens: int) -> DynamicCache:
    """The target's prefill of all but the last `num_recompute_tokens` tokens (the tokens it is then fed)."""
    held = ids.shape[-1] - num_recompute_tokens
    return prefill(target, ids[:, :held]) if held > 0 else DynamicCache()


def _recorded(used: set[int]) -> int | list[int]:
    """What a result reports as `num_recompute_tokens`: the one number used, or the sorted numbers (the default
    depends on each context's length)."""
    return next(iter(used)) if len(used) == 1 else sorted(used)


def _exact_layers(mapper: KVMapper | None, num_exact_layers: int | None) -> int | None:
    """The exact layers a result reports: the ones its transferred caches computed (None: no transfer)."""
    return mapper.resolve_num_exact_layers(num_exact_layers) if mapper is not None else None


def _transferred(
    source: PreTrainedModel, target: PreTrainedModel, mapper: KVMapper, ids: torch.Tensor, num_recompute_tokens: int,
    num_exact_layers: int | None,
) -> TransferredCache:
    """What a hand-off gives the target: the source's prefill of `ids`, mapped, its last tokens left to the target."""
    return TransferredCache(
        prefill(source, ids.to(model_device(source))), mapper,
        num_recompute_tokens=num_recompute_tokens, num_exact_layers=num_exact_layers, model=target,
    )  # fmt: skip


def _logits(model: PreTrainedModel, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    with warnings.catch_warnings():
        # The fed tokens continue the transferred ones on purpose (see metrics.REFEED_WARNING).
        warnings.filterwarnings("ignore", message=REFEED_WARNING)
        out = model(ids.to(model_device(model)), use_cache=True, **{cache_argument(model): cache})
    return out.logits.float()


def _groups(keys: Sequence[Any], batch_size: int) -> Iterator[list[int]]:
    """Indices of items with equal `keys` (shapes), in chunks of at most `batch_size`: rows of one batch."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    by_key: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        by_key.setdefault(key, []).append(i)
    for rows in by_key.values():
        for start in range(0, len(rows), batch_size):
            yield rows[start : start + batch_size]


def _summaries(per_item: dict[str, np.ndarray], num_bootstrap: int, seed: int) -> dict[str, dict[str, Any]]:
    return {name: mean_and_ci(values, num_bootstrap, seed) for name, values in per_item.items()}


def _lists(per_item: dict[str, np.ndarray]) -> dict[str, list[float]]:
    return {name: values.tolist() for name, values in per_item.items()}


@torch.no_grad()
def _answer_result(
    scores: dict[str, dict[str, np.ndarray]], num_recompute_tokens: int | list[int], num_exact_layers: int | None,
    num_bootstrap: int, seed: int,
) -> dict[str, Any]:
    """What recall and hand-off report alike: accuracy and answer NLL per setting, per item, and the retention."""
    correct = scores["correct"]
    result: dict[str, Any] = {
        "num_items": len(next(iter(correct.values()))),
        "num_recompute_tokens": num_recompute_tokens,
        "num_exact_layers": num_exact_layers,
        "accuracy": _summaries(correct, num_bootstrap, seed),
        "answer_nll": _summaries(scores["nll"], num_bootstrap, seed),
        "correct_per_item": _lists(correct),
        "answer_nll_per_item": _lists(scores["nll"]),
    }
    result.update(retention_over_items(
        correct["own"], correct.get("transfer"), correct["no_context"], num_bootstrap=num_bootstrap, seed=seed,
    ))  # fmt: skip
    if "source_alone" in correct:
        result.update(gap_recovered_over_items(
            correct["own"], correct["transfer"], correct["source_alone"], num_bootstrap=num_bootstrap, seed=seed,
        ))  # fmt: skip
    return result


_PER_ITEM = {"correct": "correct_per_item", "nll": "answer_nll_per_item", "value": "value_per_item"}


def _reused(reference: dict[str, Any] | None, scores: dict[str, dict[str, np.ndarray]], keys: Sequence[str],
            num_items: int) -> set[str]:
    """Copies a `reference` result's per-item scores of the settings that do not depend on the transfer (own, no
    context, the source alone where both have it) into `scores`; returns the settings copied (none: no reference)."""
    if reference is None:
        return set()
    names = {"own", "no_context"} | ({"source_alone"} & set(scores[keys[0]]) & set(reference[_PER_ITEM[keys[0]]]))
    for key in keys:
        for name in names:
            values = np.asarray(reference[_PER_ITEM[key]][name], dtype=np.float64)
            if values.shape != (num_items,):
                raise ValueError(f"reference has {values.shape[0]} items, got {num_items}: it must be a result on the same items")
            scores[key][name] = values
    return names


def _greedy_tokens(model: PreTrainedModel, ids: Sequence[int], num_tokens: int) -> list[int]:
    """`num_tokens` tokens by argmax of the next-token logits (no EOS handling: answers have a known length)."""
    cache, feed, out = DynamicCache(), _ids(ids, model), []
    for _ in range(num_tokens):
        token = _logits(model, feed, cache)[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        out.append(int(token))
        feed = token
    return out


# -- repeated spans: copying from the context ------------------------------------------------------------


@torch.no_grad()
def repeated_span_retention(
    source: PreTrainedModel | None,
    target: PreTrainedModel,
    mapper: KVMapper | None,
    items: Sequence[RepeatedSpanItem],
    *,
    num_recompute_tokens: int | None = None,
    num_exact_layers: int | None = None,
    batch_size: int = 8,
    num_bootstrap: int = 1000,
    seed: int = 0,
    progress: bool = True,
    reference: dict[str, Any] | None = None,
    desc: str = "repeated spans",
) -> dict[str, Any]:
    """NLL of a span repeated from the prefix: own prefill vs. transfer vs. the first occurrence replaced.

    Per item the target is fed the last `num_recompute_tokens` prefix tokens and the continuation on top of a
    cache of the rest of the prefix, and scored on the continuation tokens of `repeat_mask` (mean NLL per token):

    - `own`: the target's prefill of `prefix_ids`,
    - `transfer`: the source's prefill of `prefix_ids` through `mapper` (`TransferredCache`),
    - `no_context`: the target's prefill of `control_prefix_ids` (the first occurrence replaced by other tokens).

    Args:
        source, mapper: the transfer; both None measures the target alone (own and no context).
        items: from `tasks.repeated_span_items`; items of equal prefix and continuation lengths share batches.
        num_recompute_tokens: prefix tokens the target computes itself instead of receiving them (0: none;
            default: `TransferredCache`'s, 32 or half a shorter prefix).
        num_exact_layers: the target's first layers computed by the target itself (default: the mapper's, as in
            `TransferredCache`).
        num_bootstrap, seed: bootstrap resamples over items for the 95% intervals.
        reference: an earlier result of this function on the same items with the same `num_recompute_tokens`: its
            own and no-context NLLs are reused instead of recomputed (they do not depend on the transfer).
        desc: the progress bar's label (the fit's content probe names what it is trying).

    Returns:
        `nll` (`{"mean", "ci"}` per setting, nats per repeated token), `nll_per_item` (per setting, same item
        order), the floor-normalized `retention` `(no_context - transfer) / (no_context - own)` with `retention_ci`
        (or `retention_undefined`), `context_gain` (NLL without - with the first occurrence), `transfer_minus_own`.

    Example:
        ```python
        items = repeated_span_items(tokenizer, heldout_ids, 600, prefix_len=256)
        res = repeated_span_retention(small, large, mapper, items)
        res["nll"]["transfer"]["mean"], res["retention"], res["retention_ci"]
        ```
    """
    settings = _settings(source, mapper)
    items = _check_items(items, RepeatedSpanItem, "repeated_span_retention")
    used = {resolve_num_recompute_tokens(num_recompute_tokens, len(item.prefix_ids), mapper, num_exact_layers) for item in items}
    for i, item in enumerate(items):
        r = resolve_num_recompute_tokens(num_recompute_tokens, len(item.prefix_ids), mapper, num_exact_layers)
        if not 0 <= r < len(item.prefix_ids):
            raise ValueError(f"num_recompute_tokens must be in [0, {len(item.prefix_ids)}) (item {i}'s prefix), got {r}")
        if not any(item.repeat_mask) or len(item.repeat_mask) != len(item.continuation_ids):
            raise ValueError(f"item {i}: repeat_mask must mark >= 1 of its {len(item.continuation_ids)} continuation tokens")
        if r == 0 and item.repeat_mask[0]:
            raise ValueError(
                f"item {i} scores its first continuation token, which only the prefix's last position predicts; "
                "use num_recompute_tokens >= 1"
            )
    nll = {name: np.zeros(len(items)) for name in settings}
    reused = ("own", "no_context") if reference is not None else ()
    for name in reused:
        nll[name] = np.asarray(reference["nll_per_item"][name], dtype=np.float64)
        if nll[name].shape != (len(items),) or reference.get("num_recompute_tokens") != _recorded(used):
            raise ValueError("reference must be a result of repeated_span_retention on the same items and num_recompute_tokens")
    bar = tqdm(total=len(items), desc=desc, unit="item", disable=not progress)
    for rows in _groups([(len(it.prefix_ids), len(it.continuation_ids)) for it in items], batch_size):
        batch = [items[i] for i in rows]
        prefix = _ids([it.prefix_ids for it in batch], target)  # (B, T)
        control = _ids([it.control_prefix_ids for it in batch], target)
        cont = _ids([it.continuation_ids for it in batch], target)  # (B, C)
        mask = torch.tensor([it.repeat_mask for it in batch], device=cont.device)
        t = prefix.shape[1]
        r = resolve_num_recompute_tokens(num_recompute_tokens, t, mapper, num_exact_layers)
        # Fed token k sits at position t - r + k and predicts position t - r + k + 1: continuation token j is
        # predicted at k = r + j - 1, so with r = 0 token 0 is not scored (never in a repeat: validated above).
        first = max(0, 1 - r)
        caches = {
            name: (ids, _own_cache(target, ids, r))
            for name, ids in (("own", prefix), ("no_context", control)) if name not in reused
        }  # fmt: skip
        if "transfer" in settings:
            caches["transfer"] = (prefix, _transferred(source, target, mapper, prefix, r, num_exact_layers))
        for name, (context, cache) in caches.items():
            feed = torch.cat([context[:, t - r :], cont[:, :-1]], dim=1)
            logits = _logits(target, feed, cache)[:, r + first - 1 :]  # (B, C - first, V)
            token_nll = F.cross_entropy(logits.transpose(1, 2), cont[:, first:], reduction="none")
            m = mask[:, first:].to(token_nll.dtype)
            nll[name][rows] = ((token_nll * m).sum(-1) / m.sum(-1)).double().cpu().numpy()
        bar.update(len(rows))
    bar.close()
    prefix_lens = sorted({len(it.prefix_ids) for it in items})
    result: dict[str, Any] = {
        "num_items": len(items),
        "kinds": sorted({it.kind for it in items}),
        "prefix_len": prefix_lens[0] if len(prefix_lens) == 1 else prefix_lens,
        "scored_tokens_per_item": float(np.mean([sum(it.repeat_mask) for it in items])),
        "num_recompute_tokens": _recorded(used),
        "num_exact_layers": _exact_layers(mapper, num_exact_layers),
        "nll": _summaries(nll, num_bootstrap, seed),
        "nll_per_item": _lists(nll),
    }
    result.update(retention_over_items(
        nll["own"], nll.get("transfer"), nll["no_context"], higher_is_better=False, num_bootstrap=num_bootstrap, seed=seed,
    ))  # fmt: skip
    return result


# -- passage recall: looking a fact up -------------------------------------------------------------------


def _answer_scores(
    target: PreTrainedModel, feed: list[int], answer: list[int], others: list[list[int]], cache
) -> tuple[float, bool, bool]:
    """`(answer NLL, greedy exact match of the answer, greedy production of any of answer + others)`.

    Greedy match is teacher-forced: every answer token is the argmax given the ones before it, i.e. what greedy
    decoding would write. One batch: the answer and the other candidates as continuations of `feed`.
    """
    candidates = [answer] + [c for c in others if c != answer]
    if not isinstance(cache, TransferredCache) and len(candidates) > 1:
        cache.batch_repeat_interleave(len(candidates))  # a transferred cache expands itself
    scores, greedy = score_continuations(target, feed, candidates, cache)
    return -float(scores[0]), bool(greedy[0]), bool(greedy.any())


@torch.no_grad()
def passage_recall(
    source: PreTrainedModel | None,
    target: PreTrainedModel,
    mapper: KVMapper | None,
    items: Sequence[PassageRecallItem],
    *,
    num_recompute_tokens: int | None = None,
    num_exact_layers: int | None = None,
    num_bootstrap: int = 1000,
    seed: int = 0,
    progress: bool = True,
    reference: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Greedy exact match of an answer that only the passage holds: own prefill vs. transfer vs. no passage.

    Per item the target is fed the last `num_recompute_tokens` prompt tokens (at least 1: the last prompt position
    predicts the answer; default: `TransferredCache`'s for the prompt's length) on top of a cache of the rest:

    - `own`: the target's prefill of `prompt_ids`,
    - `transfer`: the source's prefill of `prompt_ids` through `mapper`; the target recomputes the last tokens, as
      under `generate`,
    - `no_context`: the target reading `no_passage_prompt_ids` (distractor and question only).

    An answer is right when greedy decoding writes it (for one-token answers: the argmax of the next-token
    logits; longer answers are teacher-forced, every token the argmax given the ones before). Items are scored one
    at a time (prompts differ in length).

    Args:
        source, mapper: the transfer; both None measures the target alone (own and no context).
        items: from `tasks.passage_recall_items`.
        reference: an earlier result of this function on the same items: its own and no-context scores are reused
            instead of recomputed (they do not depend on the transfer; the fit's probe scores many candidates).

    Returns:
        `accuracy`, `answer_nll` (-log p(answer)) and `passage_value_rate` (greedy writes the value of *some*
        fact of the passage: reading the passage but picking the wrong fact) as `{"mean", "ci"}` per setting;
        `correct_per_item` / `answer_nll_per_item`; the retention of accuracy `(transfer - no_context) /
        (own - no_context)` with `retention_ci` or `retention_undefined`, `context_gain`, `transfer_minus_own`.

    Example:
        ```python
        items = passage_recall_items(tokenizer, 600, distractor_texts=heldout_documents)
        res = passage_recall(small, large, mapper, items)
        {s: res["accuracy"][s]["mean"] for s in ("own", "transfer", "no_context")}, res["retention"]
        ```
    """
    settings = _answer_settings(source, mapper)
    items = _check_items(items, PassageRecallItem, "passage_recall")
    if num_recompute_tokens is not None and num_recompute_tokens < 1:
        raise ValueError(
            f"passage_recall needs num_recompute_tokens >= 1 (the target must read the prompt's last token to predict "
            f"the answer), got {num_recompute_tokens}"
        )
    scores = {key: {name: np.zeros(len(items)) for name in settings} for key in ("correct", "nll", "value")}
    reused = _reused(reference, scores, ("correct", "nll", "value"), len(items))
    used = set()
    bar = tqdm(total=len(items), desc="passage recall", unit="item", disable=not progress)
    for i, item in enumerate(items):
        if not item.answer_ids or not item.prompt_ids or not item.no_passage_prompt_ids:
            raise ValueError(f"item {i} has an empty prompt, no-passage prompt or answer")
        prompt, alone = _ids(item.prompt_ids, target), _ids(item.no_passage_prompt_ids, target)
        r = min(resolve_num_recompute_tokens(num_recompute_tokens, prompt.shape[1], mapper, num_exact_layers), prompt.shape[1])
        r_alone = min(resolve_num_recompute_tokens(num_recompute_tokens, alone.shape[1], mapper, num_exact_layers), alone.shape[1])
        used.add(r)
        # Every setting reads its prompt into a cache once, then its model scores the candidates on top of it.
        runs = {
            "own": lambda: (target, item.prompt_ids[-r:], _own_cache(target, prompt, r)),
            "no_context": lambda: (target, item.no_passage_prompt_ids[-r_alone:], _own_cache(target, alone, r_alone)),
            "transfer": lambda: (target, item.prompt_ids[-r:],
                                 _transferred(source, target, mapper, prompt, r, num_exact_layers)),
            "source_alone": lambda: (source, item.prompt_ids[-r:], _own_cache(source, prompt.to(model_device(source)), r)),
        }  # fmt: skip
        for name in (n for n in settings if n not in reused):
            model, feed, cache = runs[name]()
            nll, correct, value = _answer_scores(model, feed, item.answer_ids, item.passage_values, cache)
            scores["nll"][name][i], scores["correct"][name][i], scores["value"][name][i] = nll, correct, value
        bar.update(1)
    bar.close()
    result = _answer_result(scores, _recorded(used), _exact_layers(mapper, num_exact_layers), num_bootstrap, seed)
    result["value_per_item"] = _lists(scores["value"])
    result["passage_value_chance"] = float(np.mean([1 / max(1, len(it.passage_values)) for it in items]))
    result["passage_value_rate"] = _summaries(scores["value"], num_bootstrap, seed)
    return result


def recall_by_depth(
    source: PreTrainedModel | None,
    target: PreTrainedModel,
    mapper: KVMapper | None,
    tokenizer,
    *,
    lengths: Sequence[int] = (512, 1024),
    positions: Sequence[str] = tuple(NEEDLE_POSITIONS),
    items: int = 100,
    distractor_texts: Sequence[str] | None = None,
    seed: int = 0,
    **recall_options: Any,
) -> dict[str, Any]:
    """Passage recall over a grid of context lengths x needle positions (`tasks.needle_recall_items`): where in a
    long context the transfer loses the content.

    Every cell asks the same facts (the positions of one length share their haystack), so cells differ only in
    length and depth. `recall_options` go to `passage_recall` (`num_recompute_tokens`, `num_exact_layers`, ...).

    Returns:
        `{"lengths", "positions", "items", "cells": [{"context_tokens", "position", "accuracy": {setting: {"mean",
        "ci"}}, "retention", "retention_ci", "gap_recovered", "gap_recovered_ci", "transfer_minus_own"}, ...]}`,
        cells in row-major order (lengths, then positions).
    """
    cells = []
    for length in lengths:
        for position in positions:
            cell = needle_recall_items(tokenizer, items, length, position, seed, distractor_texts=distractor_texts)
            res = passage_recall(source, target, mapper, cell, seed=seed, **recall_options)
            keep = ("accuracy", "retention", "retention_ci", "retention_undefined", "gap_recovered",
                    "gap_recovered_ci", "transfer_minus_own", "num_recompute_tokens", "num_exact_layers")  # fmt: skip
            cells.append({"context_tokens": length, "position": position, **{k: res.get(k) for k in keep}})
    return {"lengths": list(lengths), "positions": list(positions), "items": items, "cells": cells}


# -- hand-off: the source answers, the target takes over -------------------------------------------------


@torch.no_grad()
def handoff(
    source: PreTrainedModel | None,
    target: PreTrainedModel,
    mapper: KVMapper | None,
    items: Sequence[HandoffItem],
    *,
    num_recompute_tokens: int | None = None,
    num_exact_layers: int | None = None,
    num_bootstrap: int = 1000,
    seed: int = 0,
    progress: bool = True,
    reference: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A conversation handed from the source to the target: question 2 after the source answered question 1.

    The source reads `prompt_ids` (passage, distractor, question 1) and answers greedily (its accuracy is
    `q1_accuracy`); the dialogue goes on with `followup_ids` (end of answer 1, question 2), which the target reads
    and answers:

    - `own`: the target reads the whole dialogue itself (prompt, the source's answer, followup),
    - `transfer`: the source's cache of prompt + its answer, through `mapper`; the target reads the followup
      (and recomputes the last `num_recompute_tokens` tokens of the dialogue so far; default: `TransferredCache`'s
      for the dialogue's length),
    - `no_context`: the target reads the followup alone.

    Without a source and mapper the target answers question 1 itself and only own / no context are measured.
    Right means greedy exact match, as in `passage_recall`. Items are scored one at a time. `reference`: an earlier
    result on the same items with the same answerer; its answers to question 1 and its own and no-context scores
    are reused (they do not depend on the transfer).

    Returns:
        `q1_accuracy` (the answerer's), `accuracy` and `answer_nll` of question 2 per setting (`{"mean", "ci"}`),
        `q1_correct_per_item`, `correct_per_item`, `answer_nll_per_item`, the retention of question-2 accuracy
        with `retention_ci` or `retention_undefined`, `context_gain`, `transfer_minus_own`.

    Example:
        ```python
        res = handoff(small, large, mapper, handoff_items(tokenizer, 600, distractor_texts=heldout_documents))
        res["q1_accuracy"]["mean"], res["accuracy"]["transfer"]["mean"], res["retention"]
        ```
    """
    settings = _answer_settings(source, mapper)
    items = _check_items(items, HandoffItem, "handoff")
    if num_recompute_tokens is not None and num_recompute_tokens < 0:
        raise ValueError(f"num_recompute_tokens must be >= 0, got {num_recompute_tokens}")
    answerer = source if source is not None else target
    q1 = np.zeros(len(items))
    scores = {key: {name: np.zeros(len(items)) for name in settings} for key in ("correct", "nll")}
    reused = _reused(reference, scores, ("correct", "nll"), len(items))
    answers: list[list[int]] = []
    used = set()
    bar = tqdm(total=len(items), desc="hand-off", unit="item", disable=not progress)
    for i, item in enumerate(items):
        if not (item.prompt_ids and item.answer1_ids and item.followup_ids and item.answer2_ids):
            raise ValueError(f"item {i} has an empty prompt, answer or followup")
        if reused:
            answer1 = list(reference["answer1_per_item"][i])
        else:
            answer1 = _greedy_tokens(answerer, item.prompt_ids, len(item.answer1_ids))
        answers.append(answer1)
        q1[i] = answer1 == list(item.answer1_ids)
        dialogue = item.prompt_ids + answer1  # what was said before the hand-off, the answerer's answer included
        r = min(resolve_num_recompute_tokens(num_recompute_tokens, len(dialogue), mapper, num_exact_layers), len(dialogue))
        used.add(r)
        feed = dialogue[len(dialogue) - r :] + item.followup_ids
        head = _ids(dialogue, target)
        runs = {
            "own": lambda: (target, feed, _own_cache(target, head, r)),
            "no_context": lambda: (target, item.followup_ids, None),
            "transfer": lambda: (target, feed, _transferred(source, target, mapper, head, r, num_exact_layers)),
            "source_alone": lambda: (source, feed, _own_cache(source, head.to(model_device(source)), r)),
        }  # fmt: skip
        for name in (n for n in settings if n not in reused):
            model, fed, cache = runs[name]()
            nll, correct, _ = _answer_scores(model, fed, item.answer2_ids, [], cache)
            scores["nll"][name][i], scores["correct"][name][i] = nll, correct
        bar.update(1)
    bar.close()
    result = _answer_result(scores, _recorded(used), _exact_layers(mapper, num_exact_layers), num_bootstrap, seed)
    result["answerer"] = "source" if source is not None else "target"
    result["q1_accuracy"] = mean_and_ci(q1, num_bootstrap, seed)
    result["q1_correct_per_item"] = q1.tolist()
    result["answer1_per_item"] = answers
    return result


# -- greedy generation: same tokens as the target's own prefill? -----------------------------------------


@torch.no_grad()
def greedy_agreement(
    source: PreTrainedModel,
    target: PreTrainedModel,
    mapper: KVMapper,
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    max_new_tokens: int = 16,
    *,
    num_recompute_tokens: int | None = None,
    num_exact_layers: int | None = None,
    reference_dtype: torch.dtype | None = torch.bfloat16,
    batch_size: int = 8,
    num_bootstrap: int = 1000,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Greedy generations of the target from its own prefill vs. from a `TransferredCache`, token for token.

    Both are stock `target.generate(input_ids, max_new_tokens=..., do_sample=False)`, the transfer with
    `cache=TransferredCache(prefill(source, input_ids), mapper)`. EOS is suppressed (`min_new_tokens`), so every
    generation has `max_new_tokens` tokens to compare.

    Greedy agreement over many tokens is all-or-nothing: one flipped near-tie changes the rest of a generation. So
    that a reader can tell a mapper's error from numerics, the same prompts are also generated from the target's own
    cache rounded to `reference_dtype` (bf16: what a serving cache holds), and that agreement is reported beside the
    transfer's as `reference`.

    Args:
        input_ids: `[num_prompts, prompt_len]` prompt token ids (e.g. `evaluate.text_windows`).
        num_recompute_tokens: trailing prompt tokens the target recomputes (>= 1: `generate` must be fed one;
            default: `TransferredCache`'s, 32 or half a shorter prompt).
        reference_dtype: the dtype of the rounding reference; None skips it. Skipped too (with the reason) when the
            target already computes its cache in that dtype: rounding would change nothing.

    Returns:
        `first_token_agreement`, `all_tokens_agreement` and `agreeing_tokens` (length of the identical prefix
        of the two generations) as `{"mean", "ci"}`, and the same per prompt (`*_per_item`); `reference`: the same
        three for the rounded own cache (`{"dtype", ...}`, or `{"dtype", "skipped": reason}`), unless
        `reference_dtype` is None.

    Example:
        ```python
        res = greedy_agreement(small, large, mapper, text_windows(token_docs, 128, 600))
        res["first_token_agreement"]["mean"], res["all_tokens_agreement"]["mean"]
        ```
    """
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.ndim != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be [num_prompts, prompt_len] with >= 1 prompt, got shape {list(input_ids.shape)}")
    num_prompts, prompt_len = input_ids.shape
    num_recompute_tokens = resolve_num_recompute_tokens(num_recompute_tokens, prompt_len, mapper, num_exact_layers)
    if not 1 <= num_recompute_tokens <= prompt_len:
        raise ValueError(
            f"num_recompute_tokens must be in [1, {prompt_len}] (generate feeds the target at least one prompt token), "
            f"got {num_recompute_tokens}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    pad = target.generation_config.pad_token_id
    pad = pad if pad is not None else target.config.eos_token_id
    pad = pad[0] if isinstance(pad, (list, tuple)) else pad
    gen = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    cache_dtype = target.get_input_embeddings().weight.dtype
    skipped = None
    if reference_dtype is not None and reference_dtype == cache_dtype:
        skipped = f"the target's cache is already {dtype_name(cache_dtype)}: rounding to it changes nothing"
    rounded = reference_dtype is not None and skipped is None
    same_rows, reference_rows = [], []
    bar = tqdm(total=num_prompts, desc="greedy agreement", unit="prompt", disable=not progress)
    for start in range(0, num_prompts, batch_size):
        ids = input_ids[start : start + batch_size].to(model_device(target))
        mask = torch.ones_like(ids)

        def generate(cache: DynamicCache | None) -> torch.Tensor:
            caches = {cache_argument(target): cache} if cache is not None else {}
            return target.generate(ids, attention_mask=mask, **caches, **gen)[:, prompt_len:]

        own = generate(None)
        transferred = generate(_transferred(source, target, mapper, ids, num_recompute_tokens, num_exact_layers))
        same_rows.append((own == transferred).cpu())  # (B, max_new_tokens)
        if rounded:
            reference = generate(_rounded(_own_cache(target, ids, num_recompute_tokens), reference_dtype))
            reference_rows.append((own == reference).cpu())
        bar.update(ids.shape[0])
    bar.close()
    result: dict[str, Any] = {
        "num_prompts": num_prompts,
        "prompt_len": prompt_len,
        "max_new_tokens": max_new_tokens,
        "num_recompute_tokens": num_recompute_tokens,
        "num_exact_layers": _exact_layers(mapper, num_exact_layers),
        **_agreement(torch.cat(same_rows), num_bootstrap, seed),
    }
    if reference_dtype is not None:
        result["reference"] = {"dtype": dtype_name(reference_dtype)}
        if skipped:
            result["reference"]["skipped"] = skipped
        else:
            result["reference"].update(_agreement(torch.cat(reference_rows), num_bootstrap, seed))
    return result


def _agreement(same: torch.Tensor, num_bootstrap: int, seed: int) -> dict[str, Any]:
    """`[num_prompts, max_new_tokens]` token equality -> the agreement summaries and their per-prompt values."""
    per_item = {
        "first_token_agreement": same[:, 0].double().numpy(),
        "all_tokens_agreement": same.all(-1).double().numpy(),
        "agreeing_tokens": same.long().cumprod(-1).sum(-1).double().numpy(),
    }
    return {**_summaries(per_item, num_bootstrap, seed), **{f"{k}_per_item": v.tolist() for k, v in per_item.items()}}


def _rounded(cache: DynamicCache, dtype: torch.dtype) -> DynamicCache:
    """`cache` with its keys and values rounded to `dtype` and back, in place (the reference of `greedy_agreement`)."""
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            tensor.copy_(tensor.to(dtype))
    return cache
