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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from ..core.cache import TransferredCache
from ..core.defaults import resolve_num_recompute_tokens
from ..core.capture import cache_argument, prefill
from ..core.loading import dtype_name, model_device
from ..core.mapper import KVMapper
from ..core.progress import progress_bar
from .metrics import REFEED_WARNING, gap_recovered_over_items, mean_and_ci, retention_over_items
from .multiple_choice import score_continuations
from .tasks import NEEDLE_POSITIONS, HandoffItem, PassageRecallItem, RepeatedSpanItem, needle_grid

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


@dataclass(frozen=True)
class _Scorer:
    """What a content evaluation scores with: the target, the transfer (`source` and `mapper`; both None: the
    target alone) and the transfer's options as the caller gave them."""

    source: PreTrainedModel | None
    target: PreTrainedModel
    mapper: KVMapper | None
    num_recompute_tokens: int | None
    num_exact_layers: int | None

    def recompute(self, num_tokens: int) -> int:
        """The tokens the target recomputes of a `num_tokens`-token context (`resolve_num_recompute_tokens`)."""
        return resolve_num_recompute_tokens(self.num_recompute_tokens, num_tokens, self.mapper, self.num_exact_layers)

    def exact_layers(self) -> int | None:
        """The exact layers a result reports: the ones its transferred caches computed (None: no transfer)."""
        return self.mapper.resolve_num_exact_layers(self.num_exact_layers) if self.mapper is not None else None

    def transferred(self, ids: torch.Tensor, num_recompute_tokens: int) -> TransferredCache:
        """What a hand-off gives the target: the source's prefill of `ids`, mapped, its last tokens left to the
        target."""
        return TransferredCache(
            prefill(self.source, ids.to(model_device(self.source))), self.mapper,
            num_recompute_tokens=num_recompute_tokens, num_exact_layers=self.num_exact_layers, model=self.target,
        )  # fmt: skip

    def answer_runs(
        self, head: torch.Tensor, r: int, feed: list[int], no_context: Callable[[], tuple]
    ) -> dict[str, Callable[[], tuple]]:
        """How each setting of recall and hand-off reads a prompt: `(model, tokens fed, cache)`, the cache holding
        `head` but its last `r` tokens (`feed` starts with them); `no_context` is the task's own."""
        target, source = self.target, self.source
        return {
            "own": lambda: (target, feed, _own_cache(target, head, r)),
            "no_context": no_context,
            "transfer": lambda: (target, feed, self.transferred(head, r)),
            "source_alone": lambda: (source, feed, _own_cache(source, head.to(model_device(source)), r)),
        }


def _progress(
    chunks: Iterable[Sequence[int]], total: int, desc: str, progress: bool, unit: str = "item"
) -> Iterator[Sequence[int]]:
    """`chunks` (sequences of item indices), counted by a progress bar of `total` `unit`s."""
    bar = progress_bar(total=total, desc=desc, unit=unit, enabled=progress)
    for chunk in chunks:
        yield chunk
        bar.update(len(chunk))
    bar.close()


def _chunks(num_items: int, size: int) -> Iterator[range]:
    """`range(num_items)` in chunks of `size`."""
    for start in range(0, num_items, size):
        yield range(start, min(start + size, num_items))


def _each_item(num_items: int, desc: str, progress: bool) -> Iterator[int]:
    """`range(num_items)`, counted by a progress bar."""
    for [i] in _progress(([i] for i in range(num_items)), num_items, desc, progress):
        yield i


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


def _score_arrays(
    settings: Sequence[str], keys: Sequence[str], num_items: int, reference: dict[str, Any] | None
) -> tuple[dict[str, dict[str, np.ndarray]], set[str]]:
    """`(scores, reused)`: per-item scores `{key: {setting: array}}`, zero but for the settings that do not depend
    on the transfer (own, no context, the source alone where both have it), copied from a `reference` result;
    `reused` names those (none without a reference)."""
    scores = {key: {name: np.zeros(num_items) for name in settings} for key in keys}
    if reference is None:
        return scores, set()
    names = {"own", "no_context"} | ({"source_alone"} & set(scores[keys[0]]) & set(reference[_PER_ITEM[keys[0]]]))
    for key in keys:
        for name in names:
            values = np.asarray(reference[_PER_ITEM[key]][name], dtype=np.float64)
            if values.shape != (num_items,):
                raise ValueError(f"reference has {values.shape[0]} items, got {num_items}: it must be a result on the same items")
            scores[key][name] = values
    return scores, names


