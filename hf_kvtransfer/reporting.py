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
    lines += [
        "| metric | target (own prefill) | transfer | floor | retention | floor-normalized retention [95% CI] |",
        "|---|---|---|---|---|---|",
    ]
    ppl = results.get("prefix_perplexity")
    if ppl:
        p = ppl["perplexity"]
        lines.append(
            f"| prefix-conditioned perplexity (T={ppl['prefix_len']}, {ppl['num_windows']} windows) "
            f"| {p['target']:.3f} | {p['transfer']:.3f} | {p['floor']:.3f} (no prefix) | {_pct(ppl['retention'])} "
            f"| {_pct(ppl['normalized_retention'])}{_ci(ppl['normalized_retention_ci'])} |"
        )
    for key, name in (("continuation", "continuation task"), ("multiple_choice", "multiple choice")):
        mc = results.get(key)
        if mc:
            a = mc["acc"]
            lines.append(
                f"| {name} acc ({mc['num_items']} items) | {_pct(a['target'])} | {_pct(a['transfer'])} "
                f"| {_pct(mc['chance'])} (chance; no context: {_pct(a['no_context'])}) | {_pct(mc['retention'])} "
                f"| {_pct(mc['normalized_retention'])}{_ci(mc['normalized_retention_ci'])} |"
            )
    if ppl and "logit_kl" in ppl:
        lines += [
            "",
            f"Against the target's own prefill: logit KL {ppl['logit_kl']:.4f} nats/token, top-1 agreement "
            f"{_pct(ppl['top1_agreement'])}; context worth {ppl['context_gain_nats']:.4f} nats/token to the target.",
            "",
            "| target layer | attention-output cosine | K R^2 | V R^2 |",
            "|---|---|---|---|",
        ]
        r2 = results.get("kv_r2", {})
        for t, cos in enumerate(ppl["attention_cosine"]):
            k = r2.get("key", [float("nan")] * (t + 1))[t]
            v = r2.get("value", [float("nan")] * (t + 1))[t]
            lines.append(f"| {t} | {cos:.4f} | {k:.3f} | {v:.3f} |")
    turns = results.get("multi_turn")
    if turns:
        lines += [
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
    return "\n".join(lines) + "\n"


def plot_evaluation(results: dict[str, Any], path: str | os.PathLike) -> None:
    """Save a PNG: per-layer attention-output cosine and K/V R^2, and drift per turn (if measured)."""
    plt = pyplot()
    ppl, r2, turns = results.get("prefix_perplexity", {}), results.get("kv_r2"), results.get("multi_turn")
    panels = int(bool(ppl.get("attention_cosine") or r2)) + int(bool(turns))
    if panels == 0:
        raise ValueError("nothing to plot: the results hold neither per-layer diagnostics nor multi-turn drift")
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


def bench_markdown(report: dict[str, Any]) -> str:
    """A readable summary of `run_benchmark` output."""
    env, settings = report["environment"], report["settings"]
    machine = env.get("cuda_device") or env["cpu"]
    lines = [
        f"Machine: {machine}; torch {env['torch']}, transformers {env['transformers']}, "
        f"{env['torch_num_threads']} threads, OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}; device {settings['device']}, "
        f"{settings['dtype']}, batch 1, attention {settings['attn_implementation']}; medians of {settings['repeats']} "
        f"after {settings['warmup']} warm-up; load average {env.get('load_average')}.",
        "",
        "| mapper | parameters | bytes | dtype | rank (key/value per layer) | fit R^2 K/V | held-out R^2 K/V | "
        "held-out R^2 K/V, bf16 weights |",
        "|---|---:|---:|---|---|---|---|---|",
    ]

    def pair(values) -> str:
        return "-" if not values or values[0] is None else f"{values[0]:.4f} / {values[1]:.4f}"

    for name, size in report["mappers"].items():
        ranks = "full" if size["rank"] is None else ", ".join(f"{k}/{v}" for k, v in size["rank"])
        lines.append(
            f"| {name} | {size['parameters']:,} | {_fmt_bytes(size['bytes'])} | {size['dtype']} | {ranks} | "
            f"{pair(size.get('fit_r2'))} | {pair(size.get('heldout_r2'))} | {pair(size.get('heldout_r2_bf16'))} |"
        )
    names = list(report["mappers"])
    header = ["T", "prefill body ms", "full fwd ms"]
    header += [f"transfer {n} ms (x faster wall, CPU time; FLOP ratio)" for n in names]
    header += ["TTFT own / transfer ms", "decode own / transfer ms (overhead)", "peak prefill / transfer"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for row in report["results"]:
        cells = [str(row["seq_len"]), f"{row['prefill_body_ms']:.1f}", f"{row.get('prefill_full_ms', float('nan')):.1f}"]
        for n in names:
            t = row["transfer"][n]
            cells.append(
                f"{t['ms']:.2f} ({t['speedup_vs_body']:.1f}x, CPU {t['cpu_speedup_vs_body']:.1f}x; {t['flop_ratio']:.0f}x)"
            )
        cells.append(f"{row['ttft_own_ms']:.1f} / {row['ttft_transfer_ms']:.1f}" if "ttft_own_ms" in row else "-")
        cells.append(
            f"{row['decode_own_ms']:.2f} / {row['decode_transfer_ms']:.2f} ({row['decode_overhead_pct']:+.1f}%, "
            f"CPU {row['decode_overhead_pct_cpu']:+.1f}%)"
            if "decode_own_ms" in row else "-"
        )  # fmt: skip
        first = row["transfer"][names[0]]
        cells.append(f"{_fmt_bytes(row.get('prefill_body_peak_bytes'))} / {_fmt_bytes(first.get('peak_bytes'))}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_bench(report: dict[str, Any], path: str | os.PathLike) -> None:
    """Time vs. sequence length (log-log): own prefill, full forward, each mapper's transfer."""
    plt = pyplot()
    rows = report["results"]
    seq = [r["seq_len"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(seq, [r["prefill_body_ms"] for r in rows], "o-", label="target prefill (body)")
    if all("prefill_full_ms" in r for r in rows):
        ax.plot(seq, [r["prefill_full_ms"] for r in rows], "o--", label="target forward (full)")
    for name in report["mappers"]:
        ax.plot(seq, [r["transfer"][name]["ms"] for r in rows], "s-", label=f"transfer: {name}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("time (ms, median)")
    env = report["environment"]
    ax.set_title(f"{env.get('cuda_device') or env['cpu']}"[:60], fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
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


__all__ = ["bench_markdown", "evaluation_markdown", "plot_bench", "plot_evaluation", "pyplot", "save_bench_report"]
