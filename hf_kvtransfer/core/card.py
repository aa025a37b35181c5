"""The model card of a mapper repo, rendered from `hub_cards/mapper_card.md`, its config and its run report."""

from __future__ import annotations

import math
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from .config_migration import migrate_config
from .defaults import resolve_num_exact_layers
from .map_inputs import exact_layers_needed, maps_read, registered_map_inputs, top_k_unused
from .mapper_config import MapperConfig
from .quality_gate import QualityGateConfig
from .mapper_types import LOWRANK, RIDGE

LIBRARY_NAME = "hf-kvtransfer"
CARD_TEMPLATE = "mapper_card.md"
DEFAULT_LICENSE = "apache-2.0"
PAPER_URL = "https://arxiv.org/abs/2608.03893"
# What the Hub accepts as a repo id ("name" or "namespace/name").
HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")
_DATA_FILE_SUFFIXES = {".json", ".jsonl", ".txt", ".csv", ".tsv", ".parquet", ".arrow", ".gz", ".zst", ".bin"}


# -- rendering --------------------------------------------------------------------------------------------------


def _card_data(
    config: dict, model_ids: tuple[str | None, str | None], fingerprints: tuple[dict, dict], calibration: dict
) -> ModelCardData:
    """The card's metadata (`render_model_card`) from the migrated `config`, its source and target ids and
    fingerprints, and its calibration record."""
    base_models = list(dict.fromkeys(m for m in model_ids if _is_hub_id(m)))
    dataset = calibration.get("dataset")
    families = [fp.get("model_type") for fp in fingerprints if isinstance(fp.get("model_type"), str)]
    return ModelCardData(
        library_name=LIBRARY_NAME,
        license=config.get("license") or DEFAULT_LICENSE,
        tags=["kv-cache", "kv-cache-transfer", *families],
        base_model=base_models or None,
        base_model_relation="adapter" if base_models else None,
        datasets=[dataset] if _is_hub_id(dataset) and not _is_data_file(dataset) else None,
    )


def render_model_card(
    config: dict, repo_id: str | None = None, report: dict | None = None, checkpoint: dict | None = None
) -> ModelCard:
    """Render a mapper's model card from `hub_cards/mapper_card.md`, its `config.json` contents and its run report.

    Metadata: `library_name: hf-kvtransfer`, tags (`kv-cache`, `kv-cache-transfer`, the model families),
    `base_model` = [source, target] with `base_model_relation: adapter` (a mapper is used together with both
    models, and the Hub would read two base models as a merge otherwise), the calibration dataset when it is a Hub
    id, and the license. Missing optional fields are skipped.

    Args:
        config: the mapper config as a dict (what `config.json` holds).
        repo_id: the Hub repo the card is for; used in the usage snippet.
        report: the run report (`fit_report.json`: `eval_results`, `model_selection`, ...), when there is one.
        checkpoint: `checkpoint.checkpoint_info(folder)` of the saved weights (files, total size), when known.

    Returns:
        `huggingface_hub.ModelCard`; `.save("README.md")` writes it.

    Example:
        ```python
        >>> card = render_model_card(json.load(open("mapper/config.json")), "my-org/qwen3-14b-to-qwen3-32b")
        >>> card.data.base_model
        ['Qwen/Qwen3-14B', 'Qwen/Qwen3-32B']
        ```
    """
    config = migrate_config(config)  # a config.json of any version reads as the running version's
    source_id, target_id = config.get("source_model_id"), config.get("target_model_id")
    source_fp, target_fp = config.get("source_fingerprint") or {}, config.get("target_fingerprint") or {}
    calibration = config.get("calibration") or {}
    transfer = _transfer_facts(config)
    return ModelCard.from_template(
        _card_data(config, (source_id, target_id), (source_fp, target_fp), calibration),
        template_str=_template_text(),
        repo_ref=repo_id or "path/to/this/mapper",
        repo_id=repo_id,
        title=_title(config),
        mapper_type=config.get("mapper_type", RIDGE),
        source=_model_facts(source_id, config.get("source_revision"), source_fp, "SOURCE_MODEL_ID"),
        target=_model_facts(target_id, config.get("target_revision"), target_fp, "TARGET_MODEL_ID"),
        fit=_fit_facts(config, transfer["top_k_unused"]) + _checkpoint_facts(checkpoint),
        calibration=_calibration_facts(calibration),
        exact=_exact_layer_facts(config, transfer, (report or {}).get("exact_layers"))
        + _window_facts(config, (report or {}).get("exact_window")),
        frontier=_frontier_rows((report or {}).get("exact_layers")),
        frontier_timing=_frontier_timing((report or {}).get("exact_layers")),
        frontier_gate=_frontier_gate((report or {}).get("exact_layers")),
        layers=_layer_rows(config, transfer["default_exact"] or 0),
        top_k=None if transfer["top_k_unused"] else config.get("top_k"),
        **transfer,
        has_revisions=bool(config.get("source_revision") or config.get("target_revision")),
        has_heldout=bool(config.get("heldout_r2_key") or config.get("heldout_r2_value")),
        r2_summary=_r2_summary(config),
        eval_rows=_eval_rows((report or {}).get("eval_results")),
        selection=_selection_facts((report or {}).get("model_selection")),
        library_version=config.get("library_version"),
        paper_url=PAPER_URL,
    )


