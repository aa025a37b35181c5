"""Fit a mapper of the bundled family with the library's defaults (`fit_mapper`: the content probe's search over
exact layers x map inputs; with `token_tables=auto` token tables on the residual candidates), save it, and print
the probe's frontier (one line per candidate).

    python research/token_tables/fit_pair.py small large 512 DIR [FitConfig field=value ...]

512 = calibration rows of 256 tokens from `examples/family/calibration.txt` (the last tenth held out for the probe).
With `token_tables=auto token_table_sequences=N` the tables are fit on the maps' training rows and the rows of
`calibration.txt` after the maps' (never the probe's), N in all.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "content_at_speed"))
from content_at_speed import load_pair  # noqa: E402

from hf_kvtransfer import fit_mapper  # noqa: E402

FIELDS = ("inputs", "num_exact_layers", "retention", "cued_retention", "cued_minus_reference_ci", "cued_items",
          "passes", "transfer_ms", "target_prefill_ms", "speedup", "skipped", "chosen")  # fmt: skip


def main() -> None:
    if len(sys.argv) < 5 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if len(sys.argv) > 1 else 2)
    source, target, rows, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    overrides = {k: int(v) if v.isdigit() else v for k, v in (arg.split("=", 1) for arg in sys.argv[5:])}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pair = load_pair(source, target)
    started = time.perf_counter()
    more = None
    if "token_table_sequences" in overrides:
        usable = pair.calibration_ids.shape[0] // 256 * 256
        more = pair.calibration_ids[rows * 256 : usable].reshape(-1, 256)  # after the maps' rows and the probe's
    mapper = fit_mapper(pair.source, pair.target, pair.calibration_rows(rows), progress=False,
                        token_table_input_ids=more, **overrides)  # fmt: skip
    print(f"fit {time.perf_counter() - started:.0f} s", flush=True)
    mapper.save_pretrained(out)
    report = mapper.report["exact_layers"]
    for row in report.get("candidates", report["tried"]):
        print({k: row.get(k) for k in FIELDS}, flush=True)
    c = mapper.config
    res, tables = c.map_inputs.get("residual"), c.map_inputs.get("token_tables")
    print(f"chosen: {c.num_exact_layers} exact layers, residual layer {getattr(res, 'layer', None)}, token tables on "
          f"{getattr(tables, 'readers', None)}: {report.get('reason')}")


if __name__ == "__main__":
    main()