def _score_answers(runs: dict[str, Callable[[], tuple]], names: Sequence[str], answer: list[int],
                   others: list[list[int]], scores: dict[str, dict[str, np.ndarray]], i: int) -> None:
    """Item `i`'s answer scores in the settings `names` (`runs`: each one's model, feed and cache) into `scores`
    (its `value` too where `scores` keeps it)."""
    for name in names:
        model, feed, cache = runs[name]()
        nll, correct, value = _answer_scores(model, feed, answer, others, cache)
        scores["nll"][name][i], scores["correct"][name][i] = nll, correct
        if "value" in scores:
            scores["value"][name][i] = value


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
    scorer = _Scorer(source, target, mapper, num_recompute_tokens, num_exact_layers)
    used = _check_span_items(items, scorer)
    nll = {name: np.zeros(len(items)) for name in settings}
    reused = _reused_span_nll(reference, nll, len(items), _recorded(used))
    names = [name for name in settings if name not in reused]
    groups = _groups([(len(it.prefix_ids), len(it.continuation_ids)) for it in items], batch_size)
    for rows in _progress(groups, len(items), desc, progress):
        for name, values in _span_nll(scorer, [items[i] for i in rows], names).items():
            nll[name][rows] = values
    return _span_result(items, nll, _recorded(used), scorer.exact_layers(), num_bootstrap, seed)


def _span_result(
    items: list[RepeatedSpanItem], nll: dict[str, np.ndarray], num_recompute_tokens: int | list[int],
    num_exact_layers: int | None, num_bootstrap: int, seed: int,
) -> dict[str, Any]:
    """What `repeated_span_retention` reports of the per-item NLLs: summaries, the items, the retention."""
    prefix_lens = sorted({len(it.prefix_ids) for it in items})
    result: dict[str, Any] = {
        "num_items": len(items),
        "kinds": sorted({it.kind for it in items}),
        "prefix_len": prefix_lens[0] if len(prefix_lens) == 1 else prefix_lens,
        "scored_tokens_per_item": float(np.mean([sum(it.repeat_mask) for it in items])),
        "num_recompute_tokens": num_recompute_tokens,
        "num_exact_layers": num_exact_layers,
        "nll": _summaries(nll, num_bootstrap, seed),
        "nll_per_item": _lists(nll),
    }
    result.update(retention_over_items(
        nll["own"], nll.get("transfer"), nll["no_context"], higher_is_better=False, num_bootstrap=num_bootstrap, seed=seed,
    ))  # fmt: skip
    return result


def _check_span_items(items: list[RepeatedSpanItem], scorer: _Scorer) -> set[int]:
    """The recomputed-token counts the items' prefixes take; raises on an item that cannot be scored with them."""
    used = {scorer.recompute(len(item.prefix_ids)) for item in items}
    for i, item in enumerate(items):
        r = scorer.recompute(len(item.prefix_ids))
        if not 0 <= r < len(item.prefix_ids):
            raise ValueError(f"num_recompute_tokens must be in [0, {len(item.prefix_ids)}) (item {i}'s prefix), got {r}")
        if not any(item.repeat_mask) or len(item.repeat_mask) != len(item.continuation_ids):
            raise ValueError(f"item {i}: repeat_mask must mark >= 1 of its {len(item.continuation_ids)} continuation tokens")
        if r == 0 and item.repeat_mask[0]:
            raise ValueError(
                f"item {i} scores its first continuation token, which only the prefix's last position predicts; "
                "use num_recompute_tokens >= 1"
            )
    return used


def _reused_span_nll(
    reference: dict[str, Any] | None, nll: dict[str, np.ndarray], num_items: int, recorded: int | list[int]
) -> tuple[str, ...]:
    """Copies a `reference` result's own and no-context NLLs into `nll`; the settings copied (none: no reference)."""
    reused = ("own", "no_context") if reference is not None else ()
    for name in reused:
        nll[name] = np.asarray(reference["nll_per_item"][name], dtype=np.float64)
        if nll[name].shape != (num_items,) or reference.get("num_recompute_tokens") != recorded:
            raise ValueError("reference must be a result of repeated_span_retention on the same items and num_recompute_tokens")
    return reused