def _template_text() -> str:
    try:  # installed (wheel or editable): shipped as the package data of hf_kvtransfer.hub_cards
        return resources.files("hf_kvtransfer.hub_cards").joinpath(CARD_TEMPLATE).read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        # a source checkout on sys.path without installation: the canonical copy is <repo>/hub_cards/
        return (Path(__file__).resolve().parents[2] / "hub_cards" / CARD_TEMPLATE).read_text(encoding="utf-8")


def _is_hub_id(value: Any) -> bool:
    return (
        isinstance(value, str)
        and bool(HUB_ID.match(value))
        and "--" not in value
        and ".." not in value
        and not os.path.exists(value)
    )


def _is_data_file(value: str) -> bool:
    return Path(value).suffix.lower() in _DATA_FILE_SUFFIXES


def _title(config: dict) -> str:
    names = []
    for role in ("source", "target"):
        model_id = config.get(f"{role}_model_id")
        fingerprint = config.get(f"{role}_fingerprint") or {}
        names.append(model_id.rstrip("/").rsplit("/", 1)[-1] if model_id else fingerprint.get("model_type") or role)
    return f"KV-cache mapper {names[0]} → {names[1]}"


def _cell(value: Any) -> str:
    """A Markdown table cell: `-` for missing values, pipes escaped."""
    if value is None or value == "":
        return "–"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _number(value: Any, digits: int = 4) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _cell(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}" if 1e-3 <= abs(value) < 1e5 or value == 0 else f"{value:.3g}"


