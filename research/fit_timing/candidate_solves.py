"""What solving the configuration search's candidates costs: the residual input's candidate groups of a pair (one per
residual layer, `ResidualFit.candidates`), the first N solved as a search that stops at the N-th exact-layer count
solves them, against every group solved, as the fit solved them before the groups.

It runs `hf-kvtransfer fit` with the given arguments up to the moment the fit hands the groups to the probe, times
both solves there (process CPU time, one thread) and stops; the sums the solves read have the same shapes whatever
the calibration sample, so a small sample gives the costs of the default fit's solves.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/fit_timing/candidate_solves.py --groups 3 \\
        --output research/fit_timing/results/candidate_solves_deep.json -- --source examples/family_deep/source \\
        --target examples/family_deep/target --dataset examples/family_deep/calibration.txt --num-sequences 64 \\
        --seq-len 256 --output DIR

Arguments after `--` are `hf-kvtransfer fit`'s (its `--output` is not written: the fit stops before it saves).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


class _Measured(Exception):
    """Raised once the solves are timed: the fit stops there."""


def _size_mib(mappers) -> float:
    return sum(p.numel() * p.element_size() for m in mappers for p in m.parameters()) / 2**20


def measure(fit_args: list[str], first: int) -> dict:
    """The solve costs, from inside the fit that `fit_args` runs."""
    from hf_kvtransfer.commands.cli import main
    from hf_kvtransfer.fitting import residual_stats

    found: dict = {}
    handed = residual_stats.ResidualFit.candidates

    def timed(self, mapper, statistics, config):
        groups = handed(self, mapper, statistics, config)
        for name, chosen in (("first", groups[:first]), ("every", groups)):
            start = time.process_time()
            mappers = [m for group in chosen for m in group.solve()]
            found[name] = {"groups": len(chosen), "candidates": len(mappers), "cpu_s": time.process_time() - start,
                           "weights_mib": _size_mib(mappers)}  # fmt: skip
            del mappers
        raise _Measured

    residual_stats.ResidualFit.candidates = timed
    try:
        main(["fit", *fit_args])
    except _Measured:
        pass
    finally:
        residual_stats.ResidualFit.candidates = handed
    if not found:
        raise SystemExit("the fit searched no residual candidates (see its log): nothing to time")
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=3, help="the groups a search that stops there solves (default 3)")
    parser.add_argument("--output", type=Path, help="write the figures as JSON here")
    parser.add_argument("fit_args", nargs=argparse.REMAINDER, help="after --: hf-kvtransfer fit's arguments")
    args = parser.parse_args(argv)
    fit_args = args.fit_args[1:] if args.fit_args[:1] == ["--"] else args.fit_args
    torch.set_num_threads(1)
    result = {"fit_args": fit_args, "threads": 1, "clock": "process CPU time", "load_average": os.getloadavg(),
              "date": time.strftime("%Y-%m-%d"), **measure(fit_args, args.groups)}  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
