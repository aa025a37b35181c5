"""Fit a mapper of the bundled family with the library's defaults (`fit_mapper`: the content probe's search over
exact layers x map inputs; with `token_tables=auto` token tables on the residual candidates, through the fit's
`refine` hook and this folder's plug-in, `token_tables_plugin.table_refiner`), save it, and print the probe's frontier
(one line per candidate).

    python research/token_tables/fit_pair.py small large 512 DIR [token_tables=auto [token_table_sequences=N]
        [token_lags=0,1,2,3]] [FitConfig field=value ...]

512 = calibration rows of 256 tokens from `examples/family/calibration.txt` (the last tenth held out for the probe).
With `token_tables=auto token_table_sequences=N` the tables are fit on the maps' training rows and the rows of
`calibration.txt` after the maps' (never the probe's), N in all. A mapper saved with tables loads where
`token_tables_plugin` is imported.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "content_at_speed"))
from content_at_speed import load_pair  # noqa: E402

import token_tables_plugin  # noqa: E402  (this folder's plug-in: registers the token tables)
from hf_kvtransfer import fit_mapper  # noqa: E402
from hf_kvtransfer.fitting.config import FitConfig, heldout_count  # noqa: E402

FIELDS = ("inputs", "num_exact_layers", "retention", "cued_retention", "cued_minus_reference_ci", "cued_items",
          "passes", "transfer_ms", "target_prefill_ms", "speedup", "skipped", "chosen")  # fmt: skip


def main() -> None:
    if len(sys.argv) < 5 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if len(sys.argv) > 1 else 2)
    source, target, rows, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    overrides = {k: int(v) if v.isdigit() else v for k, v in (arg.split("=", 1) for arg in sys.argv[5:])}
    # The plug-in's options (no longer FitConfig's): tables on the residual candidates, their sequences and lags.
    tables = overrides.pop("token_tables", "off")
    sequences = overrides.pop("token_table_sequences", None)
    lags = [int(a) for a in str(overrides.pop("token_lags", "0,1,2,3")).split(",")]
    if tables not in ("auto", "off") or (tables == "off" and sequences is not None):
        raise SystemExit("token_tables must be 'auto' or 'off', and token_table_sequences needs token_tables=auto")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pair = load_pair(source, target)
    started = time.perf_counter()
    ids, more, refine = pair.calibration_rows(rows), None, None
    if sequences is not None:
        usable = pair.calibration_ids.shape[0] // 256 * 256
        more = pair.calibration_ids[rows * 256 : usable].reshape(-1, 256)  # after the maps' rows and the probe's
    if tables == "auto":
        defaults = FitConfig()
        num_heldout = heldout_count(ids.shape[0], float(overrides.get("heldout_fraction", defaults.heldout_fraction)))
        table_ids, table_mask = token_tables_plugin.table_rows(ids, None, num_heldout, more, sequences)
        refine = token_tables_plugin.table_refiner(pair.source, pair.target, table_ids, table_mask, lags=lags,
                                                   batch_size=overrides.get("batch_size", defaults.batch_size))
    mapper = fit_mapper(pair.source, pair.target, ids, progress=False, refine=refine, **overrides)
    if refine is not None:
        mapper.report["exact_layers"]["token_table_sequences"] = int(table_ids.shape[0])
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
