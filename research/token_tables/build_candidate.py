"""Save the fit's fullest candidate for one residual layer J (J + 1 exact layers; source K/V + the target's residual
entering layer J, read by every mapped layer, or by --readers, optionally through one shared reduced-rank
projection, --energy), with token tables on every mapped layer unless --no-tables, built as
`fit_mapper` builds it: maps from the first nine tenths of `rows` calibration sequences of 256 tokens (k = 8,
residual statistics every 4th token), tables from the same sequences.

    python research/token_tables/build_candidate.py --source small --target large --residual-layer 1 --rows 512 --output DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "content_at_speed"))
from content_at_speed import load_pair  # noqa: E402

from hf_kvtransfer import fit_mapper  # noqa: E402
from token_tables_plugin import fit_token_tables, fold_residual_into_tables, tabulate_first_layer  # noqa: E402  (this folder's plug-in)
from hf_kvtransfer.fitting.calibration_pass import calibration_pass  # noqa: E402
from hf_kvtransfer.fitting.residual_stats import ResidualStatistics, solve_residual_mapper  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="small")
    p.add_argument("--target", default="large")
    p.add_argument("--residual-layer", type=int, required=True)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--no-tables", action="store_true")
    p.add_argument("--no-fold", action="store_true", help="J = 0: keep the residual product and layer 0's projections (the fit folds and looks them up)")
    p.add_argument("--readers", help="comma-separated target layers that read the residual (default: every mapped layer)")
    p.add_argument("--energy", type=float, help="a shared reduced-rank residual projection keeping this fraction")
    p.add_argument("--output", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(args.source, args.target)
    train = pair.calibration_rows(args.rows)[: args.rows - max(1, round(args.rows * 0.1))]
    base = fit_mapper(pair.source, pair.target, train, top_k=8, num_exact_layers=1, heldout_fraction=0, progress=False)
    stats = ResidualStatistics.for_models(pair.source, pair.target, [args.residual_layer], stride=4)
    calibration_pass(pair.source, pair.target, train, consumers=[stats], progress=False)
    readers = [int(t) for t in args.readers.split(",")] if args.readers else None
    mapper = solve_residual_mapper(base, stats, args.residual_layer, readers=readers, residual_energy=args.energy)
    if not args.no_tables:
        mapper = fit_token_tables(pair.source, pair.target, mapper, train)
        if args.residual_layer == 0 and not args.no_fold:  # as the fit does: the embedding's part in the tables,
            mapper = tabulate_first_layer(fold_residual_into_tables(mapper, pair.target), pair.target)  # layer 0 looked up
    mapper.save_pretrained(args.output)
    print(f"saved {args.output}: {mapper.num_exact_layers} exact layers, tables on {mapper.tokens.layers if mapper.tokens is not None else None}")


if __name__ == "__main__":
    main()
