"""Fit a mapper, check it on held-out text, save it, and publish it to the Hub (only with --repo-id).

One pass over calibration text collects sufficient statistics; solving for several top-k is then cheap (no
model runs). The best k on held-out text is saved with its evaluation in fit_report.json (the model card shows it).

    python examples/fit_and_publish.py --output-dir mappers/small-to-large
    python examples/fit_and_publish.py --output-dir mappers/small-to-large --repo-id you/small-to-large
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_kvtransfer import KVMapper, collect_statistics, solve_mapper
from hf_kvtransfer.fitting.calibration import build_calibration
from hf_kvtransfer.evaluation.evaluate import prefix_perplexity, split_documents, text_windows

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument(
    "--family", default=Path(__file__).resolve().parent / "family", help="model family directory (default: the bundled one)"
)
parser.add_argument("--output-dir", default="mappers/small-to-large", help="where the mapper is saved (default %(default)s)")
parser.add_argument("--repo-id", help="publish to this Hub repo (needs a write token); omitted: save locally only")
parser.add_argument("--num-sequences", type=int, default=128, help="calibration sequences of 256 tokens (default 128)")
parser.add_argument("--eval-windows", type=int, default=48, help="held-out perplexity windows per top-k (default 48)")
args = parser.parse_args()

family = Path(args.family)
tokenizer = AutoTokenizer.from_pretrained(family / "large")
source = AutoModelForCausalLM.from_pretrained(family / "small", dtype=torch.float32).eval()
target = AutoModelForCausalLM.from_pretrained(family / "large", dtype=torch.float32).eval()

calibration_ids, info = build_calibration(
    tokenizer, family / "calibration.txt", num_sequences=args.num_sequences, seq_len=256
)
statistics = collect_statistics(source, target, calibration_ids, stride=4)

heldout = split_documents((family / "heldout.txt").read_text(encoding="utf-8"), tokenizer.eos_token)
windows = text_windows([tokenizer(d)["input_ids"] for d in heldout], 256, args.eval_windows)
best = None
for top_k in (1, 2, source.config.num_hidden_layers):
    mapper = solve_mapper(
        statistics, top_k=top_k, source_model_id="hf-kvtransfer/family-small",
        target_model_id="hf-kvtransfer/family-large", calibration={**info, "num_tokens": statistics.count},
    )
    result = prefix_perplexity(source, target, mapper, windows, diagnostics=False, num_bootstrap=200, progress=False)
    print(f"top_k={top_k}: floor-normalized retention of prefix-conditioned perplexity "
          f"{100 * result['normalized_retention']:.1f}%")
    if best is None or result["normalized_retention"] > best[1]["normalized_retention"]:
        best = (mapper, result)

mapper, result = best
mapper.report["eval_results"] = {  # saved as fit_report.json; the model card shows it
    "heldout_prefix_perplexity": {k: round(v, 4) for k, v in result["perplexity"].items()},
    "normalized_retention": round(result["normalized_retention"], 4),
}
mapper.save_pretrained(args.output_dir)
reloaded = KVMapper.from_pretrained(args.output_dir)  # what users will load
print(f"saved top_k={reloaded.config.top_k} mapper to {Path(args.output_dir).resolve()}")
if args.repo_id:
    print("published:", mapper.push_to_hub(args.repo_id))
else:
    print("not published (pass --repo-id you/name to push it to the Hub)")