def _plain(value: Any) -> str:
    """Hyper-parameters as written: 1000000.0 -> 1,000,000; 0.001 -> 0.001; lists and strings unchanged."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return f"{value:g}" if isinstance(value, float) else _cell(value)


def _model_facts(model_id: str | None, revision: str | None, fingerprint: dict, placeholder: str) -> dict[str, str]:
    rope = fingerprint.get("rope_parameters") or {}
    rope_text = None
    if isinstance(rope, dict) and rope:
        rope_text = str(rope.get("rope_type", "default"))
        for key, label in (("rope_theta", "theta"), ("factor", "factor")):
            if rope.get(key) is not None:
                rope_text += f", {label}={_plain(rope[key])}"
    if fingerprint.get("partial_rotary_factor") not in (None, 1, 1.0):
        rope_text = f"{rope_text or 'default'}, partial={fingerprint['partial_rotary_factor']}"
    link = f"[{model_id}](https://huggingface.co/{model_id})" if _is_hub_id(model_id) else _cell(model_id)
    return {
        "id": model_id or placeholder,
        "link": link,
        "revision": _cell(revision),
        "revision_arg": f', revision="{revision}"' if revision else "",
        "model_type": _cell(fingerprint.get("model_type")),
        "layers": _cell(fingerprint.get("num_hidden_layers")),
        "kv_heads": _cell(fingerprint.get("num_key_value_heads")),
        "head_dim": _cell(fingerprint.get("head_dim")),
        "vocab_size": _cell(fingerprint.get("vocab_size")),
        "rope": _cell(rope_text),
    }


def _fit_facts(config: dict, k_unused: str = "") -> list[tuple[str, str]]:
    facts = [("Mapper type", _cell(config.get("mapper_type", RIDGE)))]
    if config.get("top_k") is not None:
        note = f" ({k_unused})" if k_unused else ""
        facts.append(("Source layers per target layer (k)", _number(config["top_k"]) + note))
    if config.get("ridge_lambda") is not None and config.get("mapper_type", RIDGE) in (RIDGE, LOWRANK):
        facts.append(("Ridge lambda (on centered data)", _plain(config["ridge_lambda"])))
    for key, value in (config.get("mlp") or {}).items():
        facts.append((f"MLP {key.replace('_', ' ')}", _plain(value)))
    if config.get("rank"):
        ranks = ", ".join(f"{k}/{v}" for k, v in config["rank"])
        facts.append(("Reduced rank (key/value per target layer)", ranks))
    if config.get("num_parameters") is not None:
        facts.append(("Parameters", _number(config["num_parameters"])))
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}.get(config.get("dtype") or "")
    if itemsize and config.get("num_parameters") is not None:
        facts.append(("Weights", f"{config['dtype']}, {config['num_parameters'] * itemsize / 2**20:.2f} MiB"))
    return facts


def _transfer_facts(config: dict) -> dict[str, Any]:
    """A default transfer with this mapper: its exact layers as the cache resolves them, what the mapped layers read
    (the phrase of `fit`, `info` and `eval`; None when every layer is exact), whether every layer is exact, and whether
    the maps read what the target computes in its exact layers (`exact_layers_needed`: its residual stream). Nothing
    for a partial config that no mapper could load (the card skips what it does not know)."""
    try:
        mapper_config = MapperConfig.from_dict(config)
    except (TypeError, KeyError, ValueError):
        return {"default_exact": None, "maps_read": None, "all_exact": False, "maps_read_target": False,
                "top_k_unused": ""}  # fmt: skip
    exact = resolve_num_exact_layers(mapper_config, None)
    mapped = exact < len(mapper_config.selected_layers)
    return {"default_exact": exact, "maps_read": maps_read(mapper_config, exact) if mapped else None,
            "all_exact": not mapped, "maps_read_target": mapped and exact_layers_needed(mapper_config)[0] > 0,
            "top_k_unused": top_k_unused(mapper_config, exact)}


def _exact_layer_facts(config: dict, transfer: dict[str, Any], probe: Any) -> list[tuple[str, str]]:
    """What `TransferredCache` computes itself with this mapper, and the content probe that chose it."""
    chosen = config.get("num_exact_layers")
    num_layers = (config.get("target_fingerprint") or {}).get("num_hidden_layers")
    facts = []
    if chosen is not None:
        facts.append(("Computed by the target (default `num_exact_layers`)", f"its first {chosen} of {num_layers} layers"))
    if config.get("num_recompute_tokens") is not None:
        facts.append(("Prompt tokens the target recomputes (default `num_recompute_tokens`)", str(config["num_recompute_tokens"])))
    if transfer["maps_read"] is not None:
        facts.append(("What the mapped layers read", transfer["maps_read"]))
    for inp in registered_map_inputs():  # what else an input tells of itself
        facts += inp.card_facts(config)
    if config.get("quality_gate"):
        facts.append(("Per-request quality gate", QualityGateConfig.from_value(config["quality_gate"]).describe()))
    if isinstance(probe, dict):
        if probe.get("reason"):
            facts.append(("Why", _cell(probe["reason"])))
        tried = [
            f"{row['num_exact_layers']}: " + ("n/a" if row.get("retention") is None else f"{100 * row['retention']:.1f}%"
            + (f" [{100 * row['retention_ci'][0]:.1f}, {100 * row['retention_ci'][1]:.1f}]" if row.get("retention_ci") else ""))
            for row in probe.get("tried", [])
        ]  # fmt: skip
        if tried:
            facts.append((f"Repeated-span retention by exact layers ({probe.get('num_items')} held-out spans)", "; ".join(tried)))
    return facts


def _window_facts(config: dict, search: Any) -> list[tuple[str, str]]:
    """How far back the exact layers attend (`MapperConfig.exact_window`), and the gate's verdict on each window the
    fit tried (`fitting/exact_window.py`)."""
    window = config.get("exact_window")
    if window is None and not (isinstance(search, dict) and search.get("tried")):
        return []
    facts = [("Exact layers attend within (default `exact_window`)",
              "the whole prompt" if window is None else f"the last {window} tokens up to each token")]  # fmt: skip
    if isinstance(search, dict) and search.get("tried"):
        facts.append(("Windows the content gate judged", "; ".join(
            f"{row['window']}: {'accepted' if row['gate'].get('accepted') else 'rejected'}" for row in search["tried"])))
    return facts


def _frontier_rows(probe: Any) -> list[dict[str, str]]:
    """One row per configuration the fit's probe tried (`exact_layers.choose_configuration`'s `candidates`)."""
    if not isinstance(probe, dict) or not probe.get("candidates"):
        return []
    rows = []
    for row in probe["candidates"]:
        if row.get("skipped"):  # not probed (the reason is in fit_report.json)
            continue
        rows.append({
            "inputs": _cell(row.get("inputs")),
            "exact": _cell(row.get("num_exact_layers")),
            "recompute": _cell(row.get("num_recompute_tokens") or "default"),
            "retention": _percent(row.get("retention"), row.get("retention_ci")),
            # cued recall scores the candidates reading a map input (their rows hold it); source-only rows have none
            "cued": "–" if "cued_retention" not in row else _percent(row.get("cued_retention"), row.get("cued_retention_ci")),
            "times": "–" if row.get("transfer_ms") is None else f"{row['transfer_ms']:.1f} / {row['target_prefill_ms']:.1f}",
            "speedup": "–" if row.get("speedup") is None else f"{row['speedup']:.2f}x",
            "gate_recall": _gate_cell(row, "recall"),
            "gate_handoff": _gate_cell(row, "handoff"),
            "kept": "yes" if row.get("passes") and (row.get("gate") or {}).get("accepted", not row.get("gate")) else "no",
            "chosen": "yes" if row.get("chosen") else "",
        })  # fmt: skip
    return rows


def _gate_cell(row: dict, task: str) -> str:
    """The content gate's paired difference (candidate - target own accuracy, points) and its items, or a dash."""
    verdict = ((row.get("gate") or {}).get("tasks") or {}).get(task)
    if not verdict:
        return "–"
    low, high = verdict["difference_ci"]
    gap = verdict.get("gap_recovered")  # the share of the source-to-target gap recovered (None: no gap)
    gap = "" if gap is None else f"; gap recovered {_percent(gap, verdict.get('gap_recovered_ci'))}"
    return f"{100 * verdict['difference']:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] on {verdict['num_items']}{gap}"