def _span_nll(scorer: _Scorer, batch: list[RepeatedSpanItem], names: Sequence[str]) -> dict[str, np.ndarray]:
    """Mean NLL per repeated token of each item of `batch` (equal prefix and continuation lengths) in the settings
    `names`: the target fed the last prefix tokens and the continuation on top of each setting's cache."""
    target = scorer.target
    prefix = _ids([it.prefix_ids for it in batch], target)  # (B, T)
    control = _ids([it.control_prefix_ids for it in batch], target)
    cont = _ids([it.continuation_ids for it in batch], target)  # (B, C)
    mask = torch.tensor([it.repeat_mask for it in batch], device=cont.device)
    t = prefix.shape[1]
    r = scorer.recompute(t)
    # Fed token k sits at position t - r + k and predicts position t - r + k + 1: continuation token j is
    # predicted at k = r + j - 1, so with r = 0 token 0 is not scored (never in a repeat: validated above).
    first = max(0, 1 - r)
    caches = {
        name: (ids, _own_cache(target, ids, r)) for name, ids in (("own", prefix), ("no_context", control)) if name in names
    }  # fmt: skip
    if "transfer" in names:
        caches["transfer"] = (prefix, scorer.transferred(prefix, r))
    nll = {}
    for name, (context, cache) in caches.items():
        feed = torch.cat([context[:, t - r :], cont[:, :-1]], dim=1)
        logits = _logits(target, feed, cache)[:, r + first - 1 :]  # (B, C - first, V)
        token_nll = F.cross_entropy(logits.transpose(1, 2), cont[:, first:], reduction="none")
        m = mask[:, first:].to(token_nll.dtype)
        nll[name] = ((token_nll * m).sum(-1) / m.sum(-1)).double().cpu().numpy()
    return nll


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
    scorer = _Scorer(source, target, mapper, num_recompute_tokens, num_exact_layers)
    scores, reused = _score_arrays(settings, ("correct", "nll", "value"), len(items), reference)
    names = [name for name in settings if name not in reused]
    used = {_score_recall_item(scorer, items[i], i, names, scores) for i in _each_item(len(items), "passage recall", progress)}
    result = _answer_result(scores, _recorded(used), scorer.exact_layers(), num_bootstrap, seed)
    result["value_per_item"] = _lists(scores["value"])
    result["passage_value_chance"] = float(np.mean([1 / max(1, len(it.passage_values)) for it in items]))
    result["passage_value_rate"] = _summaries(scores["value"], num_bootstrap, seed)
    return result


