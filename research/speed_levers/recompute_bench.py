"""Recompute cost check: target (large) forward over R=32 or 1 tokens on a cache of 1024-R vs own 1024-token prefill,
sdpa and eager, 5 repeats, medians, one thread. `--model` times another target (default: this repository's
examples/family/large, whatever the current directory).

    OMP_NUM_THREADS=1 python research/speed_levers/recompute_bench.py
"""

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache

MODEL = Path(__file__).resolve().parents[2] / "examples/family/large"


def bench(model_dir: str) -> None:
    torch.set_num_threads(1)
    for impl in ("sdpa", "eager"):
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=impl).eval()
        ids = torch.randint(5, 4000, (1, 1024))
        with torch.no_grad():
            for R in (32, 1):
                pk = m(input_ids=ids[:, :1024 - R], use_cache=True).past_key_values
                ts = []
                to = []
                for _ in range(5):
                    c = DynamicCache(config=m.config)
                    for l in range(m.config.num_hidden_layers):
                        c.update(pk.layers[l].keys.clone(), pk.layers[l].values.clone(), l)
                    s = time.perf_counter()
                    m(input_ids=ids[:, 1024 - R:], past_key_values=c, use_cache=True, logits_to_keep=1)
                    ts.append(time.perf_counter() - s)
                    s = time.perf_counter()
                    m(input_ids=ids, use_cache=True, logits_to_keep=1)
                    to.append(time.perf_counter() - s)
                print(impl, R, "rec ms", 1e3 * np.median(ts), "own ms", 1e3 * np.median(to), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(MODEL),
                        help="the target model's folder or Hub id (default: this repository's examples/family/large)")
    bench(parser.parse_args(argv).model)


if __name__ == "__main__":
    main()
