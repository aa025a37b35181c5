"""How many calibration tokens do token tables need? The fit's fullest candidate for one residual layer J (source
K/V + the target's residual entering J, every mapped layer reading it), with tables fit on a growing number of
calibration sequences, scored on the fit's own probe: repeated spans and cued recall of the held-out calibration
sequences (the last tenth), as `choose_configuration` scores them.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/token_tables/table_data.py --source small --target large \\
        --residual-layer 0 --rows 512 --table-rows 0 64 461 1843 [--lags 0 1 2 3 4 5 6 7]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "content_at_speed"))
from content_at_speed import load_pair  # noqa: E402

from hf_kvtransfer import fit_mapper  # noqa: E402
from hf_kvtransfer.evaluation.content import repeated_span_retention  # noqa: E402
from hf_kvtransfer.evaluation.tasks import cued_recall_items, repeated_span_items  # noqa: E402
from hf_kvtransfer.fitting.calibration_pass import calibration_pass  # noqa: E402
from hf_kvtransfer.fitting.exact_layers import probe_stream  # noqa: E402
from hf_kvtransfer.fitting.residual_stats import ResidualStatistics, solve_residual_mapper  # noqa: E402
from token_tables_plugin import fit_token_tables  # noqa: E402  (this folder's plug-in)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="small")
    p.add_argument("--target", default="large")
    p.add_argument("--residual-layer", type=int, default=0)
    p.add_argument("--rows", type=int, default=512, help="calibration rows of 256 tokens of the maps (a tenth held out)")
    p.add_argument("--table-rows", type=int, nargs="+", default=[0, 64, 461], help="rows the tables are fit on (0: none)")
    p.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2, 3], help="positions back the tables read")
    p.add_argument("--items", type=int, default=64, help="repeated spans; cued recall gets 4x")
    p.add_argument("--output", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(args.source, args.target)
    heldout = max(1, args.rows // 10)
    train = pair.calibration_rows(args.rows)[:-heldout]
    probe_rows = pair.calibration_rows(args.rows)[-heldout:]
    base = fit_mapper(pair.source, pair.target, train, top_k=8, num_exact_layers=1, heldout_fraction=0, progress=False)
    stats = ResidualStatistics.for_models(pair.source, pair.target, [args.residual_layer], stride=4)
    calibration_pass(pair.source, pair.target, train, consumers=[stats], progress=False)
    mapper = solve_residual_mapper(base, stats, args.residual_layer)
    stream = probe_stream(probe_rows)
    vocab = pair.target.config.vocab_size
    spans = repeated_span_items(vocab, stream, args.items, seed=0, prefix_len=256, continuation_len=64, kind="text")
    cued = cued_recall_items(stream, 4 * args.items, seed=0, prefix_len=256, num_records=4, continuation_len=64)
    # Tables fit on sequences after the maps' (more of calibration.txt), never on the probe's.
    extra = pair.calibration_ids[args.rows * 256 :]
    results = {}
    for n in args.table_rows:
        rows = torch.cat([train, extra[: max(0, n - len(train)) * 256].reshape(-1, 256)])[:n]
        m = fit_token_tables(pair.source, pair.target, mapper, rows, lags=args.lags) if n else mapper
        with torch.no_grad():
            s = repeated_span_retention(pair.source, pair.target, m, spans, num_recompute_tokens=1, progress=False)
            c = repeated_span_retention(pair.source, pair.target, m, cued, num_recompute_tokens=1, progress=False)
        results[n] = {"tokens": n * 256, "lags": args.lags, "spans": s["retention"], "spans_ci": s["retention_ci"], "cued": c["retention"],
                      "cued_ci": c["retention_ci"]}  # fmt: skip
        print(f"tables on {n} rows ({n * 256} tokens): spans {s['retention']:.3f} {[round(x, 3) for x in s['retention_ci']]}, "
              f"cued {c['retention']:.3f} {[round(x, 3) for x in c['retention_ci']]}", flush=True)
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
