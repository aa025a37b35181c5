"""Cascade: the small model answers first; the large model takes over the conversation without re-reading it.

The small model's cache (prompt + its answer) is mapped into the large model's cache, and the large model
continues from there after a follow-up. Its output is compared with the large model reading everything
itself.

    python examples/cascade.py
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_kvtransfer import TransferredCache, fit_mapper
from hf_kvtransfer.fitting.calibration import build_calibration

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument(
    "--family", default=Path(__file__).resolve().parent / "family", help="model family directory (default: the bundled one)"
)
parser.add_argument("--num-sequences", type=int, default=64, help="calibration sequences of 256 tokens")
parser.add_argument("--new-tokens", type=int, default=24, help="tokens each model generates (default 24)")
parser.add_argument("--exact-layers-items", type=int, default=64,
                    help="items per content probe of the fit (it chooses the exact layers; default 64): fewer are faster")
args = parser.parse_args()

family = Path(args.family)
tokenizer = AutoTokenizer.from_pretrained(family / "large")
small = AutoModelForCausalLM.from_pretrained(family / "small", dtype=torch.float32).eval()
large = AutoModelForCausalLM.from_pretrained(family / "large", dtype=torch.float32).eval()
calibration_ids, _ = build_calibration(tokenizer, family / "calibration.txt", num_sequences=args.num_sequences, seq_len=256)
mapper = fit_mapper(small, large, calibration_ids, top_k=4, exact_layers_items=args.exact_layers_items, progress=False)

greedy = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
question = ":func:`os.path.join` joins one or more path components"
ids = tokenizer(question, return_tensors="pt").input_ids

with torch.no_grad():
    # 1. The small model answers; `generate` fills the DynamicCache we hand it.
    small_cache = DynamicCache()
    answer = small.generate(ids, cache=small_cache, **greedy)

    # 2. A follow-up arrives and the cascade escalates to the large model. Its cache comes from the small
    #    model's: only the follow-up (and the last 32 tokens before it, recomputed) is prefilled by the large model.
    follow_up = tokenizer("\n\n.. note::\n\n   ", return_tensors="pt").input_ids
    conversation = torch.cat([answer, follow_up], dim=-1)
    cache = TransferredCache(small_cache, mapper, model=large)
    handed_over = large.generate(conversation, cache=cache, **greedy)
    reference = large.generate(conversation, **greedy)  # the large model re-reading everything itself

n = conversation.shape[1]
skipped = small_cache.get_seq_length() - cache.num_recompute_tokens  # tokens the large model did not prefill
print("question:        ", question)
print("small answers:   ", tokenizer.decode(answer[0, ids.shape[1]:]))
print("follow-up:       ", repr(tokenizer.decode(follow_up[0])))
print(f"large continues ({skipped} of {n} conversation tokens taken from the small model's cache):")
print("  through the transferred cache:", tokenizer.decode(handed_over[0, n:]))
print("  re-reading everything itself:", tokenizer.decode(reference[0, n:]))
same = int((handed_over[0, n:] == reference[0, n:]).sum())
print(f"  {same}/{args.new_tokens} greedy tokens equal")
