"""Real model shapes on this CPU, random weights: fit, transfer vs the target's own prefill, memory vs `plan`.

The source and target are built from the shipped configs of a real pair (`hf_kvtransfer.commands.model_configs`), with random
weights, a small vocabulary (embedding and LM head do not enter the KV shapes, the mapper or the prefill body) and
all decoder layers sharing one layer's weights (`shared_layer_model`: the real shapes and kernels, one layer's
memory), so a 2-core, few-GB machine can run them in float32 (bf16 GEMMs are ~6x slower than float32 on CPUs
without AVX-512-BF16/AMX). For each pair: the plan (`plan_transfer`), a fit on a few random
calibration sequences (two-stage when the plan says `fit` would pick it with the memory given), then per sequence
length: the target's own prefill (transformer body) vs the transfer (`TransferredCache(...).convert_all()`), the
transfer's peak resident memory (VmHWM, reset just before) vs the plan's prediction, and the transfer time vs its
FLOP bound (mapping FLOPs / the GEMM throughput measured here on the mapper's own shapes). Random weights mean no
quality numbers: this is about shapes, time and memory.

Usage (keep the machine otherwise idle; one or two threads; MALLOC_MMAP_THRESHOLD_ makes freed tensors leave the
resident set, so the memory measured is what the transfer holds):
    MALLOC_MMAP_THRESHOLD_=1048576 python research/real_shapes/real_shapes.py --pair qwen3 --seq-lens 1024 4096 --threads 2 --output real_shapes_qwen3.json
    MALLOC_MMAP_THRESHOLD_=1048576 python research/real_shapes/real_shapes.py --pair llama --seq-lens 1024 --threads 2 --output real_shapes_llama.json

What maps reading the target's residual stream would cost at the shapes that matter (no models built, seconds):
    python research/real_shapes/real_shapes.py --costs-at-scale --seq-lens 4096 32768 --output residual_costs.json

(with the package installed; from a source checkout, `PYTHONPATH=. python research/real_shapes/real_shapes.py ...`)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

PAIRS = {
    "qwen3": ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B"),
    "llama": ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-3B"),
}
MiB = 2**20


# The pairs whose costs the residual-stream option is judged at (from the shipped configs; nothing is built).
PAIRS_AT_SCALE = {
    "qwen3-14b-32b": ("Qwen/Qwen3-14B", "Qwen/Qwen3-32B"),
    "llama-8b-70b": ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B"),
}


def costs_at_scale(seq_lens, exact_layers, residual_positions, ranks, top_k: int = 8) -> dict:
    """For each pair of `PAIRS_AT_SCALE`: what maps reading the target's residual stream add to the mapper and to the
    FLOPs to the first token, next to the exact layers' share of the target's prefill (`plan_transfer`, offline)."""
    from hf_kvtransfer.commands.plan import plan_transfer

    report = {"top_k": top_k, "dtype": "bfloat16", "pairs": {}}
    for key, (source, target) in PAIRS_AT_SCALE.items():
        rows = []
        for T in seq_lens:
            for rank in ranks:
                for J in exact_layers:
                    for P in residual_positions:
                        plan = plan_transfer(source, target, top_k=top_k, rank=rank, seq_len=T, num_exact_layers=J,
                                             residual_positions=P, use_hub=False, available_memory=2**40)  # fmt: skip
                        # the residual input's row (none at P = 0: then the transfer without it)
                        res = plan.map_inputs.get("residual") or {"parameters": 0, "first_token_flops": plan.first_token_flops,
                                                                  "first_token_flop_ratio": plan.first_token_flop_ratio}  # fmt: skip
                        f, r = plan.first_token_flops, res["first_token_flops"]
                        rows.append({
                            "seq_len": T, "rank": rank, "num_exact_layers": J, "residual_positions": P,
                            "num_recompute_tokens": plan.num_recompute_tokens,
                            "mapper_parameters": plan.mapper_parameters, "residual_parameters": res["parameters"],
                            "own_prefill_flops": f["own_prefill"], "target_layer_flops": plan.target_layer_flops,
                            "exact_layers_flops": f["exact_layers"], "mapping_flops": f["mapping"],
                            "recompute_flops": f["recompute"], "residual_flops": r["map_inputs"],
                            "residual_exact_layer_flops": r["exact_layers"] - f["exact_layers"],
                            "residual_added_flops": r["total"] - f["total"],
                            "first_token_flop_ratio": plan.first_token_flop_ratio,
                            "first_token_flop_ratio_residual": res["first_token_flop_ratio"],
                        })  # fmt: skip
        layout = plan.target_layout
        report["pairs"][key] = {"source": source, "target": target, "target_layers": layout["num_layers"], "rows": rows}
    return report


def costs_markdown(report: dict) -> str:
    """One table per pair: the exact layers' share of the prefill, the maps', and what P residual positions add."""
    lines = []
    for pair in report["pairs"].values():
        lines += [
            f"**{pair['source']} -> {pair['target']}** (top_k={report['top_k']}, {pair['target_layers']} target layers; "
            "FLOPs to the first token of a T-token prompt, batch 1, transformer bodies; shares of the target's own "
            "prefill; + FLOPs: the wider maps; the residual entering the last exact layer comes with the exact pass)",
            "",
            "| T | rank | exact layers | exact layers' share | maps' share | recomputed tokens' share | residual "
            "positions | + mapper parameters | + FLOPs (target layers' worth) | prefill / transfer: K/V only -> with "
            "residual |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for row in pair["rows"]:
            own = row["own_prefill_flops"]
            rank = "full" if row["rank"] is None else str(row["rank"])
            added = (
                f"+{row['residual_parameters'] / 1e9:.2f}B (+{100 * row['residual_parameters'] / row['mapper_parameters']:.0f}%)"
                if row["residual_positions"] else "-"
            )  # fmt: skip
            flops = f"{row['residual_added_flops'] / row['target_layer_flops']:.2f}" if row["residual_positions"] else "-"
            lines.append(
                f"| {row['seq_len']} | {rank} | {row['num_exact_layers']} | {100 * row['exact_layers_flops'] / own:.2f}% "
                f"| {100 * row['mapping_flops'] / own:.2f}% | {100 * row['recompute_flops'] / own:.2f}% "
                f"| {row['residual_positions']} | {added} | {flops} | {row['first_token_flop_ratio']:.1f}x -> "
                f"{row['first_token_flop_ratio_residual']:.1f}x |"
            )
        lines.append("")
    return "\n".join(lines)


def _rss() -> tuple[int, int]:
    status = Path("/proc/self/status").read_text()
    values = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("Vm")}
    return values["VmRSS"], values["VmHWM"]


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _median_time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        out = None  # the previous result is freed before the next run
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _gemm_flops_per_s(mapper, seq_len: int, dtype, repeats: int = 3) -> float:
    """Throughput of the mapping's own GEMM shape here: [seq, F_in] x [F_in, F_out] in the mapper's dtype."""
    import torch

    f_in = mapper.layers[0].key.weight.shape[1]
    f_out = mapper.layers[0].key.weight.shape[0]
    x = torch.randn(seq_len, f_in).to(dtype)
    w = torch.randn(f_out, f_in).to(dtype)
    torch.nn.functional.linear(x, w)  # warm-up
    seconds, _ = _median_time(lambda: torch.nn.functional.linear(x, w), repeats)
    return 2 * seq_len * f_in * f_out / seconds


def shared_layer_model(config, dtype):
    """A causal LM of `config`'s exact shapes whose decoder layers all share one layer's weights.

    Every layer runs the same kernels on the same shapes as in the real model (so time, FLOPs and KV shapes are
    the real ones), but only one layer's weights are held: a 1.7B-parameter target fits in a few hundred MB.
    Random weights either way; each layer's KV still differs (its input is the previous layer's output).
    """
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    if getattr(one, "layer_types", None):
        one.layer_types = one.layer_types[:1]
    small = AutoModelForCausalLM.from_config(one, dtype=dtype).eval()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.model.embed_tokens = small.model.embed_tokens
    model.model.norm = small.model.norm
    model.model.rotary_emb = small.model.rotary_emb
    model.lm_head = small.lm_head
    shared = dict(small.model.layers[0].named_parameters())
    for layer in model.model.layers:
        for name, param in shared.items():
            owner, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(owner) if owner else layer, attr, param)
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    return model


def run(args) -> dict:
    import torch
    from transformers import AutoConfig

    from hf_kvtransfer import TransferredCache, fit_mapper, prefill
    from hf_kvtransfer.commands.model_configs import load_model_config
    from hf_kvtransfer.commands.plan import format_plan, plan_transfer

    torch.set_num_threads(args.threads)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    source_id, target_id = PAIRS[args.pair]
    configs = []
    for name in (source_id, target_id):
        data = load_model_config(name).to_dict()
        data.update(vocab_size=args.vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
        config = AutoConfig.for_model(data.pop("model_type"), **data)
        config._name_or_path = name
        config._attn_implementation = "sdpa"
        configs.append(config)
    budget = int(args.memory_gib * 2**30)
    plans = {
        T: plan_transfer(*configs, top_k=args.top_k, seq_len=T, dtype=args.dtype, available_memory=budget,
                         num_sequences=args.num_sequences, heldout_fraction=0.0, probe_tokens=args.probe_tokens)
        for T in args.seq_lens
    }  # fmt: skip
    first = plans[args.seq_lens[0]]
    print(format_plan(first), flush=True)
    two_stage = first.fit_default_mode == "two-stage"

    start = time.perf_counter()
    torch.manual_seed(0)
    source, target = (shared_layer_model(c, dtype) for c in configs)
    build_s = time.perf_counter() - start
    rss_models, _ = _rss()
    print(f"models built in {build_s:.0f} s; RSS {rss_models / 2**30:.2f} GiB", flush=True)

    g = torch.Generator().manual_seed(1)
    calibration = torch.randint(3, args.vocab_size, (args.num_sequences, args.calibration_len), generator=g)
    _reset_peak()
    rss_before_fit, _ = _rss()
    start = time.perf_counter()
    if args.selections_from:
        # No fit: random weights on the layer selections an earlier run's fit chose (same shapes, same buffers).
        from hf_kvtransfer import KVMapper, MapperConfig

        selected = json.loads(Path(args.selections_from).read_text())["selected_layers"]
        config = MapperConfig(configs[0].to_dict(), configs[1].to_dict(), selected, top_k=args.top_k)
        mapper = KVMapper(config)
        with torch.no_grad():
            for p in mapper.parameters():
                p.normal_(0, p.shape[-1] ** -0.5)
    else:
        mapper = fit_mapper(
            source, target, calibration, top_k=args.top_k, batch_size=args.fit_batch_size, progress=False,
            two_stage=two_stage, probe_tokens=args.probe_tokens,
        )  # fmt: skip
    fit_s = time.perf_counter() - start
    _, fit_peak = _rss()
    mapper = mapper.to(dtype)
    print(f"fit ({'two-stage' if two_stage else 'full'}) on {args.num_sequences} x {args.calibration_len} tokens: "
          f"{fit_s:.0f} s, peak RSS +{(fit_peak - rss_before_fit) / 2**30:.2f} GiB over the models", flush=True)  # fmt: skip

    rows = []
    for T in args.seq_lens:
        plan = plans[T]
        ids = torch.randint(3, args.vocab_size, (1, T + 1), generator=g)
        with torch.no_grad():
            source_cache = prefill(source, ids)
            # Peak memory first, on the first transfer of this length (before timing runs leave freed blocks behind;
            # run with MALLOC_MMAP_THRESHOLD_ set so freed tensors leave the resident set).
            before, _ = _rss()
            _reset_peak()
            cache = TransferredCache(source_cache, mapper, num_exact_layers=0).convert_all()
            after, peak = _rss()
            del cache
            # Own prefill of the T transferred tokens (transformer body, as bench.py times it); one warm-up.
            prefill_s = float("nan")
            if not args.no_prefill:
                target.model(ids[:, :T])
                prefill_s, _ = _median_time(lambda: target.model(ids[:, :T]), args.repeats)
            transfer_s, cache = _median_time(
                lambda held=source_cache: TransferredCache(held, mapper, num_exact_layers=0).convert_all(), args.repeats
            )
        kv_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        del cache, source_cache
        gemm = _gemm_flops_per_s(mapper, T, dtype)
        bound_s = plan.mapping_flops / gemm
        row = {
            "seq_len": T,
            "prefill_ms": prefill_s * 1e3,
            "transfer_ms": transfer_s * 1e3,
            "speedup": prefill_s / transfer_s,
            "flop_ratio": plan.flop_ratio,
            "gemm_gflops": gemm / 1e9,
            "transfer_flop_bound_ms": bound_s * 1e3,
            "transfer_vs_bound": transfer_s / bound_s,
            "transfer_peak_bytes": peak - before,
            "plan_transfer_peak_bytes": plan.transfer_peak_bytes,
            "plan_transfer_peak_bytes_max": plan.target_cache_bytes + plan.transfer_working_bytes_max,
            "peak_vs_plan": (peak - before) / plan.transfer_peak_bytes,
            "target_cache_bytes": kv_bytes,
            "plan_target_cache_bytes": plan.target_cache_bytes,
            "resident_after_bytes": after - before,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {
        "pair": [source_id, target_id],
        "vocab_size": args.vocab_size,
        "dtype": args.dtype,
        "threads": args.threads,
        "top_k": args.top_k,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "fit": {"skipped_random_weights_on_selections_from": args.selections_from,
                "mode": "two-stage" if two_stage else "full", "seconds": fit_s, "peak_rss_over_models": fit_peak - rss_before_fit,
                "num_sequences": args.num_sequences, "calibration_len": args.calibration_len,
                "plan_statistics_bytes": first.fit_default_statistics_bytes},  # fmt: skip
        "selected_layers": mapper.config.selected_layers,
        "mapper_bytes": sum(p.numel() * p.element_size() for p in mapper.parameters()),
        "plan": first.to_dict(),
        "rows": rows,
        "load_average": os.getloadavg(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=sorted(PAIRS), default="qwen3")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024])
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--num-sequences", type=int, default=4)
    parser.add_argument("--calibration-len", type=int, default=256)
    parser.add_argument("--fit-batch-size", type=int, default=2)
    parser.add_argument("--probe-tokens", type=int, default=256)
    parser.add_argument("--memory-gib", type=float, default=8.0, help="memory the fit may use (plan's budget input)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", default="real_shapes.json")
    parser.add_argument("--selections-from", metavar="JSON", help="skip the fit: random weights on the layer "
                        "selections in an earlier run's results")
    parser.add_argument("--no-prefill", action="store_true", help="do not time the target's own prefill")
    parser.add_argument("--costs-at-scale", action="store_true",
                        help="build nothing: for Qwen3 14B -> 32B and Llama-3.1 8B -> 70B, what maps reading the "
                        "target's residual stream add (mapper size, FLOPs to the first token) next to the exact layers' "
                        "share of the prefill, at --seq-lens, --exact-layers, --residual-positions, --ranks")
    parser.add_argument("--exact-layers", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--residual-positions", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--ranks", nargs="+", default=["full", "256"], help="full or an integer rank per map")
    args = parser.parse_args(argv)
    if args.costs_at_scale:
        ranks = [None if r == "full" else int(r) for r in args.ranks]
        report = costs_at_scale(args.seq_lens, args.exact_layers, args.residual_positions, ranks)
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
        table = costs_markdown(report)
        Path(args.output).with_suffix(".md").write_text(table)
        print(table, end="")
        print(f"results in {args.output} and {Path(args.output).with_suffix('.md')}")
        return 0
    report = run(args)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"results in {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
