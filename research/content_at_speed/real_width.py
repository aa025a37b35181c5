"""The deep pair's default configuration at a real model's width, for timing only: a family folder with random-weight
models, a target shaped like Qwen3-0.6B (28 layers, 1024 wide, 16 query and 8 key/value heads of 128, FFN 3072), and
mappers configured as the deep pair's fit chose (3 exact layers attending within 128 tokens, the other layers mapped
from the residual entering layer 2 at positions t, t-1, t-2, no source K/V, the cache's 32 recomputed tokens), at the
ranks asked for. `time_split.py` then times them against the target's own prefill, as it does the deep pair:

    python research/content_at_speed/real_width.py --output DIR
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/content_at_speed/time_split.py --family DIR \\
        --source source --target target --mapper DIR/mapper_full --also share=DIR/mapper_rank_584 \\
        --lengths 1024 4096 --rounds 5 --output FILE

On the deep pair (128 wide) a forward of a few tokens costs far more than its FLOPs on this CPU, which limits the
speed-up at 1024 tokens; at this width the same configuration shows how much of that limit is the pair's width.
The weights are random, so only the times mean anything: the maps' values are ridge solves on random tokens (a few
thousand rows), their shapes and the exact pass are the fit's. The source is small (2 layers, 256 wide) because the
timed path never reads it: these maps read no source layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from hf_kvtransfer import fit_mapper
from hf_kvtransfer.fitting.calibration_pass import calibration_pass
from hf_kvtransfer.fitting.residual_stats import ResidualStatistics, solve_residual_mapper

ROOT = Path(__file__).resolve().parents[2]
DEEP = ROOT / "examples" / "family_deep"
# The configuration timed: what the fit chose on the deep pair (today's default there).
DEEP_DEFAULT = ROOT / "research/family_builder/results/deep_pair/mapper_config_window_source_to_target.json"
# Qwen3-0.6B's decoder (its config on the Hub), with the bundled tokenizer's vocabulary.
TARGET = dict(num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
              num_key_value_heads=8, head_dim=128, rope_theta=1e6, tie_word_embeddings=True)  # fmt: skip
SOURCE = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=768, num_attention_heads=2,
              num_key_value_heads=2, head_dim=128, rope_theta=1e6, tie_word_embeddings=True)  # fmt: skip


def deep_default() -> dict:
    """The deep default's residual input (layer, lags, rank), the number of features its rank was taken from, and
    its exact pass's window."""
    config = json.loads(DEEP_DEFAULT.read_text())
    residual = config["map_inputs"]["residual"]
    features = len(residual["lags"]) * config["target_config"]["hidden_size"]
    return {"layer": residual["layer"], "lags": residual["lags"], "rank": residual["rank"], "features": features,
            "window": config["exact_window"]}  # fmt: skip


def model(shape: dict, vocab: int, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, max_position_embeddings=40960, bos_token_id=0, eos_token_id=0, **shape)
    return Qwen3ForCausalLM(config).eval()


def build(output: Path, target_shape: dict = TARGET, source_shape: dict = SOURCE, ranks=("full", "share"),
          rows: int = 16) -> list[Path]:  # fmt: skip
    """Write the family folder (`source/`, `target/`, the deep family's texts) and one mapper folder per rank
    ("full", "share": the deep default's rank as a share of its features, or a number); returns the mappers' folders."""
    default = deep_default()
    tokenizer = AutoTokenizer.from_pretrained(DEEP / "target")
    vocab = len(tokenizer)
    source, target = model(source_shape, vocab, 0), model(target_shape, vocab, 1)
    output.mkdir(parents=True, exist_ok=True)
    for name, m in (("source", source), ("target", target)):
        m.save_pretrained(output / name)
        tokenizer.save_pretrained(output / name)
    for text in ("calibration.txt", "heldout.txt"):  # time_split reads the held-out text's first tokens
        shutil.copyfile(DEEP / text, output / text)
    ids = torch.randint(vocab, (rows, 256), generator=torch.Generator().manual_seed(0))
    layer = default["layer"]
    with torch.no_grad():
        base = fit_mapper(source, target, ids, top_k=1, num_exact_layers=1, progress=False)
        stats = ResidualStatistics.for_models(source, target, [layer], lags=default["lags"])
        calibration_pass(source, target, ids, consumers=[stats], progress=False)
    features = len(default["lags"]) * target_shape["hidden_size"]
    folders = []
    for rank in ranks:
        named = {"full": None, "share": round(default["rank"] / default["features"] * features)}
        r = named[rank] if rank in named else int(rank)
        mapper = solve_residual_mapper(base, stats, layer, residual_rank=r,
                                       sources={t: [] for t in range(layer + 1, target_shape["num_hidden_layers"])})  # fmt: skip
        mapper.config = dataclasses.replace(mapper.config, exact_window=default["window"])
        folders.append(output / ("mapper_full" if r is None else f"mapper_rank_{r}"))
        mapper.save_pretrained(folders[-1])
        print(f"{folders[-1].name}: {mapper.num_exact_layers} exact layers, window {default['window']}, maps of the "
              f"residual entering layer {layer} at rank {r or features} of {features}")  # fmt: skip
    return folders


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, required=True, help="the family folder to write")
    p.add_argument("--ranks", nargs="+", default=["full", "share"],
                   help="ranks of the residual features' shared projection: full (none), share (the deep default's "
                        "share of its features, 73 of 384), or a number")  # fmt: skip
    p.add_argument("--calibration-rows", type=int, default=16, help="rows of 256 random tokens the maps are solved on")
    args = p.parse_args()
    build(args.output, ranks=args.ranks, rows=args.calibration_rows)


if __name__ == "__main__":
    main()
