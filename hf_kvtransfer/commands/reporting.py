"""Reports above the library core: markdown tables, plots and result files of evaluations and benchmarks.

`evaluate.evaluate` and `bench.run_benchmark` return plain dicts; this module renders them (the CLI's `eval` and
`bench` print and write what it makes).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (plots are written, never shown)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'hf-kvtransfer[plot]' (or pip install matplotlib)") from exc
    return plt


# -- what a transfer computed itself (eval and bench print it at start and in their reports) ------------------


def transfer_settings(
    num_exact_layers: int,
    num_layers: int | None,
    origin: str | None,
    num_recompute_tokens: int | Sequence[int] | None,
    recompute_default: bool = False,
    exact_window: int | None = None,
    maps_read: str | None = None,
) -> str:
    """`"4 of 8 target layers exact (recorded by the mapper's fit), 32 recomputed tokens (TransferredCache's default:
    ...); what the mapped layers read: ..."`: what the target computed itself in a transfer, and what the maps of the other
    layers read (`maps_clause`). `num_recompute_tokens`: the number used, the numbers used by prompt length, or None
    (not resolved yet: the default); `recompute_default` says it is the default."""
    computed = _computed_settings(num_exact_layers, num_layers, origin, num_recompute_tokens, recompute_default,
                                  exact_window)  # fmt: skip
    return computed + maps_clause(num_exact_layers, num_layers, maps_read)


def maps_clause(num_exact_layers: int, num_layers: int | None, maps_read: str | None) -> str:
    """`"; what the mapped layers read: ..."` (`map_inputs.maps_read`), or nothing when every layer is exact or it is not
    known (results written before it was recorded)."""
    if not maps_read or num_exact_layers >= (num_layers or math.inf):
        return ""
    return f"; what the mapped layers read: {maps_read}"


def _computed_settings(num_exact_layers: int, num_layers: int | None, origin: str | None,
                       num_recompute_tokens: int | Sequence[int] | None, recompute_default: bool,
                       exact_window: int | None) -> str:  # fmt: skip
    """`transfer_settings`' part on what the target computed itself."""
    from ..core.defaults import DEFAULT_NUM_RECOMPUTE_TOKENS

    of = f" of {num_layers}" if num_layers else ""
    exact = f"{num_exact_layers}{of} target layers exact" + (f" ({origin})" if origin else "")
    if exact_window and num_exact_layers > 1:
        exact += f", attending within {exact_window} tokens"
    every_layer = bool(num_layers) and num_exact_layers >= num_layers
    if num_recompute_tokens is None and every_layer:
        return f"{exact}, 1 recomputed token (TransferredCache's default when every layer is exact)"
    if num_recompute_tokens is None:
        default = f"{DEFAULT_NUM_RECOMPUTE_TOKENS} recomputed tokens, at most half a shorter prompt"
        return f"{exact}, {default} (TransferredCache's default)"
    if isinstance(num_recompute_tokens, (list, tuple)):
        recompute = f"{'/'.join(map(str, num_recompute_tokens))} recomputed tokens by prompt length"
    else:
        recompute = f"{num_recompute_tokens} recomputed token{'s' if num_recompute_tokens != 1 else ''}"
    if recompute_default and every_layer:
        recompute += " (TransferredCache's default when every layer is exact)"
    elif recompute_default:
        recompute += f" (TransferredCache's default: {DEFAULT_NUM_RECOMPUTE_TOKENS}, at most half a shorter prompt)"
    return f"{exact}, {recompute}"


def origin_of_exact_layers(mapper, requested: int | None) -> str:
    """Where the exact-layer count of `TransferredCache(..., num_exact_layers=requested)` with `mapper` comes from."""
    if requested is not None:
        return "set by the caller"
    if mapper.config.num_exact_layers is not None:
        return "recorded by the mapper's fit"
    return "TransferredCache's default for a mapper that records none"


ALL_MAPPED = "all mapped: 0 exact layers, 1 recomputed token (lossy where the mapper needs exact layers)"


