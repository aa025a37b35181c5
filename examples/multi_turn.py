"""Multi-turn switching small -> large -> small, one cache carried across both switches.

Turn 1 is written by the small model, turn 2 by the large one (its cache mapped from the small model's),
turn 3 by the small one again (its cache mapped back with a large -> small mapper). Each turn is compared
with what that model writes when it reads the whole conversation itself.

    python examples/multi_turn.py
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_kvtransfer import TransferredCache, collect_statistics, solve_mapper
from hf_kvtransfer.fitting.calibration import build_calibration

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument(
    "--family", default=Path(__file__).resolve().parent / "family", help="model family directory (default: the bundled one)"
)
parser.add_argument("--num-sequences", type=int, default=64, help="calibration sequences of 256 tokens")
parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated per turn (default 16)")
args = parser.parse_args()

family = Path(args.family)
tokenizer = AutoTokenizer.from_pretrained(family / "large")
models = {
    "small": AutoModelForCausalLM.from_pretrained(family / "small", dtype=torch.float32).eval(),
    "large": AutoModelForCausalLM.from_pretrained(family / "large", dtype=torch.float32).eval(),
}
calibration_ids, _ = build_calibration(tokenizer, family / "calibration.txt", num_sequences=args.num_sequences, seq_len=256)
mappers = {
    (a, b): solve_mapper(collect_statistics(models[a], models[b], calibration_ids, progress=False), top_k=4)
    for a, b in (("small", "large"), ("large", "small"))
}

greedy = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
conversation = tokenizer("Dictionaries\n============\n\nA dictionary maps", return_tensors="pt").input_ids
cache, previous = DynamicCache(), None
with torch.no_grad():
    for turn, name in enumerate(("small", "large", "small"), 1):
        model = models[name]
        if previous is not None:
            # Switch: the whole cache so far (both models' turns) becomes this model's cache.
            cache = TransferredCache(cache, mappers[(previous, name)], model=model)
        start = conversation.shape[1]
        out = model.generate(conversation, cache=cache, **greedy)
        own = model.generate(conversation, **greedy)  # the same model reading the conversation itself
        same = int((out[0, start:] == own[0, start:]).sum())
        print(f"turn {turn} ({name}): {tokenizer.decode(out[0, start:])!r}")
        print(f"   {same}/{args.new_tokens} greedy tokens equal to {name} re-reading all {start} tokens itself")
        conversation, previous = out, name
