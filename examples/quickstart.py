"""Quickstart: the small model reads the prompt, the large model answers from the small model's KV cache.

Runs offline on the model family bundled in this repository (examples/family). With real models, swap the
paths for Hub ids and load a published mapper instead of fitting one:

    mapper = KVMapper.from_pretrained("org/qwen3-14b-to-qwen3-32b")

    python examples/quickstart.py
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_kvtransfer import KVMapper, TransferredCache, fit_mapper, prefill
from hf_kvtransfer.fitting.calibration import build_calibration

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument(
    "--family", default=Path(__file__).resolve().parent / "family", help="model family directory (default: the bundled one)"
)
parser.add_argument("--num-sequences", type=int, default=64, help="calibration sequences of 256 tokens")
parser.add_argument("--mapper", help="a fitted mapper (directory or Hub id); default: fit one now")
parser.add_argument("--exact-layers-items", type=int, default=64,
                    help="items per content probe of the fit (it chooses the exact layers; default 64): fewer are faster")
args = parser.parse_args()

family = Path(args.family)
tokenizer = AutoTokenizer.from_pretrained(family / "large")
# float32: the checkpoints are stored in bf16, which most CPUs run several times slower
source = AutoModelForCausalLM.from_pretrained(family / "small", dtype=torch.float32).eval()  # the cheap model that read the context
target = AutoModelForCausalLM.from_pretrained(family / "large", dtype=torch.float32).eval()  # the model that should answer

if args.mapper:
    mapper = KVMapper.from_pretrained(args.mapper)
else:
    # One pass over calibration text through both models, then a closed-form ridge solve.
    calibration_ids, info = build_calibration(tokenizer, family / "calibration.txt", num_sequences=args.num_sequences, seq_len=256)
    mapper = fit_mapper(source, target, calibration_ids, top_k=4, exact_layers_items=args.exact_layers_items)

prompt = "The :mod:`json` module provides an API"
input_ids = tokenizer(prompt, return_tensors="pt").input_ids

src_cache = prefill(source, input_ids)  # the source model's DynamicCache for the prompt
cache = TransferredCache(src_cache, mapper, model=target)  # nothing mapped yet: layers convert as the target reaches them
with torch.no_grad():
    out = target.generate(input_ids, cache=cache, max_new_tokens=32, do_sample=False)
    own = target.generate(input_ids, max_new_tokens=32, do_sample=False)

print("prompt:                   ", prompt)
print("large, transferred cache: ", tokenizer.decode(out[0, input_ids.shape[1]:]))
print("large, its own prefill:   ", tokenizer.decode(own[0, input_ids.shape[1]:]))