def _frontier_gate(probe: Any) -> str:
    gate = (probe or {}).get("gate") if isinstance(probe, dict) else None
    if not gate or not gate.get("used"):
        return "no content gate: the repeated-span and cued-recall screen decided"
    return (f"passage recall and hand-off on held-out probe items, paired against the target's own answers; kept when "
            f"the 95% interval's low end is above -{100 * gate['tolerance']:.0f} points on each, {gate['items']} items "
            f"per task, up to {gate['max_items']} for an undecided candidate")


def _percent(value: float | None, ci: list[float] | None) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.1f}%" + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")


def _frontier_timing(probe: Any) -> str:
    timing = (probe or {}).get("timing") if isinstance(probe, dict) else None
    if not timing:
        return ""
    clock = f" of {timing['clock']}" if timing.get("clock") else ""
    rounds = f" over {timing.get('rounds')} interleaved rounds" if timing.get("rounds") else ""
    return f"{timing.get('num_tokens')} prompt tokens, {timing.get('threads')} thread, medians{clock}{rounds}"


def _checkpoint_facts(checkpoint: dict | None) -> list[tuple[str, str]]:
    if not checkpoint or not checkpoint.get("files"):
        return []
    files = checkpoint["files"]
    shards = checkpoint.get("num_shards") or 0
    layout = f"{shards} safetensors shards + index" if shards else ", ".join(files)
    return [("Checkpoint", f"{checkpoint['total_size'] / 2**20:,.2f} MiB ({checkpoint['total_size']:,} bytes) in {layout}")]


