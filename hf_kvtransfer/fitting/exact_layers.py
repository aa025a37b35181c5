"""How many of the target's first layers `TransferredCache` should compute itself: a content probe run by the fit.

A mapper can fit keys and values well on average (high R^2, high attention-output cosine) and still lose what the
context *said*: on the bundled family one target layer per direction carries copying and look-up (induction-like
heads whose keys encode the previous token) and its linear map does not reproduce it, so passage recall through the
transfer drops from 77% to chance while perplexity retention stays at 21-26%. The target's layers below and
including that one, computed from the prompt's ids (`num_exact_layers`), bring it back (small -> large: 4 of 8
layers, recall 98%).

The probe measures exactly that property on the fit's own held-out calibration tokens: spans of text repeated from
the prefix (`tasks.repeated_span_items`, kind "text"), scored as own prefill / transfer / first occurrence replaced
(`content_eval.repeated_span_retention`). It picks the fewest exact layers whose floor-normalized retention reaches
`min_retention`, by bisection over `1 .. num_layers` (it assumes computing more layers never loses content; the
whole target computed is its own prefill, retention 1 by construction, and is not run).

`choose_configuration` then searches maps that also read what the target's exact layers compute (the fit inputs'
candidates, `fit_inputs.py`: e.g. its residual stream) for a cheaper configuration: each must keep the repeated spans
and, on a second probe of look-ups by key (cued recall, `tasks.cued_recall_items`), not lose more than
`1 - min_retention` of what the source-only answer keeps, by a paired interval; with the content gate, passage recall
and hand-off too. The cheapest one that passes is recorded in the mapper.

Example:
    ```python
    num_exact, report = choose_num_exact_layers(small, large, mapper, heldout_ids)
    cache = TransferredCache(prefill(small, ids), mapper, num_exact_layers=num_exact, model=large)
    ```
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from ..core.defaults import DEFAULT_NUM_EXACT_LAYERS
from ..core.flops import exact_layers_flops, mapper_first_token, mapping_flops, prefill_flops
from ..core.mapper import KVMapper
from ..core.map_inputs import exact_layers_needed, maps_read
from ..core.options import with_options
from ..core.progress import progress_bar
from ..evaluation.content import repeated_span_retention
from ..evaluation.metrics import retention_difference
from ..evaluation.tasks import cued_recall_items, repeated_span_items
from .content_gate import ContentGate, gate_line, tolerance_points
from .fit_inputs import CandidateGroup, fit_input_of
from .probe_journal import ProbeJournal, scored

logger = logging.getLogger(__name__)

# Below this NLL drop (nats per repeated token) the target does not copy from its context: a model that does
# drops it by several nats (the bundled family: 8.6 and 8.8); a random-weight model by ~0.
MIN_COPY_GAIN = 0.25
# The probe's items: a repeated span of text inside a prefix, scored in a continuation (`repeated_span_items`).
PROBE_PREFIX_LEN = 256
PROBE_CONTINUATION_LEN = 64
# Cued recall scores one token per item (repeated spans: ~23): it takes this many times the items for a 95% interval
# of about +-5 points instead of +-10 (what the decision between two candidates needs).
CUED_ITEMS_FACTOR = 4
# Prompt tokens the probes leave to the target (the fewest `generate` allows): the rest of the prompt is transferred.
PROBE_RECOMPUTE_TOKENS = 1
# A candidate whose cued-recall comparison is undecided (its estimate within the allowed loss, its interval not) is
# scored on this many times the items again (new ones), once, and decided on all of them: a wider sample narrows the
# interval by about 1 / sqrt(1 + factor) instead of rejecting what the probe could not tell from a loss.
CUED_MORE_ITEMS_FACTOR = 2


def probe_stream(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[int]:
    """Calibration rows `[num_sequences, seq_len]` as one token stream (padding dropped)."""
    if attention_mask is not None:
        return [int(t) for row, mask in zip(input_ids, attention_mask) for t, m in zip(row, mask) if m]
    return input_ids.reshape(-1).tolist()


def probe_prefix_len(num_tokens: int) -> int | None:
    """The probe's prefix length for a stream of `num_tokens` (None: too short for any item)."""
    # `repeated_span_items` cuts each window and its text span from the stream: it needs 2 windows + a span.
    for prefix_len in (PROBE_PREFIX_LEN, PROBE_PREFIX_LEN // 2, PROBE_PREFIX_LEN // 4):
        if num_tokens >= 2 * (prefix_len + PROBE_CONTINUATION_LEN) + 24:
            return prefix_len
    return None


def choose_num_exact_layers(
    source: PreTrainedModel,
    target: PreTrainedModel,
    mapper: KVMapper,
    token_ids: list[int] | torch.Tensor,
    *,
    min_retention: float = 0.95,
    num_items: int = 64,
    prefix_len: int | None = None,
    seed: int = 0,
    progress: bool = False,
    journal: ProbeJournal | None = None,
) -> tuple[int | None, dict[str, Any]]:
    """The fewest target layers to compute exactly for `min_retention` of the target's copying from its context.

    Args:
        source, target, mapper: the pair and its mapper (any type).
        token_ids: held-out text tokens (a stream, or `[num_sequences, seq_len]` rows read in order) that the
            repeated spans and their windows are cut from.
        min_retention: floor-normalized repeated-span retention to reach (0.95: the project's goal).
        num_items: repeated spans scored per candidate.
        prefix_len: the items' prefix length (default: 256, or less for a short stream).
        journal: scores kept on disk (`probe_journal.ProbeJournal`): what an interrupted run scored is read back.

    Returns:
        `(num_exact_layers, report)`. `num_exact_layers` is None when the probe cannot decide (too few tokens, or
        the target does not copy from its context): the cache then uses `DEFAULT_NUM_EXACT_LAYERS`. The report
        has every candidate tried with its retention and 95% interval, the target's own copy gain, and the reason.
    """
    stream = probe_stream(token_ids) if isinstance(token_ids, torch.Tensor) else list(token_ids)
    num_layers = mapper.target_layout.num_layers
    report: dict[str, Any] = {
        "metric": "repeated-span retention (text spans of held-out calibration tokens; own / transfer / first "
        "occurrence replaced; 1 recomputed token)",
        "min_retention": min_retention,
        "num_items": num_items,
        "probe_tokens": len(stream),
        "tried": [],
        "chosen": None,
    }
    items, prefix_len = _screen_items(target, stream, num_items, seed, prefix_len)
    if items is None:
        report["reason"] = (
            f"{len(stream)} held-out tokens are too few for the probe (it needs "
            f"{2 * (PROBE_PREFIX_LEN // 4 + PROBE_CONTINUATION_LEN) + 24}); default {DEFAULT_NUM_EXACT_LAYERS} kept"
        )
        return None, report
    report["prefix_len"] = prefix_len

    hi = _probe_bisection(source, target, mapper, items, num_layers, min_retention, report, progress, journal)
    if hi is None:
        return None, report
    report["chosen"] = hi
    report["tried"].sort(key=lambda row: row["num_exact_layers"])
    report["reason"] = _num_exact_reason(hi, num_layers, min_retention)
    return hi, report


def _screen_items(target: PreTrainedModel, stream: list[int], num_items: int, seed: int,
                  prefix_len: int | None) -> tuple[list | None, int | None]:  # fmt: skip
    """The screen's repeated-span items cut from `stream` and their prefix length (None, None: too few tokens)."""
    prefix_len = prefix_len or probe_prefix_len(len(stream))
    if prefix_len is None:
        return None, None
    return repeated_span_items(
        target.config.get_text_config().vocab_size, stream, num_items, seed=seed, prefix_len=prefix_len,
        continuation_len=PROBE_CONTINUATION_LEN, kind="text",
    ), prefix_len  # fmt: skip


def _copies(gain: dict[str, Any]) -> bool:
    """Whether a target's copy gain on the screen's repeated spans (own vs first occurrence replaced) says it copies."""
    return gain["mean"] >= MIN_COPY_GAIN and gain["ci"][0] > 0


@torch.no_grad()
def target_copies(target: PreTrainedModel, token_ids: list[int] | torch.Tensor, *, num_items: int = 64,
                  prefix_len: int | None = None, seed: int = 0, journal: ProbeJournal | None = None) -> bool:  # fmt: skip
    """Whether the screen of `choose_num_exact_layers` (same arguments) will compare candidates: its stream is long
    enough and the target copies from its context on its items. It reads the target alone (no source, no mapper), so
    a fit can ask before its calibration pass; where it is False the fit keeps the default exact layers unjudged."""
    stream = probe_stream(token_ids) if isinstance(token_ids, torch.Tensor) else list(token_ids)
    items, _ = _screen_items(target, stream, num_items, seed, prefix_len)
    if items is None:
        return False
    own = scored(journal, "repeated spans", None, 0, items, lambda: repeated_span_retention(
        None, target, None, items, num_recompute_tokens=PROBE_RECOMPUTE_TOKENS, progress=False,
    ), recompute=PROBE_RECOMPUTE_TOKENS)  # fmt: skip
    return _copies(own["context_gain"])


def _num_exact_reason(num_exact: int, num_layers: int, min_retention: float) -> str:
    """Why the probe chose `num_exact` exact layers (logged as a warning when it is all of them)."""
    if num_exact != num_layers:
        return f"the fewest exact layers with retention >= {min_retention:.0%}"
    reason = (
        f"no mapped layer keeps {min_retention:.0%} of the copying short of computing all {num_layers}: the "
        "target computes its whole cache itself (no prefill saved; pass num_exact_layers to TransferredCache to "
        "trade content for speed)"
    )
    logger.warning("exact layers: %s", reason)
    return reason


def _probe_bisection(
    source: PreTrainedModel, target: PreTrainedModel, mapper: KVMapper, items: list, num_layers: int,
    min_retention: float, report: dict[str, Any], progress: bool, journal: ProbeJournal | None = None,
) -> int | None:
    """`_bisect` over the exact layers, each candidate scored on the repeated-span `items` (the target's own and
    no-context scores once: they do not depend on k) and added to `report["tried"]`, under one progress bar."""
    baseline: dict[str, Any] | None = None
    # One bar for the stage, one step per candidate (what each scored goes to the log at INFO).
    bar = progress_bar(total=_bisection_steps(num_layers), desc="exact-layers probe", unit="candidate", enabled=progress)

    def retention(k: int) -> float | None:
        nonlocal baseline
        r = scored(journal, "repeated spans", mapper, k, items, lambda: repeated_span_retention(
            source, target, mapper, items, num_recompute_tokens=PROBE_RECOMPUTE_TOKENS, num_exact_layers=k,
            progress=False, reference=baseline,
        ), recompute=PROBE_RECOMPUTE_TOKENS)  # fmt: skip
        if baseline is None:
            baseline = r
            report["copy_gain"] = r["context_gain"]
        report["tried"].append({"num_exact_layers": k, "retention": r["retention"], "retention_ci": r["retention_ci"]})
        logger.info("exact-layers probe: %d of %d layers exact: repeated-span retention %s", k, num_layers,
                    _percent(r["retention"], r["retention_ci"]))  # fmt: skip
        bar.update(1)
        return r["retention"]

    with bar:
        hi = _bisect(retention, num_layers, min_retention, report)
        bar.total = bar.n  # the bisection may stop before its most steps: the bar ends full
        bar.refresh()
    return hi


def _bisection_steps(num_layers: int) -> int:
    """The most candidates `_bisect` scores: the default, then halving `DEFAULT_NUM_EXACT_LAYERS .. num_layers`."""
    return 1 + math.ceil(math.log2(max(1, num_layers - DEFAULT_NUM_EXACT_LAYERS)))


def _bisect(
    retention: Callable[[int], float | None], num_layers: int, min_retention: float, report: dict[str, Any]
) -> int | None:
    """The fewest exact layers whose `retention(k)` reaches `min_retention`, by bisection (None, with the reason in
    `report`, when the target barely copies from its context: nothing to keep)."""
    first = retention(DEFAULT_NUM_EXACT_LAYERS)
    gain = report["copy_gain"]
    if first is None or not _copies(gain):
        report["reason"] = (
            f"the target barely copies from its context on the probe (NLL gain {gain['mean']:.3f} nats/token, "
            f"95% CI [{gain['ci'][0]:.3f}, {gain['ci'][1]:.3f}]; needs >= {MIN_COPY_GAIN}): there is no content to "
            f"keep; default {DEFAULT_NUM_EXACT_LAYERS} kept"
        )
        return None
    if first >= min_retention:
        return DEFAULT_NUM_EXACT_LAYERS

    def keeps(k: int) -> bool:
        value = retention(k)
        return value is not None and value >= min_retention

    return _first_passing(keeps, DEFAULT_NUM_EXACT_LAYERS, num_layers)


def _first_passing(passes: Callable[[int], bool], lo: int, hi: int) -> int:
    """The fewest exact layers in `lo + 1 .. hi` that `passes`, by bisection: `lo` is known to lose content, `hi`
    (all of them: the target's own prefill) to keep it, and more exact layers are taken never to lose it."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if passes(mid) else (mid, hi)
    return hi


def _gallop(passes: Callable[[int], bool], n: int) -> int | None:
    """The first of `0 .. n - 1` that `passes`, taking every one after a passing one to pass: tries 0, 1, 3, 7, ...
    (doubling) until one passes, then bisects between it and the last that failed (`_first_passing`): about
    2 log2(i + 1) tries where a scan from 0 takes i + 1. None when all tried fail (the last one is always tried)."""
    lo, probe = -1, 0
    while probe < n:
        if passes(probe):
            return _first_passing(passes, lo, probe)
        lo, probe = probe, (n if probe == n - 1 else min(2 * probe + 1, n - 1))
    return None


def _gallop_steps(n: int) -> int:
    """The most tries `_gallop` makes over `n`: the doubling ones, then the bisection's."""
    doubling = math.floor(math.log2(n)) + 2 if n > 1 else n
    return doubling + max(0, math.ceil(math.log2(max(1, (n + 1) // 2))))


def _percent(value: float | None, ci: Sequence[float] | None) -> str:
    """`97% [93, 101]` (a retention and its 95% interval), or n/a."""
    if value is None:
        return "n/a"
    return f"{value:.0%}" + (f" [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]" if ci else "")


# -- the search over configurations: exact layers x map inputs, by retention and time to the first token ---------

# Timing rounds of the candidates: each round times every candidate once, then the target's own prefill. The figures
# are reported (the frontier's speed-ups); they decide nothing: the choice is by `configuration_cost`.
TIMING_ROUNDS = 5


def _clock(target: PreTrainedModel) -> str:
    """The clock the choice is made by: process CPU time on CPU (one thread: what the transfer computed, not the
    time it waited for a core while other processes ran), wall time on an accelerator (there the host's CPU time is
    only a share of the work)."""
    return "cpu" if next(target.parameters()).device.type == "cpu" else "wall"


def _time_candidates(
    source, target, configs: Sequence[tuple[KVMapper, int]], ids: torch.Tensor, rounds: int = TIMING_ROUNDS,
    measure_own: bool = True,
) -> tuple[list[dict[str, list[float]]], dict[str, list[float]]]:
    """Per-round milliseconds, `{"wall": [...], "cpu": [...]}`, of each `(mapper, num_exact_layers)`'s time to the
    first token and of the target's own prefill (empty lists without `measure_own`), one thread, timed in
    interleaved rounds: a load that comes and goes while the fit times (a shared machine) falls on every candidate
    alike instead of on whichever was timed then, and round i of two candidates can be compared as a pair."""
    from ..evaluation.timing import time_to_first_token

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the figure of one core, comparable across machines' core counts and loads
    transfer: list[dict[str, list[float]]] = [{"wall": [], "cpu": []} for _ in configs]
    own: dict[str, list[float]] = {"wall": [], "cpu": []}
    try:
        for _ in range(rounds):
            for i, (mapper, num_exact) in enumerate(configs):
                first = measure_own and i == 0
                t = time_to_first_token(source, target, mapper, ids, num_exact_layers=num_exact, repeats=1, measure_own=first)
                transfer[i]["wall"].append(t["transfer_ms"])
                transfer[i]["cpu"].append(t["transfer_cpu_ms"])
                if first:
                    own["wall"].append(t["target_prefill_ms"])
                    own["cpu"].append(t["target_prefill_cpu_ms"])
    finally:
        torch.set_num_threads(threads)
    return transfer, own


def _timing_row(times: dict[str, list[float]], own: dict[str, list[float]], clock: str) -> dict[str, Any]:
    """A candidate's medians by `clock` (and the wall clock's beside CPU time's), with the speed-up they give."""
    ms, own_ms = statistics.median(times[clock]), statistics.median(own[clock])
    row = {"transfer_ms": ms, "target_prefill_ms": own_ms, "speedup": own_ms / ms, "timing_rounds": len(times[clock])}
    if clock != "wall":
        row.update(transfer_wall_ms=statistics.median(times["wall"]), target_prefill_wall_ms=statistics.median(own["wall"]))
    return row


def configuration_cost(target: PreTrainedModel, mapper: KVMapper, num_exact: int, seq_len: int) -> dict[str, int]:
    """Multiply-adds per prompt token to the first token of a `seq_len`-token prompt at a configuration: the exact
    layers (a causal prefill's attention; the last one up to its keys and values) and the maps of the other layers
    with what their inputs add (a table of rows by token id is a look-up and costs none), counted by `core.flops` as
    `hf-kvtransfer bench` and `plan` count them. A count from the shapes alone, the same on every machine and under
    any load: what the fit orders the configurations that keep the content by. The recomputed tokens cost every
    configuration the same and are left out.

    Returns:
        `{"exact_layers", "maps", "total"}`; `num_exact` equal to the target's layers is its own prefill.
    """
    if num_exact >= len(getattr(target, "base_model", target).layers):
        exact, maps = prefill_flops(target.config, seq_len)["total"], 0
    else:
        exact, maps = exact_layers_flops(target.config, seq_len, num_exact), mapping_flops(mapper, seq_len, num_exact)
    per_token = 2 * seq_len
    return {"exact_layers": exact // per_token, "maps": maps // per_token, "total": (exact + maps) // per_token}


# A mapper whose default transfer costs the first token more than this share of the target's own prefill (FLOPs:
# exact layers, maps and recomputed tokens, before each forward's fixed costs) is reported as saving little.
# The prompt length it is judged at: the fit's default calibration sequences.
LITTLE_SAVED = 0.5
LITTLE_SAVED_TOKENS = 1024


def little_saved(mapper: KVMapper, seq_len: int = LITTLE_SAVED_TOKENS) -> str | None:
    """One line saying that `mapper`'s default transfer (`core.flops.mapper_first_token`: its exact layers and window,
    the cache's recomputed tokens) costs the first token of a `seq_len`-token prompt more than `LITTLE_SAVED` of the
    target's own prefill, None when it costs less: the content needed most of the target computed exactly (a target
    that reads its context only in its top layers), and the user should time it before deploying it. None too when
    every layer is exact: the fit's choice already says that the target computes its whole cache itself."""
    layers, num_exact = mapper.target_layout.num_layers, mapper.num_exact_layers
    if num_exact >= layers:
        return None
    flops = mapper_first_token(mapper, (seq_len,))[seq_len]
    share = flops["total"] / flops["own_prefill"]
    if share <= LITTLE_SAVED:
        return None
    return (f"keeping the context needs {num_exact} of {layers} target layers computed exactly, so a transfer does "
            f"{share:.0%} of the target's own prefill's FLOPs to the first token of a {seq_len}-token prompt: this "
            "mapper saves little over the target's own prefill; time it with `hf-kvtransfer bench` before deploying it")


def _gate_source_only(gate: ContentGate | None, mapper: KVMapper, first: int | None, num_layers: int,
                      rows: list[dict[str, Any]]) -> int | None:
    """The fewest exact layers from `first` on whose source-only transfer the gate accepts (`num_layers`, the
    target's own prefill, when none is), by `_first_passing` as the screen: about log2(num_layers - first) verdicts
    instead of one per count. Each judged row of `rows` gets its `gate` verdict."""
    if gate is None or first is None:
        return first

    def accepted(k: int) -> bool:
        verdict = gate.judge(mapper, k)
        row = next((r for r in rows if r["num_exact_layers"] == k), None)
        if row is None:
            row = {"inputs": maps_read(mapper.config), "num_exact_layers": k, "retention": None, "retention_ci": None,
                   "passes": True}  # fmt: skip
            rows.append(row)
        row["gate"] = verdict
        logger.info("content gate, %d exact, source K/V: %s", k, gate_line(verdict))
        return bool(verdict["accepted"])

    if first >= num_layers or accepted(first):
        return first
    return _first_passing(accepted, first, num_layers)


@dataclasses.dataclass(frozen=True)
class ProbeOptions:
    """The options of `choose_configuration` (each one also accepted as a keyword of `choose_configuration`).

    Attributes:
        min_retention, num_items, prefix_len, seed, progress: the repeated-span screen's, as in
            `choose_num_exact_layers`.
        timing_tokens: the probe tokens each tried candidate is timed on (for the report).
        refine: turns each candidate reading a map input into the one that is probed (see `choose_configuration`).
        gate: the `content_gate.ContentGate` that decides (None: the screen decides).
        journal: scores kept on disk (`probe_journal.ProbeJournal`, the fit's: beside its calibration checkpoint),
            so a rerun after an interruption reads back what was scored (the gate takes its own: `ContentGate(...,
            journal=)`).
    """

    min_retention: float = 0.95
    num_items: int = 64
    prefix_len: int | None = None
    timing_tokens: int = 512
    refine: Callable[[KVMapper], KVMapper] | None = None
    gate: ContentGate | None = None
    seed: int = 0
    progress: bool = False
    journal: ProbeJournal | None = None


def choose_configuration(
    source: PreTrainedModel,
    target: PreTrainedModel,
    mapper: KVMapper,
    token_ids: list[int] | torch.Tensor,
    options: ProbeOptions | None = None,
    *,
    candidates: Mapping[Any, KVMapper] | Sequence[KVMapper] | None = None,
    **keywords: Any,
) -> tuple[KVMapper, dict[str, Any]]:
    """The cheapest configuration (exact layers x map inputs) that keeps what `eval` measures of the content.

    `options` (`ProbeOptions`, in `hf_kvtransfer.fitting.exact_layers`; each field may be given as a keyword instead,
    `gate=...`): `min_retention`, `num_items`, `prefix_len`, `seed` and `progress` as in `choose_num_exact_layers`,
    and `timing_tokens`, `refine` and `gate` as below.

    Candidates: `mapper` (source K/V only) with the exact layers `choose_num_exact_layers` finds, and each of
    `candidates` (mappers whose maps also read a map input that the exact layers compute, from its fit input's
    `FitInput.candidates`, e.g. `residual_stats.residual_variants`: maps reading the target's residual entering its
    layer J; a dict or a list) with the exact layers their inputs need (`map_inputs.exact_layers_needed`: J + 1).
    An item may also be a group of them (`fit_inputs.CandidateGroup`, what a fit input hands): it is solved only when
    the search reaches its count, so the maps of counts the search never tries cost nothing.

    Two stages decide whether a candidate keeps the content:

    - a screen on the held-out calibration tokens: repeated spans (`tasks.repeated_span_items`, retention >=
      `min_retention`) and, for the other candidates, cued recall (`tasks.cued_recall_items`: the paired 95% interval
      of its retention minus the source-only answer's must rule out a loss of more than `1 - min_retention`;
      undecided ones are scored once more on `CUED_MORE_ITEMS_FACTOR` times the items);
    - with `gate` (`content_gate.ContentGate`: passage recall and hand-off, the tasks `eval` reports, on probe-split
      items that `eval` does not use, paired against the target's own answers), the decision: a candidate is kept
      only if the lower end of the paired 95% interval of (candidate - own) accuracy is above `-gate.tolerance` on
      each task. The source-only answer is gated too, from the screen's number of exact layers upward, until one is
      accepted (all of them: the target's own prefill), by bisection. Without a gate the screen decides.

    Candidates are searched by the exact layers they need, up to the source-only answer's (more would compute more of
    the target). The count searched is the fewest whose first (given, fullest) candidate passes, found by galloping
    (`_gallop`: the 1st, 2nd, 4th, 8th, ... of the counts until one passes, then bisection below it) with only each
    count's first candidate scored, taking more exact layers never to lose content (as the source-only answer's
    bisection does): about 2 log2 of the counts where a scan from the fewest scores every one below the answer. A
    passing count above it that the search tried is set aside (`set_aside` in its row), and the rest of a count
    whose first candidate fails are skipped (they read less). The rest of the searched count are tried cheapest
    first (a full-rank one with its reduced-rank twins, at the cheapest of their places; a reduced-rank one whose
    full-rank twin (`FitInput.twin`: same layer, sources and readers) failed is skipped), and those that cost no
    less than a kept one of the count are skipped (without a `refine`, which changes the costs): the choice below
    is the one that scoring all of that count's candidates makes.

    Of the kept candidates the one with the least `configuration_cost` (multiply-adds per token from the shapes:
    exact layers and maps) is chosen, a tie going to the one with more exact layers; when the source-only answer is
    the whole target, a candidate must also cost less than the target's own prefill. Nothing in the decision is
    timed, so two runs with the same seed choose alike on any machine under any load. Each tried candidate is still
    timed to the first token for the report (`evaluation.timing.time_to_first_token`, one thread, the first
    `timing_tokens` probe tokens, medians of `TIMING_ROUNDS` interleaved rounds, process CPU time on CPU).

    `refine`, when given, turns each of `candidates` into the one that is probed, timed and possibly chosen,
    just before it is probed (the caller's: `fit_mapper(..., refine=...)`, e.g. more map inputs fit on what its
    maps miss); skipped candidates are never refined.

    Returns:
        `(mapper, report)`: the chosen mapper with its `num_exact_layers` recorded, and the probe's report with
        `candidates` (the frontier: one row per candidate with inputs, exact layers, both screen retentions and their
        95% intervals, the gate's verdict, whether it passes, its cost, transfer and prefill milliseconds, speed-up,
        chosen) besides `choose_num_exact_layers`' keys.
    """
    o = with_options(ProbeOptions, options, keywords, "choose_configuration")
    stream = probe_stream(token_ids) if isinstance(token_ids, torch.Tensor) else list(token_ids)
    chosen_kv, report = choose_num_exact_layers(
        source, target, mapper, stream, min_retention=o.min_retention, num_items=o.num_items, prefix_len=o.prefix_len,
        seed=o.seed, progress=o.progress, journal=o.journal,
    )  # fmt: skip
    num_layers = mapper.target_layout.num_layers
    if report.get("prefix_len") is None or report.get("copy_gain") is None or "barely copies" in report.get("reason", ""):
        return _with_num_exact(mapper, chosen_kv), report  # nothing to compare on: the source-only answer
    report["gate"] = _gate_settings(o.gate)
    source_rows, faithful_kv = _source_only_rows(mapper, chosen_kv, num_layers, o, report)
    rows, candidates = _InputSearch(source, target, mapper, stream, report, o).run(
        candidates, faithful_kv, num_layers, o.progress
    )
    rows[:0] = source_rows
    candidates[:0] = [(mapper, row["num_exact_layers"]) for row in source_rows]
    ids = torch.tensor(stream[: min(o.timing_tokens, len(stream))]).unsqueeze(0)
    best = _pick_cheapest(target, rows, candidates, faithful_kv, num_layers, int(ids.shape[-1]), o.gate is not None, report)
    _time_rows(source, target, rows, candidates, ids, num_layers, report)
    report["candidates"] = rows
    if best is None:
        report["chosen"] = faithful_kv
        reason = _source_only_reason(rows, o.gate, faithful_kv, num_layers)
        if reason is not None:
            report["reason"] = reason
        return _with_num_exact(mapper, faithful_kv), report
    chosen_mapper, num_exact = candidates[best]
    report["chosen"] = num_exact
    report["chosen_inputs"] = rows[best]["inputs"]
    kept = (f"passage recall and hand-off within {tolerance_points(o.gate.tolerance)} of the target's own answers (paired 95% "
            "interval, probe items)") if o.gate is not None else f"repeated-span retention >= {o.min_retention:.0%}"  # fmt: skip
    report["reason"] = f"the cheapest configuration (multiply-adds per token to the first token) that keeps {kept}"
    return _with_num_exact(chosen_mapper, num_exact), report


def _source_only_rows(
    mapper: KVMapper, chosen_kv: int | None, num_layers: int, o: ProbeOptions, report: dict[str, Any]
) -> tuple[list[dict[str, Any]], int | None]:
    """The source-only answer's rows (each exact-layer count the screen tried, and those the gate judged) and its
    exact layers: the screen's `chosen_kv`, or with a gate the fewest from there on that it accepts."""
    source_rows = [{"inputs": maps_read(mapper.config), **row,
                    "passes": row["retention"] is not None and row["retention"] >= o.min_retention}
                   for row in report["tried"]]  # fmt: skip
    faithful_kv = _gate_source_only(o.gate, mapper, chosen_kv, num_layers, source_rows)
    if faithful_kv != chosen_kv:
        report["screen_chosen"] = chosen_kv
    source_rows.sort(key=lambda row: row["num_exact_layers"])
    return source_rows, faithful_kv


def _source_only_reason(
    rows: list[dict[str, Any]], gate: ContentGate | None, faithful_kv: int | None, num_layers: int
) -> str | None:
    """Why the source-only answer stays when no candidate is chosen (None: the screen's reason stands)."""
    if any(row.get("not_cheaper_than_own_prefill") for row in rows):
        return ("the candidates that keep the content cost no less than the target's own prefill: the "
                f"target computes its whole cache itself (all {num_layers} layers exact)")  # fmt: skip
    if gate is not None and faithful_kv is not None and faithful_kv >= num_layers:
        return (f"no mapped configuration keeps passage recall and hand-off within {tolerance_points(gate.tolerance)} of "
                f"the target's own answers: the target computes its whole cache itself (all {num_layers} "
                "layers exact)")  # fmt: skip
    if gate is not None and faithful_kv is not None:
        return (f"the fewest exact layers whose source-only transfer keeps passage recall and hand-off "
                f"within {tolerance_points(gate.tolerance)} of the target's own answers (paired 95% interval)")  # fmt: skip
    return None


def _gate_settings(gate: ContentGate | None) -> dict[str, Any]:
    if gate is None:
        return {"used": False, "why": "no tokenizer given: the recall and hand-off items cannot be built; the screen decides"}
    return {"used": True, "tasks": ["passage recall", "hand-off"], "split": "probe", "tolerance": gate.tolerance,
            "items": gate.num_items, "max_items": gate.max_items, "seed": gate.seed,
            "rule": "kept when the lower end of the paired 95% bootstrap interval of (candidate - target own) accuracy "
                    "is above -tolerance on each task"}  # fmt: skip


def _pick_cheapest(target, rows, candidates, faithful_kv, num_layers, seq_len, gated, report) -> int | None:
    """The index of the kept candidate with the least `configuration_cost` (ties: more exact layers), None when the
    source-only answer stays (no candidate cheaper than it, or none kept); every row gets its `cost`."""
    own = configuration_cost(target, candidates[0][0], num_layers, seq_len)["total"]
    kept = []
    for i, (row, (m, n)) in enumerate(zip(rows, candidates)):
        row["chosen"] = False
        if m is None:  # a group never solved
            row["cost"] = row["cost_vs_own_prefill"] = None
            continue
        row["cost"] = configuration_cost(target, m, n, seq_len)
        row["cost_vs_own_prefill"] = row["cost"]["total"] / own
        ok = row["passes"] and not row.get("skipped") and not row.get("set_aside") and n < num_layers
        if gated:
            ok = ok and bool(row.get("gate", {}).get("accepted"))
        elif row.get("extends") is None:
            ok = ok and n == faithful_kv
        if ok and faithful_kv is not None and faithful_kv >= num_layers and row["cost"]["total"] >= own:
            row["not_cheaper_than_own_prefill"] = True
            ok = False
        if ok:
            kept.append(i)
    if not kept:
        return None
    best = min(kept, key=lambda i: (rows[i]["cost"]["total"], -candidates[i][1]))
    rows[best]["chosen"] = True
    return best


def _time_rows(source, target, rows, candidates, ids, num_layers, report) -> None:
    """Times every tried candidate to the first token (the report's speed-ups; the choice does not read them)."""
    timed = [i for i, (row, (_, n)) in enumerate(zip(rows, candidates)) if not row.get("skipped") and n < num_layers]
    clock = _clock(target)
    times: dict[int, dict[str, list[float]]] = {}
    own: dict[str, list[float]] = {}
    if timed:
        per_candidate, own = _time_candidates(source, target, [candidates[i] for i in timed], ids)
        times = dict(zip(timed, per_candidate))
    report["timing"] = {"num_tokens": int(ids.shape[-1]), "threads": 1, "rounds": TIMING_ROUNDS, "interleaved": True,
                        "clock": "process CPU time" if clock == "cpu" else "wall", "decides": False,
                        "num_recompute_tokens": "per candidate (None: TransferredCache's default)"}  # fmt: skip
    for i, (row, (m, _)) in enumerate(zip(rows, candidates)):
        row.update(_timing_row(times[i], own, clock) if i in times else
                   {"transfer_ms": None, "target_prefill_ms": None, "speedup": None if row.get("skipped") else 1.0})  # fmt: skip
        # None: TransferredCache's default, or a group never solved
        row["num_recompute_tokens"] = None if m is None else m.config.num_recompute_tokens


class _InputSearch:
    """The screen (repeated spans, then cued recall against the source-only answer) and gate of the candidates reading
    a map input the exact layers compute (`fit_inputs.py`)."""

    def __init__(self, source, target, mapper, stream, report, options: ProbeOptions):
        self.source, self.target, self.mapper, self.stream, self.report = source, target, mapper, stream, report
        self.gate, self.min_retention, self.num_items = options.gate, options.min_retention, options.num_items
        self.refine, self.seed, self.journal = options.refine, options.seed, options.journal
        self.cost_tokens = min(options.timing_tokens, len(stream))  # the choice's `configuration_cost` length
        self.references: dict[str, Any] = {}
        self.more_cued = self.more_reference = self.cued_reference = None
        self.step = 0  # candidates scored or skipped so far (the log numbers them)

    def probe(self, name: str, items, m: KVMapper, num_exact: int) -> dict[str, Any]:
        logger.debug("configuration probe (%s, %d items): %d exact, %s", name, len(items), num_exact, maps_read(m.config))
        r = scored(self.journal, name, m, num_exact, items, lambda: repeated_span_retention(
            self.source, self.target, m, items, num_recompute_tokens=PROBE_RECOMPUTE_TOKENS, num_exact_layers=num_exact,
            progress=False, reference=self.references.get(name),
        ), recompute=PROBE_RECOMPUTE_TOKENS)  # fmt: skip
        self.references.setdefault(name, r)
        return r

    def run(self, given, faithful_kv: int | None, num_layers: int, progress: bool):
        """`(rows, candidates)` in the given order by exact layers (the choice's tie-break reads it). The count whose
        candidates are searched is the fewest whose first (fullest) candidate passes, found by `_gallop` over the
        counts up to the source-only answer's, scoring that first candidate only; then each tried count's other
        candidates are scored or skipped in `probe_order`'s order (`candidate`'s rules: the rest of a failed count
        and of a count above a passing one are skipped). A group of them (`fit_inputs.CandidateGroup`) is solved
        when its count is tried; an untried count leaves it unsolved: one row, skipped, candidate None."""
        by_count = _by_count(given)
        if not by_count:
            return [], []
        self.references_for(faithful_kv, num_layers)
        state = {"seen": set(), "failed": set(), "passed": set(), "failed_full_rank": set(), "cheapest_kept": {}}
        tried = self.gallop(by_count, state, progress)
        rows: list[dict[str, Any]] = []
        candidates: list[tuple[KVMapper | None, int]] = []
        for n in sorted(by_count):
            if n in tried:
                count_rows, count_candidates, order = tried[n]
                self.score(count_rows, count_candidates, order[1:], state)
            else:
                count_rows = [{**_row(item, n), "skipped": self.untried(n, state)} for item in by_count[n]]
                count_candidates = [(item if isinstance(item, KVMapper) else None, n) for item in by_count[n]]
            rows += count_rows
            candidates += count_candidates
        _set_aside(rows, state["passed"])
        aside = sorted({row["num_exact_layers"] for row in rows if row.get("set_aside")})
        if aside:
            logger.info("configuration probe: passing candidates at %s exact layers set aside (%d keep the content)",
                        _spans(aside), min(state["passed"]))  # fmt: skip
        for line in _skipped_lines(rows):
            logger.info("configuration probe: %s", line)
        return rows, candidates

    def gallop(self, by_count, state: dict[str, Any], progress: bool) -> dict[int, tuple[list, list, list[int]]]:
        """`_gallop` over the counts `count_skip` allows, scoring each tried count's first candidate in `probe_order`:
        `{count: (rows, candidates, probe order)}` of the counts tried (their groups solved)."""
        counts = [n for n in sorted(by_count) if self.count_skip(n, state) is None]
        tried: dict[int, tuple[list, list, list[int]]] = {}
        # One step per count tried; a count probed takes minutes, so no time-left estimate.
        bar = progress_bar(total=_gallop_steps(len(counts)), desc="configuration probe", unit="exact-layer counts",
                           enabled=progress, estimate=False)  # fmt: skip

        def first_passes(i: int) -> bool:
            n = counts[i]
            solved = [m for item in by_count[n] for m in _solved(item, n)]
            rows, candidates = [_row(m, n) for m in solved], [(m, n) for m in solved]
            order = self.probe_order(candidates, list(range(len(rows))))
            tried[n] = (rows, candidates, order)
            self.score(rows, candidates, order[:1], state)
            bar.update(1)
            return n in state["passed"]

        with bar:
            _gallop(first_passes, len(counts))
            bar.total = bar.n  # the search may stop before its most steps: the bar ends full
            bar.refresh()
        return tried

    def score(self, rows, candidates, indices: list[int], state: dict[str, Any]) -> None:
        """Scores (or skips, by `candidate`'s rules) one count's candidates at `indices`, in that order, each on one
        line of the log (a skipped one at DEBUG: the summary counts them)."""
        for i in indices:
            m, n = candidates[i]
            row = rows[i]
            try:
                rank = None if self.refine is not None else (self.cost(m, n), i)  # a refine changes the cost
                candidates[i] = (self.candidate(m, row, state, rank=rank), n)
            finally:
                self.step += 1
                level = logging.DEBUG if row.get("skipped") else logging.INFO
                logger.log(level, "configuration probe, candidate %d: %s", self.step, _row_line(row))

    def untried(self, num_exact: int, state: dict[str, Any]) -> str:
        """Why the search never tried a count (`count_skip`'s reasons, or below a count whose first candidate failed)."""
        skip = self.count_skip(num_exact, state)
        if skip is not None:
            return skip
        return "a candidate with more exact layers failed the probe (fewer compute less of the target)"

    def references_for(self, faithful_kv: int | None, num_layers: int) -> None:
        """The probe's items (repeated spans, cued recall) and the source-only answer's cued-recall scores, which each
        candidate is paired against."""
        report, prefix_len = self.report, self.report["prefix_len"]
        self.spans = repeated_span_items(self.target.config.get_text_config().vocab_size, self.stream, self.num_items,
                                         seed=self.seed, prefix_len=prefix_len, continuation_len=PROBE_CONTINUATION_LEN,
                                         kind="text")  # fmt: skip
        # Records of 8 + 4 + 2 tokens (key, cue, value), at most 4, in the probe's prefix.
        self.num_records = max(2, min(4, prefix_len // 14))
        self.cued = cued_recall_items(self.stream, CUED_ITEMS_FACTOR * self.num_items, seed=self.seed, prefix_len=prefix_len,
                                      num_records=self.num_records, continuation_len=PROBE_CONTINUATION_LEN)  # fmt: skip
        self.faithful_kv = faithful_kv
        if faithful_kv is not None and faithful_kv < num_layers:
            ref = self.probe("cued recall", self.cued, self.mapper, faithful_kv)
            self.cued_reference = ref["nll_per_item"]["transfer"]
            report["cued_reference"] = {"num_exact_layers": faithful_kv, "retention": ref["retention"], "retention_ci": ref["retention_ci"]}
        else:  # the source-only answer is the target's own prefill: retention 1
            report["cued_reference"] = {"num_exact_layers": num_layers, "retention": 1.0, "retention_ci": None}
        report["cued_max_loss"] = 1 - self.min_retention

    def count_skip(self, num_exact: int, state: dict[str, Any]) -> str | None:
        """Why no candidate needing `num_exact` exact layers is scored any more, whatever its maps (None: they may be)."""
        if any(passed < num_exact for passed in state["passed"]):
            return "a candidate with fewer exact layers passed (more compute more of the target)"
        if self.faithful_kv is not None and num_exact > self.faithful_kv:
            return f"more exact layers than the source-only answer's {self.faithful_kv} (more of the target computed)"
        return None

    def cost(self, m: KVMapper, num_exact: int) -> int:
        return configuration_cost(self.target, m, num_exact, self.cost_tokens)["total"]

    def probe_order(self, candidates: list[tuple[KVMapper, int]], indices: list[int]) -> list[int]:
        """`indices` (one count's candidates, in the given order) in the order they are scored: the first (fullest),
        then the others cheapest first (`configuration_cost`), a full-rank one with its reduced-rank twins
        (`FitInput.twin`), whose failure skips them, at the cheapest of their places. Once one passes, the count's
        dearer rest are skipped: the choice is the cheapest kept one, and they could not be chosen. A `refine`
        changes the costs: then the given order, and none skipped so."""
        if self.refine is not None or not indices:
            return indices
        first, *rest = indices
        cost = {i: self.cost(*candidates[i]) for i in rest}
        twin = {i: _twin(candidates[i][0]) for i in rest}
        place = dict(cost)
        for i in rest:  # a full-rank candidate takes the cheapest place of its reduced-rank twins
            if not twin[i][1]:
                place[i] = min([cost[i]] + [cost[j] for j in rest if twin[j] == (twin[i][0], True)])
        by_place = sorted(rest, key=lambda i: (place[i], i))
        return [first, *_after_full_rank_twins(by_place, [twin[i] for i in by_place])]

    def candidate(self, m: KVMapper, row: dict[str, Any], state: dict[str, Any], rank: tuple[int, int] | None = None) -> KVMapper:
        """Scores (or skips) one candidate; `rank`: its (cost, given place), by which a kept one of its count that
        ranks before it skips it (None: never skipped so)."""
        num_exact = row["num_exact_layers"]
        twin, reduced = _twin(m)
        skip = None
        if num_exact in state["failed"]:
            skip = "the first candidate with these exact layers failed the probe"
        elif rank is not None and rank > state["cheapest_kept"].get(num_exact, rank):
            skip = "a candidate with these exact layers that costs no more passed"
        else:
            skip = self.count_skip(num_exact, state)
        if skip is None and reduced and twin in state["failed_full_rank"]:
            skip = "the same maps at full rank failed the probe (a reduced rank keeps less)"
        if skip:
            row["skipped"] = skip
            return m
        if self.refine is not None:
            m = self.refine(m)
            row["inputs"] = maps_read(m.config)
        r = self.probe("repeated spans", self.spans, m, num_exact)
        row.update(retention=r["retention"], retention_ci=r["retention_ci"])
        if r["retention"] is not None and r["retention"] >= self.min_retention:
            row["passes"] = self.cued_passes(m, num_exact, row)
        if row["passes"] and self.gate is not None:
            row["gate"] = self.gate.judge(m, num_exact)
            row["passes"] = row["gate"]["accepted"]
        if not row["passes"] and num_exact not in state["seen"]:
            state["failed"].add(num_exact)
        if not row["passes"] and not reduced:
            state["failed_full_rank"].add(twin)
        if row["passes"] and rank is not None:
            kept = state["cheapest_kept"]
            kept[num_exact] = min(kept.get(num_exact, rank), rank)
        state["seen"].add(num_exact)
        if row["passes"]:
            state["passed"].add(num_exact)
        return m

    def cued_passes(self, m: KVMapper, num_exact: int, row: dict[str, Any]) -> bool:
        """Whether the paired cued-recall interval rules out losing more than `1 - min_retention` of the reference's."""
        max_loss = 1 - self.min_retention
        c = self.probe("cued recall", self.cued, m, num_exact)
        nll = c["nll_per_item"]
        diff = retention_difference(nll["own"], nll["no_context"], nll["transfer"], self.cued_reference,
                                    higher_is_better=False, seed=self.seed)  # fmt: skip
        row.update(cued_retention=c["retention"], cued_retention_ci=c["retention_ci"], cued_items=len(self.cued))
        if _undecided(diff, max_loss):
            if self.more_cued is None:
                self.more_cued = cued_recall_items(self.stream, CUED_MORE_ITEMS_FACTOR * len(self.cued), seed=self.seed + 1,
                                                   prefix_len=self.report["prefix_len"], num_records=self.num_records,
                                                   continuation_len=PROBE_CONTINUATION_LEN)  # fmt: skip
                if self.cued_reference is not None:
                    self.more_reference = self.probe("cued recall, more items", self.more_cued, self.mapper,
                                                     self.faithful_kv)["nll_per_item"]["transfer"]  # fmt: skip
            more = self.probe("cued recall, more items", self.more_cued, m, num_exact)["nll_per_item"]
            nll = {k: list(nll[k]) + list(more[k]) for k in ("own", "no_context", "transfer")}
            reference = None if self.cued_reference is None else list(self.cued_reference) + list(self.more_reference)
            diff = retention_difference(nll["own"], nll["no_context"], nll["transfer"], reference, higher_is_better=False,
                                        seed=self.seed)  # fmt: skip
            row["cued_items"] = len(self.cued) + len(self.more_cued)
        row.update(cued_minus_reference=diff["difference"], cued_minus_reference_ci=diff["difference_ci"])
        low = (diff["difference_ci"] or [None])[0]
        return low is not None and math.isfinite(low) and low >= -max_loss


def _by_count(given) -> dict[int, list[KVMapper | CandidateGroup]]:
    """`choose_configuration`'s `candidates` (mappers or groups of them, a dict or a list) by the exact layers they
    need, each count's in the given order."""
    by_count: dict[int, list[KVMapper | CandidateGroup]] = {}
    for item in given.values() if isinstance(given, Mapping) else given or []:
        n = item.num_exact_layers if isinstance(item, CandidateGroup) else exact_layers_needed(item.config)[0]
        by_count.setdefault(n, []).append(item)
    return by_count


def _solved(item: KVMapper | CandidateGroup, num_exact: int) -> list[KVMapper]:
    """The mappers of a candidate or group, each checked to need the group's exact layers."""
    if isinstance(item, KVMapper):
        return [item]
    mappers = item.solve()
    for m in mappers:
        needed = exact_layers_needed(m.config)[0]
        if needed != num_exact:
            raise ValueError(f"a {item.extends} candidate group of {num_exact} exact layers solved maps that need "
                             f"{needed} ({maps_read(m.config)}): its num_exact_layers must be what its maps need")  # fmt: skip
    return mappers


def _row(item: KVMapper | CandidateGroup, num_exact: int) -> dict[str, Any]:
    """A candidate's row in the probe's report before it is scored (a group not solved: its own fields)."""
    if isinstance(item, CandidateGroup):
        what = {"extends": item.extends, **item.fields, "solved": False}
    else:
        fit_input = fit_input_of(item)
        what = {"inputs": maps_read(item.config), "extends": fit_input.name if fit_input else None,
                **(fit_input.describe(item) if fit_input else {})}  # fmt: skip
    return {**what, "num_exact_layers": num_exact, "retention": None, "retention_ci": None, "cued_retention": None,
            "cued_retention_ci": None, "passes": False}  # fmt: skip


def _set_aside(rows: list[dict[str, Any]], passed: set[int]) -> None:
    """Marks the passing rows of counts above the fewest that passes (tried on the way to it, see `_gallop`): the
    choice is among the fewest's, which compute less of the target."""
    for row in rows:
        if passed and row["passes"] and not row.get("skipped") and row["num_exact_layers"] > min(passed):
            row["set_aside"] = f"{min(passed)} exact layers keep the content (fewer compute less of the target)"


def _twin(m: KVMapper) -> tuple[Hashable, bool]:
    """`FitInput.twin` of a candidate (one without a fit input has no twin)."""
    fit_input = fit_input_of(m)
    return fit_input.twin(m) if fit_input else ((id(m),), False)


def _after_full_rank_twins(items: list, twins: list[tuple[Hashable, bool]]) -> list:
    """`items` in their order, except that a reduced-rank one (`twins[i]`: `(key, reduced)`) comes right after the
    first full-rank one of its key when that one is among them."""
    pending = {key for key, reduced in twins if not reduced}  # full-rank keys not yet placed
    waiting: dict[Hashable, list] = {}
    ordered = []
    for item, (key, reduced) in zip(items, twins):
        if reduced and key in pending:
            waiting.setdefault(key, []).append(item)
            continue
        ordered.append(item)
        if not reduced and key in pending:
            pending.discard(key)
            ordered += waiting.pop(key, [])
    return ordered


def _row_line(row: dict[str, Any]) -> str:
    """A probed candidate on one line (the log's; the report keeps every figure)."""
    what = f"{row['num_exact_layers']} exact, {row['inputs']}"
    if row.get("skipped"):
        return f"{what}: skipped ({row['skipped']})"
    scores = [f"repeated spans {_percent(row['retention'], row['retention_ci'])}"]
    if row.get("cued_retention") is not None:
        scores.append(f"cued recall {_percent(row['cued_retention'], row['cued_retention_ci'])}")
    if row.get("gate"):
        scores.append(f"content gate: {gate_line(row['gate'])}")
    return f"{what}: {', '.join(scores)}: {'passes' if row['passes'] else 'fails'}"


def _skipped_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The skipped candidates by reason, one line each: `12 skipped, 4-6, 9 exact layers (a candidate with fewer exact
    layers passed ...)`, a group of them never solved counted as one."""
    by_reason: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("skipped"):
            by_reason.setdefault(row["skipped"], []).append(row)
    lines = []
    for reason, skipped in by_reason.items():
        unsolved = sum(not row.get("solved", True) for row in skipped)
        groups = f"; {unsolved} of them groups whose maps were not solved" if unsolved else ""
        counts = _spans(sorted({row["num_exact_layers"] for row in skipped}))
        lines.append(f"{len(skipped)} skipped, {counts} exact layers ({reason}{groups})")
    return lines


def _spans(values: list[int]) -> str:
    """Sorted integers as runs: `[1, 2, 3, 5]` -> `1-3, 5`."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _undecided(diff: dict[str, Any], max_loss: float) -> bool:
    """Whether a paired cued-recall difference is within the allowed loss while its interval is not."""
    point, ci = diff["difference"], diff["difference_ci"]
    return point is not None and ci is not None and math.isfinite(ci[0]) and point >= -max_loss > ci[0]


def _with_num_exact(mapper: KVMapper, num_exact: int | None) -> KVMapper:
    return mapper.with_config(num_exact_layers=num_exact)


__all__ = ["LITTLE_SAVED", "LITTLE_SAVED_TOKENS", "MIN_COPY_GAIN", "TIMING_ROUNDS", "ProbeOptions", "choose_configuration",
           "choose_num_exact_layers", "configuration_cost", "little_saved", "probe_stream", "target_copies"]