def _score_recall_item(
    scorer: _Scorer, item: PassageRecallItem, i: int, names: Sequence[str], scores: dict[str, dict[str, np.ndarray]]
) -> int:
    """Scores item `i` in the settings `names` into `scores`; the prompt tokens the target recomputed."""
    if not item.answer_ids or not item.prompt_ids or not item.no_passage_prompt_ids:
        raise ValueError(f"item {i} has an empty prompt, no-passage prompt or answer")
    target = scorer.target
    prompt, alone = _ids(item.prompt_ids, target), _ids(item.no_passage_prompt_ids, target)
    r = min(scorer.recompute(prompt.shape[1]), prompt.shape[1])
    r_alone = min(scorer.recompute(alone.shape[1]), alone.shape[1])
    # Every setting reads its prompt into a cache once, then its model scores the candidates on top of it.
    def no_passage() -> tuple:
        return target, item.no_passage_prompt_ids[-r_alone:], _own_cache(target, alone, r_alone)

    runs = scorer.answer_runs(prompt, r, item.prompt_ids[-r:], no_passage)
    _score_answers(runs, names, item.answer_ids, item.passage_values, scores, i)
    return r


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
    grid: list | None = None,
    score_cell: Callable[[list, Callable[[], dict]], dict] | None = None,
    **recall_options: Any,
) -> dict[str, Any]:
    """Passage recall over a grid of context lengths x needle positions (`tasks.needle_grid`): where in a long
    context the transfer loses the content. `grid` is that grid where the caller built it already (`evaluate` does,
    before any task runs); `lengths`, `positions`, `items` and `distractor_texts` then go unused.

    Every cell asks the same facts (the positions of one length share their haystack), so cells differ only in
    length and depth. `recall_options` go to `passage_recall` (`num_recompute_tokens`, `num_exact_layers`, ...).
    `score_cell(items, compute)` gives each cell's result, `compute()` by default: `evaluate` reads cells an
    interrupted run finished back from its journal.

    Returns:
        `{"lengths", "positions", "items", "cells": [{"context_tokens", "position", "accuracy": {setting: {"mean",
        "ci"}}, "retention", "retention_ci", "gap_recovered", "gap_recovered_ci", "transfer_minus_own"}, ...]}`,
        cells in row-major order (lengths, then positions).
    """
    if grid is None:
        grid = needle_grid(tokenizer, lengths, positions, items, seed, distractor_texts=distractor_texts)
    keep = ("accuracy", "retention", "retention_ci", "retention_undefined", "gap_recovered", "gap_recovered_ci",
            "transfer_minus_own", "num_recompute_tokens", "num_exact_layers")  # fmt: skip

    def compute(cell: list) -> dict[str, Any]:
        res = passage_recall(source, target, mapper, cell, seed=seed, **recall_options)
        return {k: res.get(k) for k in keep}

    cells = []
    for length, position, cell in grid:
        res = compute(cell) if score_cell is None else score_cell(cell, lambda cell=cell: compute(cell))
        cells.append({"context_tokens": length, "position": position, **res})
    # The grid is the one record of what was scored (a caller's grid included).
    return {"lengths": list(dict.fromkeys(c["context_tokens"] for c in cells)),
            "positions": list(dict.fromkeys(c["position"] for c in cells)),
            "items": len(grid[0][2]) if grid else items, "cells": cells}


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
    scorer = _Scorer(source, target, mapper, num_recompute_tokens, num_exact_layers)
    answerer = source if source is not None else target
    q1 = np.zeros(len(items))
    scores, reused = _score_arrays(settings, ("correct", "nll"), len(items), reference)
    names = [name for name in settings if name not in reused]
    answers: list[list[int]] = []
    used = set()
    for i in _each_item(len(items), "hand-off", progress):
        answer1, r = _score_handoff_item(scorer, answerer, items[i], i, reference if reused else None, names, scores)
        answers.append(answer1)
        q1[i] = answer1 == list(items[i].answer1_ids)
        used.add(r)
    result = _answer_result(scores, _recorded(used), scorer.exact_layers(), num_bootstrap, seed)
    result["answerer"] = "source" if source is not None else "target"
    result["q1_accuracy"] = mean_and_ci(q1, num_bootstrap, seed)
    result["q1_correct_per_item"] = q1.tolist()
    result["answer1_per_item"] = answers
    return result