def _calibration_facts(calibration: dict) -> list[tuple[str, str]]:
    labels = {
        "dataset": "Dataset", "config": "Config", "split": "Split", "text_field": "Text field",
        "num_sequences": "Sequences", "seq_len": "Tokens per sequence",
        "stride": "Token stride (every n-th token used)", "num_tokens": "Tokens used for the fit",
    }  # fmt: skip
    facts = []
    for key, label in labels.items():
        value = calibration.get(key)
        if value is None:
            continue
        if key == "dataset" and _is_hub_id(value) and not _is_data_file(value):
            value = f"[{value}](https://huggingface.co/datasets/{value})"
        facts.append((label, _number(value) if key != "dataset" else str(value)))
    facts.extend((key.replace("_", " ").capitalize(), _cell(v)) for key, v in calibration.items() if key not in labels)
    return facts


def _at(values: Any, i: int) -> str:
    return _number(values[i]) if isinstance(values, list) and i < len(values) else "–"


def _layer_rows(config: dict, exact: int) -> list[dict[str, str]]:
    """One row per target layer; the first `exact`, which a default transfer computes itself, are marked."""
    rows = []
    for t, sources in enumerate(config.get("selected_layers") or []):
        rows.append({
            "target": f"{t} (computed by the target)" if t < exact else str(t),
            "sources": (", ".join(str(s) for s in sources) or "none") if isinstance(sources, list) else _cell(sources),
            "r2_key": _at(config.get("fit_r2_key"), t),
            "r2_value": _at(config.get("fit_r2_value"), t),
            "heldout_key": _at(config.get("heldout_r2_key"), t),
            "heldout_value": _at(config.get("heldout_r2_value"), t),
        })  # fmt: skip
    return rows


def _r2_summary(config: dict) -> str | None:
    parts = []
    for key, label in (("fit_r2_key", "fit R² K"), ("fit_r2_value", "fit R² V"),
                       ("heldout_r2_key", "held-out R² K"), ("heldout_r2_value", "held-out R² V")):  # fmt: skip
        values = [v for v in config.get(key) or [] if isinstance(v, (int, float)) and math.isfinite(v)]
        if values:
            parts.append(f"mean {label} = {sum(values) / len(values):.4f} (min {min(values):.4f})")
    return "; ".join(parts) or None


def _selection_facts(selection: Any) -> list[tuple[str, str]]:
    """How k / lambda were chosen (from the run report), as card lines."""
    if not isinstance(selection, dict):
        return []
    facts = []
    if selection.get("metric"):
        facts.append(("Metric", _cell(selection["metric"])))
    for key, label in (("top_k_candidates", "k candidates"), ("ridge_lambda_candidates", "Lambda candidates")):
        if selection.get(key):
            facts.append((label, ", ".join(_plain(v) for v in selection[key])))
    for choice in selection.get("chosen") or []:
        if isinstance(choice, dict):
            facts.append(("Chosen", f"k = {_plain(choice.get('top_k'))}, lambda = {_plain(choice.get('ridge_lambda'))}"))
    if selection.get("heldout_tokens") is not None:
        facts.append(("Held-out tokens", _number(selection["heldout_tokens"])))
    return facts


def _eval_rows(results: Any) -> list[tuple[str, str]]:
    if not isinstance(results, dict):
        return []
    rows = []
    for name, value in results.items():
        if isinstance(value, dict):
            rows.extend((f"{name} / {k}", _number(v)) for k, v in value.items())
        else:
            rows.append((str(name), _number(value)))
    return [(_cell(name), value) for name, value in rows]


__all__ = ["render_model_card"]
