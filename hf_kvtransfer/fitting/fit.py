"""Fit a KVMapper: one calibration pass through both models (`calibration_pass.py`), then a closed-form solve (ridge,
reduced rank) or MLP training (`mlp.py`), configured by one `FitConfig`.

Example:
    ```python
    mapper = fit_mapper(source, target, calibration_ids, top_k=4)
    mappers = fit_mappers(source, target, "corpus.txt", tokenizer=tok, config=FitConfig(top_k="1,2,all", seq_len=256))
    ```
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from ..core.lowrank import lowrank_mapper, reduced_rank_heldout_r2
from ..core.mapper import KVMapper
from ..core.mapper_config import MapperConfig
from ..core.mapper_types import MLP
from ..core.ridge import (
    effective_top_k,
    heldout_r2,
    layer_scores,
    select_layers,
    solve_layers,
    sweep_heldout,
)
from ..core.stats import KINDS, BlockStatistics, KVStatistics
from .accumulate import plan_kv_sums, run_fit_pass
from .budget import StatisticsBudget
from .calibration import DEFAULT_DATASET, DEFAULT_DATASET_CONFIG, build_calibration
from .calibration_pass import as_token_tensor, dist_info
from .config import (
    PAPER_TOP_K_CANDIDATES,
    RIDGE_LAMBDA_CANDIDATES,
    FitConfig,
    heldout_count,
    mapper_name,
    parse_ridge_lambda,
    parse_top_k,
    resolve_config,
)
from .content_gate import ContentGate, gate_line, heldout_texts, tolerance_points
from .exact_layers import choose_configuration, little_saved, probe_stream, target_copies
from .exact_window import with_exact_window
from .fit_inputs import FitInput, fit_input_named, registered_fit_inputs
from .mlp import fit_mlp
from .probe_journal import ProbeJournal
from .quality_gate import calibrate_quality_gate

logger = logging.getLogger(__name__)

# Provenance a caller may hand to the mapper config (everything else a fit records itself).
MAPPER_CONFIG_KEYWORDS = frozenset(
    {"source_model_id", "target_model_id", "source_revision", "target_revision", "license", "calibration"}
)


def ridge_mapper(
    config: MapperConfig,
    solutions: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]],
    dtype: torch.dtype = torch.float32,
) -> KVMapper:
    """A ridge `KVMapper` from `ridge.solve_layers` outputs for keys and values (weights `[F_out, F_in]`); the fit
    R^2 of the solutions go into a copy of `config`."""
    num_target = len(config.selected_layers)
    config = dataclasses.replace(
        config,
        fit_r2_key=[solutions["key"][t][2] for t in range(num_target)],
        fit_r2_value=[solutions["value"][t][2] for t in range(num_target)],
    )
    state = {
        f"layers.{t}.{kind}.{name}": tensor.float()
        for t in range(num_target)
        for kind in KINDS
        for name, tensor in zip(("weight", "bias"), solutions[kind][t][:2])
    }
    mapper = KVMapper(config)
    mapper.load_state_dict(state)
    return mapper.to(dtype)


def solve_mapper(
    statistics: KVStatistics,
    top_k: int | str | None = FitConfig.top_k,
    ridge_lambda: float = 0.01,
    dtype: torch.dtype = torch.float32,
    rank: int | list[list[int]] | None = None,
    energy: float | None = None,
    size_budget: float | int | None = None,
    scores: torch.Tensor | None = None,
    **config_kwargs: Any,
) -> KVMapper:
    """Build a ridge `KVMapper` from statistics: rank source layers, keep the top k, solve.

    Args:
        top_k: source layers per target layer (an int, or `"all"`/`None` for all of them; default 8).
        ridge_lambda: ridge penalty on the centered *sum* Gram matrix (paper and scikit-learn semantics).
        dtype: weight dtype of the mapper (`torch.bfloat16` / `torch.float16` halve the storage).
        rank / energy / size_budget: at most one, for a reduced-rank mapper (see `lowrank.py`): a rank per map
            (int, or `[key_rank, value_rank]` per target layer), the fraction of fitted variance to keep per
            map (e.g. 0.99), or a parameter budget (count, or fraction of full rank) spread over the layers.
        scores: `[L_s, L_t]` layer-ranking scores already computed (`ridge.layer_scores`), to skip recomputing.
        config_kwargs: extra `MapperConfig` fields (model ids, revisions, calibration description, ...).

    Example:
        ```python
        stats = collect_statistics(source, target, calibration_ids)
        mapper = solve_mapper(stats, top_k=4, energy=0.99, dtype=torch.bfloat16)
        ```
    """
    ks = [top_k] if isinstance(top_k, int) and not isinstance(top_k, bool) else parse_top_k(top_k)
    if len(ks) != 1 or ks[0] == "auto":
        raise ValueError(f"solve_mapper solves one k, got top_k={top_k!r}; use solve_mappers (or fit_mapper) for several or 'auto'")
    k = ks[0]
    selected = select_layers(scores if scores is not None else layer_scores(statistics, ridge_lambda), k)
    solutions = {kind: solve_layers(statistics, kind, dict(enumerate(selected)), ridge_lambda) for kind in KINDS}
    calibration = dict(statistics.metadata.get("calibration", {}))
    calibration.setdefault("stride", statistics.metadata.get("stride"))
    calibration["num_tokens"] = statistics.count
    config_kwargs.setdefault("calibration", calibration)
    for key in ("source_model_id", "target_model_id", "source_revision", "target_revision"):
        if key in statistics.metadata:
            config_kwargs.setdefault(key, statistics.metadata[key])
    config = MapperConfig(
        source_config=statistics.source_config,
        target_config=statistics.target_config,
        selected_layers=selected,
        top_k=k if k is not None else statistics.source_layout.num_layers,
        ridge_lambda=ridge_lambda,
        **config_kwargs,
    )
    if rank is not None or energy is not None or size_budget is not None:
        return lowrank_mapper(statistics, config, solutions, rank=rank, energy=energy, size_budget=size_budget, dtype=dtype)
    return ridge_mapper(config, solutions, dtype=dtype)


def _model_selection(
    statistics: KVStatistics, heldout: KVStatistics, ks: list, lams: list, auto_k: bool, auto_l: bool, max_k: int
) -> tuple[list[tuple], dict[tuple, dict], dict[str, Any]]:
    """Sweep (k, lambda) candidates on held-out statistics: `(chosen pairs, rows by pair, report)`."""
    num_source = statistics.source_layout.num_layers
    if heldout is None or heldout.count < 2:
        raise ValueError(
            "top_k/ridge_lambda 'auto' choose by held-out R^2 and need a held-out shard: set heldout_fraction "
            "(CLI: --heldout-fraction) above 0"
        )
    cand_k = ks if ks else [k for k in PAPER_TOP_K_CANDIDATES if k is None or k < num_source]
    cand_k = [k for k in cand_k if (num_source if k is None else k) <= max_k]
    cand_l = (lams or list(RIDGE_LAMBDA_CANDIDATES)) if auto_l else lams
    if len(cand_l) != 1 and not auto_l:
        raise ValueError(f"give one ridge_lambda, or several with 'auto' among them to pick one; got {lams}")
    curve = sweep_heldout(statistics, heldout, cand_k, cand_l)
    rows = {(r["top_k"], r["ridge_lambda"]): r for r in curve}
    if auto_k:
        best = max(curve, key=lambda r: r["heldout_r2"])  # ties keep the first: the smaller k / lambda
        chosen = [(best["top_k"], best["ridge_lambda"])]
    else:
        chosen = [(k, max((r for r in curve if r["top_k"] == k), key=lambda r: r["heldout_r2"])["ridge_lambda"]) for k in cand_k]
    report = {
        "metric": "held-out R^2 (head-averaged, mean over target layers of K and V)",
        "top_k_candidates": ["all" if k is None else k for k in cand_k] if auto_k else None,
        "ridge_lambda_candidates": cand_l if auto_l else None,
        "curve": [
            {
                "top_k": "all" if r["top_k"] is None else r["top_k"],
                "ridge_lambda": r["ridge_lambda"],
                "heldout_r2": r["heldout_r2"],
                "heldout_r2_key": sum(r["heldout_r2_key"]) / len(r["heldout_r2_key"]),
                "heldout_r2_value": sum(r["heldout_r2_value"]) / len(r["heldout_r2_value"]),
            }
            for r in curve
        ],
        "chosen": [{"top_k": "all" if k is None else k, "ridge_lambda": lam} for k, lam in chosen],
        "heldout_tokens": heldout.count,
    }
    return chosen, rows, report


def solve_mappers(
    statistics: KVStatistics,
    heldout: KVStatistics | None = None,
    top_k: int | str | Sequence | None = FitConfig.top_k,
    ridge_lambda: float | str | Sequence = 0.01,
    refit: bool = True,
    dtype: torch.dtype = torch.float32,
    **config_kwargs: Any,
) -> dict[str, KVMapper]:
    """Solve one mapper per requested k from one set of statistics, with held-out scoring and model selection.

    Args:
        statistics: fit statistics (from `accumulate_statistics` / `collect_statistics`).
        heldout: statistics of a held-out shard. With it, every mapper gets `heldout_r2_key/value` per
            target layer (fit on `statistics`, scored on `heldout`), and `"auto"` is allowed.
        top_k: one or several of int / "all", or "auto" to pick by held-out R^2 among the listed values
            (the paper's sweep 1, 2, 4, ..., 24, all when none are listed); `FitConfig`'s grammar.
        ridge_lambda: a number, or "auto" to pick by held-out R^2 (among listed numbers, or 1e-3 ... 1e3).
        refit: after scoring, solve the final weights on fit + held-out statistics (all sequences, as in the
            paper); the held-out R^2 recorded is that of the fit-shard model, an honest estimate.
        config_kwargs: extra `MapperConfig` fields, and `rank` / `energy` / `size_budget` for reduced rank.

    Returns:
        `{mapper_name(k): KVMapper}` in the order requested (one entry for "auto"); the selection curve is in
        `mapper.report["model_selection"]`.
    """
    ks, lams, auto_k, auto_l, max_k = _requested_candidates(statistics, top_k, ridge_lambda)
    selection, heldout_rows = None, {}
    if auto_k or auto_l:
        chosen, heldout_rows, selection = _model_selection(statistics, heldout, ks, lams, auto_k, auto_l, max_k)
        selection["refit_on_all"] = refit
    else:
        if len(lams) != 1:
            raise ValueError(f"give one ridge_lambda, or several with 'auto' among them to pick one; got {lams}")
        chosen = [(k, lams[0]) for k in ks]
    final = statistics + heldout if (heldout is not None and refit) else statistics
    ranking = _cached_rankings()  # one ranking per statistics and lambda, shared by every k
    mappers = {}
    for k, lam in chosen:
        extra = dict(config_kwargs)
        if heldout is not None and heldout.count >= 2:
            row = _heldout_row(statistics, heldout, k, lam, heldout_rows.get((k, lam)), config_kwargs, ranking)
            extra.setdefault("heldout_r2_key", row["heldout_r2_key"])
            extra.setdefault("heldout_r2_value", row["heldout_r2_value"])
            calibration = dict(extra.get("calibration") or final.metadata.get("calibration", {}))
            calibration.setdefault("stride", final.metadata.get("stride"))
            calibration.update(
                num_tokens=final.count, heldout_tokens=heldout.count, fit_tokens=statistics.count, refit_on_all=refit
            )
            extra["calibration"] = calibration
        mapper = solve_mapper(final, top_k=k, ridge_lambda=lam, dtype=dtype, scores=ranking(final, lam), **extra)
        if selection is not None:
            mapper.report = {**getattr(mapper, "report", {}), "model_selection": selection}
        mappers[mapper_name(k)] = mapper
    return mappers


def _requested_candidates(
    statistics: KVStatistics, top_k: int | str | Sequence | None, ridge_lambda: float | str | Sequence
) -> tuple[list, list, bool, bool, int]:
    """`solve_mappers`' k and lambda candidates, checked against the statistics: `(ks, lambdas, auto_k, auto_lambda,
    max_k)`, "auto" taken out of the lists; a k at or above the source's depth becomes every layer."""
    ks, lams = parse_top_k(top_k), parse_ridge_lambda(ridge_lambda)
    auto_k, auto_l = "auto" in ks, "auto" in lams
    ks, lams = [k for k in ks if k != "auto"], [v for v in lams if v != "auto"]
    num_source = statistics.source_layout.num_layers
    if any(k is not None and k >= num_source for k in ks):
        # The default k (8) on a shallow source, or any k reaching its depth: every source layer.
        logger.info("top_k %s >= the source's %d layers: using all of them", [k for k in ks if k], num_source)
        ks = list(dict.fromkeys(effective_top_k(k, num_source) for k in ks))
    max_k = statistics.max_top_k if isinstance(statistics, BlockStatistics) else num_source
    for k in ks:
        if (num_source if k is None else k) > max_k:
            raise ValueError(
                f"top_k {'all' if k is None else k} needs blocks the two-stage fit did not keep (it kept the top "
                f"{max_k}); rerun with a larger max top_k or without two_stage"
            )
    return ks, lams, auto_k, auto_l, max_k


def _cached_rankings() -> Callable[[KVStatistics, float], torch.Tensor]:
    """`layer_scores` memoised by statistics object and lambda."""
    scores: dict[tuple[int, float], torch.Tensor] = {}

    def ranking(stats: KVStatistics, lam: float) -> torch.Tensor:
        if (id(stats), lam) not in scores:
            scores[id(stats), lam] = layer_scores(stats, lam)
        return scores[id(stats), lam]

    return ranking


def _heldout_row(
    statistics: KVStatistics,
    heldout: KVStatistics,
    k: int | None,
    lam: float,
    row: dict | None,
    config_kwargs: dict[str, Any],
    ranking: Callable[[KVStatistics, float], torch.Tensor],
) -> dict[str, Any]:
    """The held-out R^2 per target layer of the (k, lambda) mapper fit on `statistics`: the model selection's
    `row` when it scored this pair at full rank, else computed here (a reduced-rank mapper is scored as reduced)."""
    low_rank = {key: config_kwargs[key] for key in ("rank", "energy", "size_budget") if config_kwargs.get(key) is not None}
    if low_rank:  # the reduced maps' own score, not the full-rank one they were cut from
        selected = select_layers(ranking(statistics, lam), k)
        return reduced_rank_heldout_r2(statistics, heldout, selected, lam, **low_rank)
    if row is None:
        selections = dict(enumerate(select_layers(ranking(statistics, lam), k)))
        row = {f"heldout_r2_{kind}": heldout_r2(statistics, heldout, kind, selections, lam) for kind in KINDS}
    return row

def calibration_sample(
    tokenizer, config: FitConfig, dataset: str | os.PathLike | None = None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Pack `config`'s calibration data (`dataset` overrides `config.dataset`; default FineWeb-Edu sample-10BT)
    with `tokenizer`: `(input_ids [num_sequences, seq_len], description recorded in the mapper config)`."""
    dataset = dataset if dataset is not None else config.dataset
    dataset_config = config.dataset_config
    if dataset is None:
        dataset, dataset_config = DEFAULT_DATASET, dataset_config or DEFAULT_DATASET_CONFIG
    ids, info = build_calibration(
        tokenizer, dataset, dataset_config, config.split, config.text_field, config.num_sequences, config.seq_len
    )
    info["stride"] = config.stride
    return ids, info


def model_ids(source: PreTrainedModel, target: PreTrainedModel) -> dict[str, str]:
    """`{"source_model_id": ..., "target_model_id": ...}` from the models' `name_or_path`, where known."""
    out = {}
    for which, model in (("source", source), ("target", target)):
        name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
        if name:
            out[f"{which}_model_id"] = str(name)
    return out


def _warn_beyond_positions(source: PreTrainedModel, target: PreTrainedModel, seq_len: int) -> None:
    """One warning when calibration sequences are longer than a model was built for (its RoPE positions beyond
    `max_position_embeddings` are untrained, so the statistics describe caches the models never make in use)."""
    limits = {}
    for which, model in (("source", source), ("target", target)):
        config = getattr(model.config, "get_text_config", lambda: model.config)()
        limit = getattr(config, "max_position_embeddings", None)
        if isinstance(limit, int) and seq_len > limit:
            limits[which] = limit
    if limits:
        models = " and ".join(f"the {which}'s {limit}" for which, limit in limits.items())
        logger.warning(
            "seq_len %d is beyond max_position_embeddings (%s): positions past it are untrained; use --seq-len %d or less",
            seq_len, models, min(limits.values()),
        )


def fit_mapper(
    source: PreTrainedModel,
    target: PreTrainedModel,
    calibration_input_ids: torch.Tensor | Iterable | str | os.PathLike | None = None,
    config: FitConfig | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    tokenizer=None,
    log: Callable[[str], None] | None = None,
    refine: Callable[[KVMapper], KVMapper] | None = None,
    **overrides: Any,
) -> KVMapper:
    """Fit a mapper from `source`'s KV cache to `target`'s: one calibration pass, then a closed-form ridge solve
    (or MLP training with `mapper_type="mlp"`).

    One pass over the calibration tokens through both models collects sufficient statistics; the top-k
    source layers per target layer are picked by single-source R^2 and each target layer is solved in
    closed form. To try other `top_k` / `ridge_lambda` without running the models again, use
    `collect_statistics` + `solve_mapper` (or keep `stats_dir` and `KVStatistics.load` it).

    Args:
        source, target: causal LMs of one family sharing a tokenizer.
        calibration_input_ids: `[num_sequences, seq_len]` token ids, an iterable of batches, or a dataset:
            a Hub dataset id (streamed) or a local `.txt`/`.jsonl`/`.parquet` file or directory, packed with
            `tokenizer` (required then) by `config`'s data settings. None: `config.dataset`.
        config: a `FitConfig` (default `FitConfig()`: k=8, lambda=0.01, stride 4, the last 10% of the
            sequences held out and the weights refit on all of them).
        attention_mask: `[num_sequences, seq_len]` mask for padded token ids.
        log: where the few lines a person should see go (statistics memory, two-stage); default `logger.info`.
        refine: what the content probe does to each candidate reading a map input (`fit_inputs.py`) before it scores it
            (`exact_layers.choose_configuration`): a function from a candidate mapper to the one probed, timed and
            possibly chosen (say, the candidate with more map inputs, fit on what its maps miss). Default: none.
        overrides: `FitConfig` fields applied on top of `config` (`top_k=4`, `ridge_lambda="auto"`,
            `heldout_fraction=0`, `mapper_type="mlp"`, `mlp_epochs=10`, ...; the MLP's short names `hidden_size`,
            `epochs`, `lr`, `residual`, ... and `statistics_dir` are accepted too), and provenance for the mapper
            config (`source_model_id`, `target_model_id`, revisions, `license`).

    Returns:
        A float32 `KVMapper` (or `config.mapper_dtype`) with per-layer fit and held-out R^2 in `mapper.config`
        and the run report (model selection, MLP training) in `mapper.report`. Several `top_k` from one pass:
        `fit_mappers`.

    Example:
        ```python
        mapper = fit_mapper(source, target, calibration_ids, top_k=4)
        mapper.save_pretrained("mappers/small-to-large")
        ```
    """
    config, _ = resolve_config(config, overrides)
    if config.several:
        raise ValueError(
            f"fit_mapper fits one mapper, but top_k={config.top_k!r} asks for several; use fit_mappers(...) for "
            "one mapper per k from one calibration pass, or give one k"
        )
    return next(iter(fit_mappers(source, target, calibration_input_ids, config, attention_mask=attention_mask,
                                 tokenizer=tokenizer, log=log, refine=refine,
                                 **overrides).values()))  # fmt: skip


def fit_mappers(
    source: PreTrainedModel,
    target: PreTrainedModel,
    calibration_input_ids: torch.Tensor | Iterable | str | os.PathLike | None = None,
    config: FitConfig | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    tokenizer=None,
    log: Callable[[str], None] | None = None,
    refine: Callable[[KVMapper], KVMapper] | None = None,
    **overrides: Any,
) -> dict[str, KVMapper]:
    """`fit_mapper` for several `top_k` from one calibration pass: `{name: KVMapper}`, names from `mapper_name`
    (`k1`, `k4`, `kall`, ...); one entry when one k is given. Same arguments as `fit_mapper`.

    Example:
        ```python
        mappers = fit_mappers(source, target, "corpus.txt", tokenizer=tok, num_sequences=64, seq_len=256,
                              top_k="1,2,all")
        mappers["k2"].save_pretrained("mappers/k2")
        ```
    """
    config, mapper_kwargs = resolve_config(config, overrides)
    unknown = sorted(set(mapper_kwargs) - MAPPER_CONFIG_KEYWORDS)
    if unknown:
        raise TypeError(
            f"fit_mapper got unknown keyword argument(s) {unknown}: pass FitConfig fields or "
            f"{sorted(MAPPER_CONFIG_KEYWORDS)}"
        )
    mapper_kwargs = {**model_ids(source, target), **mapper_kwargs}
    started = time.perf_counter()
    ids, mask, info = _calibration_inputs(calibration_input_ids, attention_mask, tokenizer, config)
    heldout_count(ids.shape[0], config.heldout_fraction)  # a fraction that leaves nothing to fit on fails here
    _warn_beyond_positions(source, target, ids.shape[1])
    if info:
        mapper_kwargs.setdefault("calibration", info)
    gate = _checked_gate(source, target, tokenizer, ids, mask, config)  # before the pass: a pair it cannot judge fails now
    if config.mapper_type == MLP:
        mapper = fit_mlp(source, target, ids, mask, config, log=log, **mapper_kwargs)
        mapper = with_exact_layers(source, target, mapper, ids, mask, config, log, gate=gate)
        return {mapper_name(config.top_k_values[0]): _with_quality_gate(source, target, mapper, ids, mask, config)}
    metadata = {"calibration": mapper_kwargs.pop("calibration")} if "calibration" in mapper_kwargs else None
    kv = plan_kv_sums(source, target, ids.shape[0], config)
    searched = _input_statistics(source, target, config, kv.residual_budget(), log)
    train, heldout = run_fit_pass(source, target, ids, mask, config, consumers=[stats for _, stats in searched],
                                  metadata=metadata, log=log, kv=kv)  # fmt: skip
    logger.info("calibration pass: %.1f s", time.perf_counter() - started)
    # (no timings in the report of a closed-form fit: the same data must give the same files)
    mappers = solve_mappers(
        train, heldout, top_k=config.top_k_values, ridge_lambda=list(config.ridge_lambda), refit=config.refit,
        dtype=config.torch_mapper_dtype, **config.rank_kwargs, **mapper_kwargs,
    )  # fmt: skip
    return {name: _with_quality_gate(source, target, with_exact_layers(
                source, target, m, ids, mask, config, log, searched=searched, refine=refine,
                gate=gate), ids, mask, config)
            for name, m in mappers.items()}  # fmt: skip


def _calibration_inputs(
    calibration_input_ids: torch.Tensor | Iterable | str | os.PathLike | None,
    attention_mask: torch.Tensor | None,
    tokenizer,
    config: FitConfig,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
    """`fit_mappers`' calibration data as `(input_ids, attention_mask, info)`: token ids as given, or a dataset
    (`calibration_input_ids` as id / path, else `config.dataset`) packed with `tokenizer` (`info` describes it)."""
    if calibration_input_ids is None and config.dataset is None:
        raise ValueError("pass calibration data: token ids [num_sequences, seq_len] or a dataset id / local path")
    if calibration_input_ids is None or isinstance(calibration_input_ids, (str, os.PathLike)):
        if tokenizer is None:
            raise ValueError("fitting from a dataset needs the models' tokenizer: pass tokenizer=")
        ids, info = calibration_sample(tokenizer, config, calibration_input_ids)
        return ids, None, info
    ids, mask = as_token_tensor(calibration_input_ids, attention_mask)
    return ids, mask, {}


def _with_quality_gate(source, target, mapper: KVMapper, ids, mask, config: FitConfig) -> KVMapper:
    """`mapper` with a quality gate calibrated on the fit's held-out rows (unpadded ones), when
    `config.quality_gate_quantile` asks for one."""
    if config.quality_gate_quantile is None:
        return mapper
    num_heldout = heldout_count(ids.shape[0], config.heldout_fraction)
    rows = ids[-num_heldout:] if num_heldout else ids
    if mask is not None:
        rows = rows[mask[-rows.shape[0]:].bool().all(dim=-1)]
    if rows.shape[0] == 0:
        raise ValueError("the quality gate is calibrated on unpadded held-out rows and the fit has none: give unpadded "
                         "calibration sequences or drop quality_gate_quantile")  # fmt: skip
    return calibrate_quality_gate(source, target, mapper, rows, config.quality_gate_quantile)


def _input_statistics(source: PreTrainedModel, target: PreTrainedModel, config: FitConfig, budget: StatisticsBudget,
                      log) -> list[tuple[FitInput, Any]]:  # fmt: skip
    """Each map input this fit searches (`fit_inputs.py`) with the calibration consumer collecting its sums within
    `budget`."""
    found = [(f, f.statistics(source, target, config, budget, log or logger.info)) for f in registered_fit_inputs()]
    return [(f, stats) for f, stats in found if stats is not None]


def with_exact_layers(
    source: PreTrainedModel,
    target: PreTrainedModel,
    mapper: KVMapper,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    config: FitConfig,
    log: Callable[[str], None] | None = None,
    searched: Sequence[tuple[FitInput, Any]] = (),
    refine: Callable[[KVMapper], KVMapper] | None = None,
    gate: ContentGate | None = None,
) -> KVMapper:
    """`mapper` with `config.num_exact_layers` recorded: a given number as is, "auto" from the content probe
    (`exact_layers.choose_configuration`) on the held-out calibration sequences (all of them without a
    held-out shard), its table in `mapper.report["exact_layers"]`. With `searched` (fit inputs and the statistics the
    calibration pass collected for them, `fit_inputs.py`) the probe also tries each input's candidates (e.g. maps reading
    the target's residual stream) and may return one of them; `refine` (the caller's) turns each of those candidates
    into the one probed (`fit_mapper`). With a content `gate` (`_checked_gate`: passage recall and hand-off on
    probe items, paired against the target's own answers, `config.exact_layers_tolerance`) the gate makes the
    choice; without one the screen decides. Then the exact pass's window (`config.exact_window`; "auto": the
    smallest the gate accepts, `exact_window.py`), and one warning line when the mapper chosen so saves little
    (`exact_layers.little_saved`)."""
    if config.num_exact_layers != "auto":  # given: no probe, and a window only when given too
        window = None if config.exact_window == "auto" else config.exact_window
        mapper.config = dataclasses.replace(mapper.config, num_exact_layers=config.num_exact_layers, exact_window=window)
        return mapper
    rows, mask, num_heldout = _probe_rows(input_ids, attention_mask, config)
    started = time.perf_counter()
    candidates = [m for fit_input, stats in searched for m in fit_input.candidates(mapper, stats, config)]
    journal = gate.journal if gate is not None else _probe_journal(source, target, config)
    with torch.no_grad():
        mapper, report = choose_configuration(
            source, target, mapper, probe_stream(rows, mask), candidates=candidates,
            min_retention=config.exact_layers_retention, num_items=config.exact_layers_items,
            timing_tokens=config.exact_layers_timing_tokens, refine=refine, gate=gate, progress=config.progress,
            journal=journal,
        )  # fmt: skip
    report["probe_sequences"] = "held-out" if num_heldout else "all calibration sequences (no held-out shard)"
    mapper.report = {**mapper.report, "exact_layers": report}
    reused = f"; {journal.reused} scores read back from {journal.path}" if journal is not None and journal.reused else ""
    (log or logger.info)(
        f"exact layers: {mapper.num_exact_layers} of {mapper.target_layout.num_layers} ({report['reason']}; "
        f"{_probe_summary(report)}; {time.perf_counter() - started:.0f} s{reused})"
    )
    mapper = with_exact_window(mapper, gate, config.exact_window, log)
    warning = little_saved(mapper)
    if warning is not None:
        logger.warning("exact layers: %s", warning)
    return mapper


def _probe_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, config: FitConfig):
    """`(rows, mask, num_heldout)`: the calibration rows the probe reads, the held-out ones (all of them without a
    held-out shard)."""
    num_heldout = heldout_count(input_ids.shape[0], config.heldout_fraction)
    rows = slice(-num_heldout, None) if num_heldout else slice(None)
    return input_ids[rows], attention_mask[rows] if attention_mask is not None else None, num_heldout


def _checked_gate(source, target, tokenizer, input_ids, attention_mask, config: FitConfig) -> ContentGate | None:
    """The content gate of a fit that chooses its exact layers (None for a fixed count, or without a tokenizer),
    its precondition checked before the calibration pass: where the screen will compare candidates (the target
    copies from its context, `exact_layers.target_copies`), a target that answers the gate's probe items no better
    with their passage than without (`ContentGate.check_context`) fails in the time of that check, not after the
    pass. (A target that does not copy keeps the default exact layers unjudged, as the screen decides.)"""
    if config.num_exact_layers != "auto":
        return None
    rows, mask, _ = _probe_rows(input_ids, attention_mask, config)
    journal = _probe_journal(source, target, config)
    gate = _content_gate(source, target, tokenizer, rows, mask, config, journal)
    if gate is not None and target_copies(target, probe_stream(rows, mask), num_items=config.exact_layers_items,
                                          journal=journal):  # fmt: skip
        with torch.no_grad():
            found = gate.check_context()
        logger.info("content gate: the target's own passage recall on %d probe items %.1f%%, %.1f%% without the "
                    "passage", found["num_items"], 100 * found["own_accuracy"], 100 * found["no_context_accuracy"])  # fmt: skip
    return gate


def _probe_journal(source, target, config: FitConfig) -> ProbeJournal | None:
    """The probe's scores kept beside the calibration checkpoint (`probe_journal.py`), when the fit checkpoints."""
    if config.checkpoint_dir is None:
        return None
    return ProbeJournal.for_fit(config.checkpoint_dir, source, target, *dist_info())


# The content gate's first stage scores this many times `exact_layers_items` items per task (recall, hand-off).
GATE_ITEMS_FACTOR = 2


def _content_gate(source, target, tokenizer, heldout_ids, mask, config: FitConfig,
                  journal: ProbeJournal | None = None) -> ContentGate | None:  # fmt: skip
    """The fit's content gate on its held-out rows, or None (with a warning) where no tokenizer can build its items."""
    if tokenizer is None:
        logger.warning("exact layers: no tokenizer given, so the content gate (passage recall and hand-off) cannot "
                       "build its items and the repeated-span screen decides alone; pass tokenizer= to fit_mapper")  # fmt: skip
        return None
    try:
        return ContentGate(source, target, tokenizer, heldout_texts(tokenizer, heldout_ids, mask),
                           tolerance=config.exact_layers_tolerance,
                           num_items=GATE_ITEMS_FACTOR * config.exact_layers_items, journal=journal)  # fmt: skip
    except ValueError as exc:  # e.g. a tokenizer without single-token numbers for the answers
        logger.warning("exact layers: the content gate cannot build its items (%s); the repeated-span screen decides", exc)
        return None


def _probe_summary(report: dict[str, Any]) -> str:
    """Each candidate the probe tried on one line: `3+res: 103%/cued 99%, recall -10.0 [-15.3, -4.7] pts on 128,
    hand-off ...: rejected` (screen retentions, then the gate's paired differences)."""
    rows = []
    for row in report.get("candidates", report["tried"]):
        if row.get("skipped"):
            continue
        extends = fit_input_named(row.get("extends"))
        text = (f"{row['num_exact_layers']}{'+' + extends.tag if extends else ''}: "
                f"{'n/a' if row.get('retention') is None else format(row['retention'], '.0%')}"
                + (f"/cued {row['cued_retention']:.0%}" if row.get("cued_retention") is not None else ""))  # fmt: skip
        if row.get("gate"):
            text += f", {gate_line(row['gate'])}"
        rows.append(text + (" (chosen)" if row.get("chosen") else "") + (" (set aside)" if row.get("set_aside") else ""))
    gate = report.get("gate") or {}
    what = (f"content gate: recall and hand-off within {tolerance_points(gate['tolerance'])} of the target's own, paired"
            if gate.get("used") else "screen only (no content gate)")  # fmt: skip
    return f"{what}; probe by candidate {'; '.join(rows)}"


def fit_mlp_mapper(
    source: PreTrainedModel,
    target: PreTrainedModel,
    calibration_input_ids: torch.Tensor | Iterable | str | os.PathLike | None = None,
    config: FitConfig | None = None,
    **overrides: Any,
) -> KVMapper:
    """`fit_mapper(..., mapper_type="mlp")`: the paper's nonlinear variant (see `mlp.py`), by default a residual
    on the ridge map with early stopping on the held-out sequences.

    Example:
        ```python
        mapper = fit_mlp_mapper(source, target, calibration_ids, top_k=4, epochs=10)
        print(mapper.report["mlp"]["heldout"]["value"]["ridge_r2"], mapper.config.heldout_r2_value)
        ```
    """
    return fit_mapper(source, target, calibration_input_ids, config, mapper_type=MLP, **overrides)


__all__ = [
    "calibration_sample",
    "fit_mapper",
    "fit_mlp_mapper",
    "model_ids",
    "ridge_mapper",
    "solve_mapper",
    "solve_mappers",
    "with_exact_layers",
]