def ttft_settings_line(
    num_exact_layers: int, num_layers: int, origin: str | None, num_recompute_tokens: int | None,
    exact_window: int | None = None, maps_read: str | None = None,
) -> str:
    """The line `bench` prints before it times: what time to first token at the defaults and all mapped use."""
    defaults = transfer_settings(num_exact_layers, num_layers, origin, num_recompute_tokens, exact_window=exact_window,
                                 maps_read=maps_read)  # fmt: skip
    return f"time to first token at the mapper's defaults: {defaults}; beside it, {ALL_MAPPED}"


# -- evaluation (evaluate.evaluate) ---------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def _ci(ci: Sequence[float] | None) -> str:
    if not ci or not all(math.isfinite(c) for c in ci):
        return ""
    return f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def evaluation_markdown(results: dict[str, Any]) -> str:
    """A readable summary of `evaluate` results: one table of scores, then diagnostics and drift."""
    cfg = results.get("config", {})
    title = f"**{cfg.get('source')} -> {cfg.get('target')}**"
    lines = [f"{title} (top_k={cfg.get('top_k')}, lambda={cfg.get('ridge_lambda')})", ""]
    if cfg.get("num_exact_layers") is not None:
        lines[-1:-1] = ["", f"Every transfer: {eval_settings(cfg)}."]
    ppl = results.get("prefix_perplexity")
    rows = _score_rows(results)
    if rows:
        lines += [
            "| metric | target (own prefill) | transfer | floor | retention | floor-normalized retention [95% CI] |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    content = _content_markdown(results)
    lines += content[1:] if content and lines[-1] == "" else content  # one blank line between sections
    if ppl and "logit_kl" in ppl:
        lines += _diagnostics_markdown(ppl, results.get("kv_r2", {}))
    lines += _depth_markdown(results.get("recall_by_depth"))
    turns = results.get("multi_turn")
    if turns:
        lines += _multi_turn_markdown(turns)
    return "\n".join(lines) + "\n"


def _score_rows(results: dict[str, Any]) -> list[str]:
    """`evaluation_markdown`'s score table rows: prefix-conditioned perplexity, then the continuation task and
    multiple choice, those that ran."""
    rows: list[str] = []
    ppl = results.get("prefix_perplexity")
    if ppl:
        p = ppl["perplexity"]
        rows.append(
            f"| prefix-conditioned perplexity (T={ppl['prefix_len']}, {ppl['num_windows']} windows) "
            f"| {p['target']:.3f} | {p['transfer']:.3f} | {p['floor']:.3f} (no prefix) | {_pct(ppl['retention'])} "
            f"| {_pct(ppl['normalized_retention'])}{_ci(ppl['normalized_retention_ci'])} |"
        )
    for key, name in (("continuation", "continuation task"), ("multiple_choice", "multiple choice")):
        mc = results.get(key)
        if mc:
            a = mc["acc"]
            rows.append(
                f"| {name} acc ({mc['num_items']} items) | {_pct(a['target'])} | {_pct(a['transfer'])} "
                f"| {_pct(mc['chance'])} (chance; no context: {_pct(a['no_context'])}) | {_pct(mc['retention'])} "
                f"| {_pct(mc['normalized_retention'])}{_ci(mc['normalized_retention_ci'])} |"
            )
    return rows


def _diagnostics_markdown(ppl: dict[str, Any], r2: dict[str, list[float]]) -> list[str]:
    """`evaluation_markdown`'s diagnostics against the target's own prefill, and per target layer the attention
    output's cosine and the K/V R^2 (`r2`, NaN where missing)."""
    lines = [
        "",
        f"Against the target's own prefill: logit KL {ppl['logit_kl']:.4f} nats/token, top-1 agreement "
        f"{_pct(ppl['top1_agreement'])}; context worth {ppl['context_gain_nats']:.4f} nats/token to the target.",
        "",
        "| target layer | attention-output cosine | K R^2 | V R^2 |",
        "|---|---|---|---|",
    ]
    for t, cos in enumerate(ppl["attention_cosine"]):
        k = r2.get("key", [float("nan")] * (t + 1))[t]
        v = r2.get("value", [float("nan")] * (t + 1))[t]
        lines.append(f"| {t} | {cos:.4f} | {k:.3f} | {v:.3f} |")
    return lines


def _multi_turn_markdown(turns: dict[str, Any]) -> list[str]:
    """`evaluation_markdown`'s multi-turn handoff table (`multi_turn_drift`)."""
    lines = [
        "",
        f"Multi-turn handoff ({turns['num_conversations']} conversations, {turns['turn_len']} tokens per turn):",
        "",
        "| turn | model | logit KL vs standalone | top-1 agreement | nll | nll standalone |",
        "|---|---|---|---|---|---|",
    ]
    for t in turns["turns"]:
        lines.append(
            f"| {t['turn']} | {t['model']} | {t['logit_kl']:.4f} | {_pct(t['top1_agreement'])} | {t['nll']:.4f} "
            f"| {t['nll_standalone']:.4f} |"
        )
    return lines


def eval_settings(config: dict[str, Any]) -> str:
    """What `evaluate`'s transfers computed themselves, from its results' `config`: the exact layers and the
    recomputed tokens each task used."""
    used = config.get("num_recompute_tokens_used") or {}
    values = sorted({v for u in used.values() for v in (u if isinstance(u, list) else [u])})
    requested = config.get("num_recompute_tokens")
    default = requested in (None, "default")
    recompute = values[0] if len(values) == 1 else values or (None if default else requested)
    text = transfer_settings(
        config["num_exact_layers"], config.get("num_target_layers"), config.get("exact_layers_origin"), recompute, default,
        config.get("exact_window"),
    )
    if len(values) > 1:
        text += " (" + ", ".join(f"{task}: {u}" for task, u in used.items()) + ")"
    return text + maps_clause(config["num_exact_layers"], config.get("num_target_layers"), config.get("maps_read"))


# Content tasks (content_eval.py): results key, label, per-setting score, whether it is an accuracy.
_CONTENT_ROWS = (
    ("repeated_span", "repeated span NLL (nats/token; lower is better)", "nll", False),
    ("passage_recall", "passage recall accuracy", "accuracy", True),
    ("handoff", "hand-off question 2 accuracy", "accuracy", True),
)


def _mean_ci(stat: dict[str, Any] | None, percent: bool) -> str:
    if not stat:
        return "-"
    if percent:
        return _pct(stat["mean"]) + _ci(stat.get("ci"))
    ci = stat.get("ci") or []
    bounds = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if len(ci) == 2 and all(math.isfinite(c) for c in ci) else ""
    return f"{stat['mean']:.3f}{bounds}"


def _paired(res: dict[str, Any], percent: bool) -> str:
    """Transfer minus own prefill on the same items, with its 95% interval: in points for accuracies."""
    diff = res.get("transfer_minus_own")
    if not diff:
        return "-"
    scale, digits = (100, 1) if percent else (1, 3)
    values = [diff["mean"], *(diff.get("ci") or [])]
    if not all(math.isfinite(v) for v in values):
        return "-"
    mean, *bounds = (f"{scale * v:+.{digits}f}" for v in values)
    return mean + (f" [{bounds[0]}, {bounds[1]}]" if bounds else "")


def _gap(res: dict[str, Any], notes: list[str], label: str) -> str:
    """The share of the source-to-target gap a content task's transfer recovers (recall and hand-off), or why not."""
    if res.get("gap_recovered") is not None:
        gap = res["target_minus_source"]  # a share of a gap the items cannot resolve is noise: say so beside it
        shown = _pct(res["gap_recovered"]) + _ci(res.get("gap_recovered_ci")) + f"; gap {_mean_ci(gap, True)}"
        return shown + (", not significant" if math.isfinite(gap["ci"][0]) and gap["ci"][0] <= 0 else "")
    if res.get("gap_undefined"):
        notes.append(f"{label}: {res['gap_undefined']}.")
        return "undefined"
    return "-"


def _content_markdown(results: dict[str, Any]) -> list[str]:
    """The content tasks: own / transfer / no context with 95% CIs, retention, and greedy agreement."""
    rows, notes = [], []
    for key, label, score, percent in _CONTENT_ROWS:
        res = results.get(key)
        if not res:
            continue
        cells = [_mean_ci(res[score].get(s), percent) for s in ("own", "transfer", "no_context", "source_alone")]
        if res.get("retention") is not None:
            # The gain beside the ratio: a retention over a small gain is a ratio of small numbers.
            gain = res["context_gain"]
            retention = _pct(res["retention"]) + _ci(res.get("retention_ci"))
            retention += f"; context gain {_mean_ci(gain, percent)}"
            if math.isfinite(gain["ci"][0]) and gain["ci"][0] <= 0:
                retention += ", not significant"
        else:
            retention = "undefined"
            notes.append(f"{label}: {res.get('retention_undefined')}.")
        if key == "handoff":
            label += f" (source answered question 1: {_mean_ci(res['q1_accuracy'], True)})"
        rows.append(f"| {label} | {res['num_items']} | " + " | ".join(cells)
                    + f" | {_paired(res, percent)} | {retention} | {_gap(res, notes, label)} |")
    agreement = results.get("greedy_agreement")
    if agreement:
        rows.append(
            f"| greedy generations equal to own prefill's: first token / all {agreement['max_new_tokens']} tokens "
            f"| {agreement['num_prompts']} | - | {_mean_ci(agreement['first_token_agreement'], True)} / "
            f"{_mean_ci(agreement['all_tokens_agreement'], True)} | - | - | - | - | - |"
        )
        reference = agreement.get("reference")
        if reference and "skipped" in reference:
            notes.append(f"greedy agreement: no {reference['dtype']} reference ({reference['skipped']}).")
        elif reference:
            # Numerics alone: how often the target's own cache, rounded, already changes the generation.
            rows.append(
                f"| the same from the target's own cache rounded to {reference['dtype']} (numeric reference) "
                f"| {agreement['num_prompts']} | - | {_mean_ci(reference['first_token_agreement'], True)} / "
                f"{_mean_ci(reference['all_tokens_agreement'], True)} | - | - | - | - | - |"
            )
    if not rows:
        return []
    lines = [
        "",
        "Content tasks (bootstrap 95% CIs over items; no context = first occurrence replaced / passage left out / "
        "question 2 alone; transfer - own in points of accuracy, or nats for the NLL, on the same items):",
        "",
        "| task | items | own prefill | transfer | no context | source alone | transfer - own, paired [95% CI] "
        "| floor-normalized retention [95% CI]; context gain | gap recovered [95% CI] |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    return lines + ([""] + notes if notes else [])


def _depth_cell(cell: dict[str, Any]) -> str:
    acc = cell["accuracy"]
    text = f"{_pct(acc['own']['mean'])} / {_pct(acc['transfer']['mean'])}" if "transfer" in acc else _pct(acc["own"]["mean"])
    return text + (f" ({_paired(cell, True)})" if cell.get("transfer_minus_own") else "")


def _depth_markdown(depth: dict[str, Any] | None) -> list[str]:
    """Recall by depth: one row per context length, one column per needle position; own / transfer accuracy and
    the paired difference in points."""
    if not depth:
        return []
    by = {(c["context_tokens"], c["position"]): c for c in depth["cells"]}
    lines = ["", f"Passage recall by context length and needle position ({depth['items']} items per cell; own prefill / "
             "transfer accuracy, transfer - own in points [95% CI]):", "",
             "| context tokens | " + " | ".join(depth["positions"]) + " |",
             "|---|" + "---|" * len(depth["positions"])]  # fmt: skip
    for length in depth["lengths"]:
        lines.append(f"| {length} | " + " | ".join(_depth_cell(by[length, pos]) for pos in depth["positions"]) + " |")
    return lines


def plot_depth(ax, depth: dict[str, Any]) -> None:
    """A heat-map of transfer - own passage-recall accuracy (points) over context length x needle position."""
    import numpy as np

    by = {(c["context_tokens"], c["position"]): c for c in depth["cells"]}
    grid = np.array([[100 * ((by[n, p].get("transfer_minus_own") or {}).get("mean", float("nan")))
                      for p in depth["positions"]] for n in depth["lengths"]])  # fmt: skip
    image = ax.imshow(grid, cmap="RdYlGn", vmin=-50, vmax=50, aspect="auto")
    ax.set_xticks(range(len(depth["positions"])), depth["positions"])
    ax.set_yticks(range(len(depth["lengths"])), [str(n) for n in depth["lengths"]])
    ax.set_xlabel("needle position")
    ax.set_ylabel("context tokens")
    for i, n in enumerate(depth["lengths"]):
        for j, p in enumerate(depth["positions"]):
            own = by[n, p]["accuracy"]["own"]["mean"]
            ax.text(j, i, f"{grid[i, j]:+.0f}\nown {100 * own:.0f}%", ha="center", va="center", fontsize=8)
    ax.set_title("passage recall: transfer - own (points)")
    ax.figure.colorbar(image, ax=ax)


def _plot_content(ax, results: dict[str, Any]) -> None:
    """Bars own / transfer / no context per content task, with 95% CI whiskers, on one 0..1 scale: accuracies,
    and for repeated spans exp(-NLL), the geometric-mean probability of a repeated token."""
    tasks = []  # (label, {setting: (value, low, high)})
    span = results.get("repeated_span")
    if span:
        to_p = {s: (math.exp(-v["mean"]), *(math.exp(-c) for c in reversed(v["ci"]))) for s, v in span["nll"].items()}
        tasks.append(("repeated span\nexp(-NLL)", to_p))
    for key, label in (("passage_recall", "passage recall"), ("handoff", "hand-off Q2")):
        if results.get(key):
            tasks.append((label, {s: (v["mean"], *v["ci"]) for s, v in results[key]["accuracy"].items()}))
    agreement = results.get("greedy_agreement")
    if agreement:  # transfer vs own prefill: only the transfer has a bar
        for key, label in (("first_token_agreement", "first token"), ("all_tokens_agreement", f"all {agreement['max_new_tokens']} tokens")):
            stat = agreement[key]
            tasks.append((f"greedy agreement\n{label}", {"transfer": (stat["mean"], *stat["ci"])}))
    width = 0.27
    for j, (setting, label) in enumerate((("own", "own prefill"), ("transfer", "transfer"), ("no_context", "no context"))):
        xs, heights, errors = [], [], [[], []]
        for i, (_, values) in enumerate(tasks):
            if setting not in values:
                continue
            mean, low, high = values[setting]
            xs.append(i + (j - 1) * width)
            heights.append(mean)
            finite = math.isfinite(low) and math.isfinite(high)
            errors[0].append(max(mean - low, 0) if finite else 0)
            errors[1].append(max(high - mean, 0) if finite else 0)
        if xs:
            ax.bar(xs, heights, width, yerr=errors, capsize=3, label=label, color=f"C{j}")
    ax.set_xticks(range(len(tasks)))
    ax.set_xticklabels([label for label, _ in tasks], fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_title("content tasks (95% CI)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def plot_evaluation(results: dict[str, Any], path: str | os.PathLike) -> None:
    """Save a PNG: per-layer attention-output cosine and K/V R^2, the content tasks (own / transfer / no context
    with CI whiskers) and drift per turn (those measured)."""
    plt = pyplot()
    ppl, r2, turns = results.get("prefix_perplexity", {}), results.get("kv_r2"), results.get("multi_turn")
    content = any(results.get(key) for key in ("repeated_span", "passage_recall", "handoff", "greedy_agreement"))
    depth = results.get("recall_by_depth")
    panels = int(bool(ppl.get("attention_cosine") or r2)) + int(content) + int(bool(turns)) + int(bool(depth))
    if panels == 0:
        raise ValueError("nothing to plot: the results hold no per-layer diagnostics, content tasks, recall by depth or "
                         "multi-turn drift")
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax_iter = iter(axes[0])
    if ppl.get("attention_cosine") or r2:
        ax = next(ax_iter)
        if ppl.get("attention_cosine"):
            ax.plot(ppl["attention_cosine"], marker="o", label="attention-output cosine")
        if r2:
            ax.plot(r2["key"], marker="s", label="K R^2 (stripped)")
            ax.plot(r2["value"], marker="^", label="V R^2")
        ax.set_xlabel("target layer")
        ax.set_ylim(min(0.0, ax.get_ylim()[0]), 1.02)
        ax.set_title("per-layer fidelity on evaluation tokens")
        ax.legend()
        ax.grid(alpha=0.3)
    if content:
        _plot_content(next(ax_iter), results)
    if depth:
        plot_depth(next(ax_iter), depth)
    if turns:
        ax = next(ax_iter)
        xs = [t["turn"] for t in turns["turns"]]
        ax.plot(xs, [t["logit_kl"] for t in turns["turns"]], marker="o", color="C3", label="logit KL vs standalone")
        for t in turns["turns"]:
            ax.annotate(t["model"], (t["turn"], t["logit_kl"]), textcoords="offset points", xytext=(0, 6), ha="center")
        ax.set_xlabel("turn")
        ax.set_ylabel("KL (nats/token)")
        ax2 = ax.twinx()
        ax2.plot(xs, [t["top1_agreement"] for t in turns["turns"]], marker="s", color="C2", label="top-1 agreement")
        ax2.set_ylabel("top-1 agreement")
        ax.set_title("multi-turn handoff drift")
        ax.legend(loc="upper left")
        ax2.legend(loc="lower right")
    cfg = results.get("config", {})
    fig.suptitle(f"{cfg.get('source')} -> {cfg.get('target')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- benchmark (bench.run_benchmark) -------------------------------------------------------------------------
def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _count(n: int, noun: str) -> str:
    """`1 thread`, `2 threads`."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def bench_markdown(report: dict[str, Any]) -> str:
    """A readable summary of `run_benchmark` output."""
    env, settings = report["environment"], report["settings"]
    machine = env.get("cuda_device") or env["cpu"]
    lines = [
        f"Machine: {machine}; torch {env['torch']}, transformers {env['transformers']}, "
        f"{_count(env['torch_num_threads'], 'thread')}, OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}; "
        f"device {settings['device']}, {settings['dtype']}, batch 1, attention {settings['attn_implementation']}; "
        f"medians of {settings['repeats']} after {settings['warmup']} warm-up; load average {env.get('load_average')}.",
        "",
        "| mapper | parameters | bytes | dtype | rank (key/value per layer) | fit R^2 K/V | held-out R^2 K/V | "
        "held-out R^2 K/V, bf16 weights |",
        "|---|---:|---:|---|---|---|---|---|",
        *(_mapper_row(name, size) for name, size in report["mappers"].items()),
    ]
    names = list(report["mappers"])
    ttft = "ttft_defaults" in settings
    if ttft:
        lines += ["", _ttft_line(settings, report["results"])]
    header = ["T", "prefill body ms", "full fwd ms"]
    header += [f"transfer {n} ms: its exact layers, then the maps (x faster wall, CPU time; FLOP ratio)" for n in names]
    if ttft:
        header += ["TTFT own ms", "TTFT at defaults ms (x faster)", "TTFT all mapped ms (x faster; lossy)"]
    header += ["decode own / transfer ms (overhead)", "peak prefill / transfer"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for row in report["results"]:
        lines.append("| " + " | ".join(_result_cells(row, names, ttft)) + " |")
    return "\n".join(lines) + "\n"


def _mapper_row(name: str, size: dict[str, Any]) -> str:
    """`bench_markdown`'s table row of one mapper (`mapper_size` and its R^2)."""

    def pair(values) -> str:
        return "-" if not values or values[0] is None else f"{values[0]:.4f} / {values[1]:.4f}"

    ranks = "full" if size["rank"] is None else ", ".join(f"{k}/{v}" for k, v in size["rank"])
    return (
        f"| {name} | {size['parameters']:,} | {_fmt_bytes(size['bytes'])} | {size['dtype']} | {ranks} | "
        f"{pair(size.get('fit_r2'))} | {pair(size.get('heldout_r2'))} | {pair(size.get('heldout_r2_bf16'))} |"
    )


def _ttft_line(settings: dict[str, Any], results: list[dict[str, Any]]) -> str:
    """`bench_markdown`'s line on what the time to first token compares: the settings at the mapper's defaults
    (the recomputed tokens each row used when they were the default)."""
    defaults = settings["ttft_defaults"]
    used = sorted({row["ttft_defaults_num_recompute_tokens"] for row in results})
    default = defaults["num_recompute_tokens"] is None
    recompute = (used[0] if len(used) == 1 else used) if default else defaults["num_recompute_tokens"]
    at_defaults = transfer_settings(
        defaults["num_exact_layers"], settings.get("num_target_layers"), defaults["exact_layers_origin"], recompute,
        default, defaults.get("exact_window"), defaults.get("maps_read"),
    )
    return (
        f"Time to first token ({settings['ttft_mapper']}; the target's own prefill vs the transfer, logits of the "
        f"last position): **at the mapper's defaults**, {at_defaults}; beside it, {ALL_MAPPED}."
    )


def _result_cells(row: dict[str, Any], names: list[str], ttft: bool) -> list[str]:
    """`bench_markdown`'s cells of one sequence length's results."""
    cells = [str(row["seq_len"]), f"{row['prefill_body_ms']:.1f}", f"{row.get('prefill_full_ms', float('nan')):.1f}"]
    for n in names:
        t = row["transfer"][n]
        cells.append(
            f"{t['ms']:.2f} ({t['speedup_vs_body']:.1f}x, CPU {t['cpu_speedup_vs_body']:.1f}x; {t['flop_ratio']:.0f}x)"
        )
    if ttft:
        cells += [
            f"{row['ttft_own_ms']:.1f}",
            f"{row['ttft_defaults_ms']:.1f} ({row['ttft_defaults_speedup']:.2f}x)",
            f"{row['ttft_all_mapped_ms']:.1f} ({row['ttft_all_mapped_speedup']:.2f}x)"
            if row["ttft_all_mapped_ms"] is not None else "- (maps read the residual)",
        ]
    cells.append(
        f"{row['decode_own_ms']:.2f} / {row['decode_transfer_ms']:.2f} ({row['decode_overhead_pct']:+.1f}%, "
        f"CPU {row['decode_overhead_pct_cpu']:+.1f}%)"
        if "decode_own_ms" in row else "-"
    )  # fmt: skip
    first = row["transfer"][names[0]]
    cells.append(f"{_fmt_bytes(row.get('prefill_body_peak_bytes'))} / {_fmt_bytes(first.get('peak_bytes'))}")
    return cells


def plot_bench(report: dict[str, Any], path: str | os.PathLike) -> None:
    """Time vs. sequence length (log-log): own prefill, full forward and each mapper's transfer; beside it, time to
    first token: the target's own, at the mapper's defaults, and all mapped (those measured)."""
    plt = pyplot()
    rows = report["results"]
    seq = [r["seq_len"] for r in rows]
    ttft = all("ttft_defaults_ms" in r for r in rows)
    fig, axes = plt.subplots(1, 1 + ttft, figsize=(6.5 * (1 + ttft), 4.5), squeeze=False)
    ax = axes[0][0]
    ax.plot(seq, [r["prefill_body_ms"] for r in rows], "o-", label="target prefill (body)")
    if all("prefill_full_ms" in r for r in rows):
        ax.plot(seq, [r["prefill_full_ms"] for r in rows], "o--", label="target forward (full)")
    for name in report["mappers"]:
        ax.plot(seq, [r["transfer"][name]["ms"] for r in rows], "s-", label=f"transfer, all layers mapped: {name}")
    ax.set_title("transfer vs prefill", fontsize=9)
    if ttft:
        defaults = report["settings"]["ttft_defaults"]
        ax2 = axes[0][1]
        ax2.plot(seq, [r["ttft_own_ms"] for r in rows], "o-", color="C0", label="target's own prefill")
        ax2.plot(seq, [r["ttft_defaults_ms"] for r in rows], "s-", color="C2",
                 label=f"transfer at the mapper's defaults ({defaults['num_exact_layers']} exact layers)")  # fmt: skip
        if report["settings"].get("ttft_all_mapped"):
            ax2.plot(seq, [r["ttft_all_mapped_ms"] for r in rows], "^--", color="C3", label="all mapped (0 exact; lossy)")
        ax2.set_title("time to first token", fontsize=9)
    env = report["environment"]
    for a in axes[0]:
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("context length (tokens)")
        a.set_ylabel("time (ms, median)")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(f"{env.get('cuda_device') or env['cpu']}"[:80], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_bench_report(report: dict[str, Any], output_dir: str | os.PathLike) -> dict[str, Path]:
    """Write `bench.json`, `bench.md` and (with matplotlib) `bench.png`; returns the paths written."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md"}
    paths["json"].write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    paths["markdown"].write_text(bench_markdown(report))
    try:
        plot_bench(report, out / "bench.png")
        paths["plot"] = out / "bench.png"
    except ImportError as exc:
        logger.warning("%s; skipping the plot", exc)
    return paths


__all__ = [
    "bench_markdown", "eval_settings", "evaluation_markdown", "plot_bench", "plot_evaluation", "pyplot", "save_bench_report",
    "origin_of_exact_layers", "transfer_settings", "ttft_settings_line",
]
