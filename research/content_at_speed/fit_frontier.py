"""The fit's configuration search at the defaults, as `hf-kvtransfer demo` runs it: fit a mapper for one direction of
the bundled family (all of `calibration.txt`'s default sample, no held-out shard), save it, and print the frontier
rows of `mapper.report["exact_layers"]["candidates"]` (exact layers, inputs, repeated-span retention, cued recall,
the paired interval of cued recall minus the source-only answer, passes, skipped, transfer ms, speed-up, chosen).

    OMP_NUM_THREADS=1 python research/content_at_speed/fit_frontier.py small large /tmp/s2l
"""

import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_kvtransfer import fit_mapper

FAMILY = Path(__file__).resolve().parents[2] / "examples" / "family"


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    source_name, target_name, out = sys.argv[1:]
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(FAMILY / "tokenizer")
    source = AutoModelForCausalLM.from_pretrained(FAMILY / source_name).eval()
    target = AutoModelForCausalLM.from_pretrained(FAMILY / target_name).eval()
    start = time.perf_counter()
    mapper = fit_mapper(source, target, FAMILY / "calibration.txt", tokenizer=tokenizer, heldout_fraction=0, progress=False)
    c = mapper.config
    print("fit", round(time.perf_counter() - start, 1), "s; exact layers", c.num_exact_layers, "residual layer", getattr(c.map_inputs.get("residual"), "layer", None),
          "selected", c.selected_layers)
    mapper.save_pretrained(out)
    for r in mapper.report["exact_layers"].get("candidates", []):
        print(r["num_exact_layers"], r["inputs"], r.get("retention"), r.get("cued_retention"), r.get("cued_minus_reference_ci"),
              r.get("passes"), r.get("skipped"), r.get("transfer_ms"), r.get("speedup"), r.get("chosen"))


if __name__ == "__main__":
    main()