def _score_handoff_item(
    scorer: _Scorer, answerer: PreTrainedModel, item: HandoffItem, i: int, reference: dict[str, Any] | None,
    names: Sequence[str], scores: dict[str, dict[str, np.ndarray]],
) -> tuple[list[int], int]:
    """Item `i`: the answerer's answer to question 1 (`reference`'s, when reused), then question 2 scored in the
    settings `names` into `scores`; returns `(answer 1, the dialogue tokens the target recomputed)`."""
    if not (item.prompt_ids and item.answer1_ids and item.followup_ids and item.answer2_ids):
        raise ValueError(f"item {i} has an empty prompt, answer or followup")
    if reference is not None:
        answer1 = list(reference["answer1_per_item"][i])
    else:
        answer1 = _greedy_tokens(answerer, item.prompt_ids, len(item.answer1_ids))
    dialogue = item.prompt_ids + answer1  # what was said before the hand-off, the answerer's answer included
    r = min(scorer.recompute(len(dialogue)), len(dialogue))
    feed = dialogue[len(dialogue) - r :] + item.followup_ids
    runs = scorer.answer_runs(_ids(dialogue, scorer.target), r, feed, lambda: (scorer.target, item.followup_ids, None))
    _score_answers(runs, names, item.answer2_ids, [], scores, i)
    return answer1, r


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
    `cache=TransferredCache(prefill(source, input_ids), mapper, model=target)`. EOS is suppressed (`min_new_tokens`), so every
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
    scorer = _Scorer(source, target, mapper, num_recompute_tokens, num_exact_layers)
    input_ids, num_recompute_tokens = _agreement_prompts(scorer, input_ids, max_new_tokens)
    skipped = _rounding_skipped(target, reference_dtype)
    rounded = reference_dtype if skipped is None else None
    same, reference = _agreeing_tokens(scorer, input_ids, num_recompute_tokens, max_new_tokens, rounded, batch_size, progress)
    result: dict[str, Any] = {
        "num_prompts": input_ids.shape[0],
        "prompt_len": input_ids.shape[1],
        "max_new_tokens": max_new_tokens,
        "num_recompute_tokens": num_recompute_tokens,
        "num_exact_layers": scorer.exact_layers(),
        **_agreement(same, num_bootstrap, seed),
    }
    if reference_dtype is not None:
        result["reference"] = {"dtype": dtype_name(reference_dtype)}
        if skipped:
            result["reference"]["skipped"] = skipped
        else:
            result["reference"].update(_agreement(reference, num_bootstrap, seed))
    return result


def _rounding_skipped(target: PreTrainedModel, reference_dtype: torch.dtype | None) -> str | None:
    """Why rounding the target's cache to `reference_dtype` is no reference (it computes its cache in it), or None."""
    cache_dtype = target.get_input_embeddings().weight.dtype
    if reference_dtype is not None and reference_dtype == cache_dtype:
        return f"the target's cache is already {dtype_name(cache_dtype)}: rounding to it changes nothing"
    return None


def _agreement_prompts(
    scorer: _Scorer, input_ids: torch.Tensor | Sequence[Sequence[int]], max_new_tokens: int
) -> tuple[torch.Tensor, int]:
    """`(the prompts as one tensor, the prompt tokens the target recomputes)`; raises on what `generate` cannot run."""
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.ndim != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be [num_prompts, prompt_len] with >= 1 prompt, got shape {list(input_ids.shape)}")
    prompt_len = input_ids.shape[1]
    num_recompute_tokens = scorer.recompute(prompt_len)
    if not 1 <= num_recompute_tokens <= prompt_len:
        raise ValueError(
            f"num_recompute_tokens must be in [1, {prompt_len}] (generate feeds the target at least one prompt token), "
            f"got {num_recompute_tokens}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return input_ids, num_recompute_tokens


def _agreeing_tokens(
    scorer: _Scorer, input_ids: torch.Tensor, num_recompute_tokens: int, max_new_tokens: int,
    rounded: torch.dtype | None, batch_size: int, progress: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[num_prompts, max_new_tokens]` token equality of the target's greedy generations from its own prefill and
    from the transferred cache, and (with `rounded`, else None) from its own cache rounded to that dtype."""
    target, prompt_len = scorer.target, input_ids.shape[1]
    pad = target.generation_config.pad_token_id
    pad = pad if pad is not None else target.config.eos_token_id
    pad = pad[0] if isinstance(pad, (list, tuple)) else pad
    gen = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    same_rows, reference_rows = [], []
    for rows in _progress(_chunks(input_ids.shape[0], batch_size), input_ids.shape[0], "greedy agreement", progress,
                          unit="prompt"):  # fmt: skip
        ids = input_ids[rows.start : rows.stop].to(model_device(target))
        mask = torch.ones_like(ids)

        def generate(cache: DynamicCache | None) -> torch.Tensor:
            caches = {cache_argument(target): cache} if cache is not None else {}
            return target.generate(ids, attention_mask=mask, **caches, **gen)[:, prompt_len:]

        own = generate(None)
        transferred = generate(scorer.transferred(ids, num_recompute_tokens))
        same_rows.append((own == transferred).cpu())  # (B, max_new_tokens)
        if rounded is not None:
            reference = generate(_rounded(_own_cache(target, ids, num_recompute_tokens), rounded))
            reference_rows.append((own == reference).cpu())
    return torch.cat(same_rows), torch.cat(reference_rows) if rounded is not None else None


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
