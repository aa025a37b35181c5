"""Latency and memory of KV transfer against the target's own prefill, measured in one process.

For each sequence length: (a) the target's own prefill (transformer body, as the paper times it, and the full
forward with logits), (b) the transfer itself (strip source RoPE + map + apply target RoPE for every layer,
`TransferredCache(...).convert_all()`), (c) time to first token through `generate` with a transferred cache
(1 recomputed token: the transfer's own cost; the default 32 add the target's forward of 31 more tokens)
vs. the target's own prefill, (d) one decode step on a transferred cache vs. a plain `DynamicCache`, (e) peak
memory of (a) and (b), and (f) the mapper's parameters and bytes, with the FLOP ratio of mapping vs. prefill.
Warm-up first, medians over repeats; results as JSON, a markdown table and a PNG plot.

Threads: OpenMP busy-waiting makes small CPU ops cost milliseconds on a shared machine, so the command line
runs with `OMP_WAIT_POLICY=PASSIVE` (it re-executes itself with it set, since the variable only takes effect
before torch is imported) and records the setting, the thread count and the machine in the results.

Example:
    ```bash
    python -m hf_kvtransfer.commands.bench --quick --shapes family --output-dir bench_out
    hf-kvtransfer bench --source family/small --target family/large --ranks full 16 8
    ```
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.utils import tqdm

from ..core.cache import TransferredCache
from ..core.conversion import conversion_groups
from ..core.capture import prefill
from ..evaluation.evaluate import kv_r2
from ..fitting.accumulate import collect_statistics
from ..fitting.fit import solve_mapper
from ..fitting.config import parse_rank_spec
from ..core.mapper import KVMapper
from ..core.loading import DTYPES, check_device, load_model
from ..core.rope import head_dim_of, text_config
from ..core.stats import KVStatistics
from ..evaluation.timing import DEFAULT_SEQ_LENS, QUICK_SEQ_LENS, median_ms, synchronize, time_call

logger = logging.getLogger(__name__)

# Shapes of the trained family the repository ships (small and large), for timing without the checkpoints.
FAMILY_SHAPES = {
    "small": dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, intermediate_size=384),
    "large": dict(num_hidden_layers=8, hidden_size=192, num_attention_heads=6, intermediate_size=576),
}


# -- measurement helpers -------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_native_stderr():
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak of live bytes allocated by torch during `fn` on CPU, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_native_stderr():  # the profiler's C++ side prints start/stop lines to fd 2
        prof.start()
    try:
        out = fn()
    finally:
        with _quiet_native_stderr():
            prof.stop()
    del out
    # Ops report what they allocated themselves; frees show up as "[memory]" events. Replay them in time order.
    deltas = []
    for event in prof.events():
        delta = event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        if delta:
            deltas.append((event.time_range.start, delta))
    live = peak = 0
    for _, delta in sorted(deltas, key=lambda d: d[0]):
        live += delta
        peak = max(peak, live)
    return peak


def peak_memory(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Extra bytes at the peak of one call of `fn`: the CUDA allocator's peak, or torch's CPU allocations.

    The result of `fn` is kept alive until the peak is read, so it counts (a cache is the point of a prefill).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        outputs = [fn()]  # alive until the peak is read
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        outputs.clear()
        return int(peak)
    return _cpu_peak_bytes(fn)


# -- FLOPs ------------------------------------------------------------------------------------------------
def prefill_flops(config, seq_len: int, logits: bool = False) -> dict[str, int]:
    """FLOPs (2 x multiply-adds) of a decoder's prefill of `seq_len` tokens, batch 1.

    Returns `{"projections": ..., "attention": ..., "lm_head": ..., "total": ...}`; attention counts the causal
    half of QK^T and AV (what a fused kernel can skip), projections cover q/k/v/o and a gated MLP.
    """
    config = text_config(config)
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = head_dim_of(config)
    q_dim, kv_dim = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_token_layer = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * config.intermediate_size
    projections = 2 * seq_len * layers * per_token_layer
    # QK^T and AV over the causal triangle: sum_i i ~ T^2 / 2 pairs, each 2 * q_dim multiply-adds.
    attention = 2 * layers * 2 * q_dim * (seq_len * (seq_len + 1) // 2)
    lm_head = 2 * seq_len * hidden * config.vocab_size if logits else 0
    return {"projections": projections, "attention": attention, "lm_head": lm_head,
            "total": projections + attention + lm_head}  # fmt: skip


def mapping_flops(mapper: KVMapper, seq_len: int) -> int:
    """FLOPs of mapping `seq_len` tokens through every target layer (keys and values), batch 1, as
    `TransferredCache` computes them (`conversion.conversion_groups`): affine maps cost their dense or factored
    multiply-adds as they are taken (a dense reduced-rank map includes forming `up @ down`); nonlinear
    maps are counted as one multiply-add per parameter and token."""
    total = 0
    for group, dense in conversion_groups(mapper, seq_len):
        for t in group:
            layer = mapper.layers[t]
            parts = [layer.linear_parts(kind) for kind in ("key", "value")]
            if any(p is None for p in parts):
                total += seq_len * sum(p.numel() for p in layer.parameters())
            else:
                total += sum(p.macs(seq_len, dense) for p in parts)
    return 2 * total


def mapper_size(mapper: KVMapper) -> dict[str, Any]:
    params = list(mapper.parameters())
    return {
        "parameters": sum(p.numel() for p in params),
        "bytes": sum(p.numel() * p.element_size() for p in params),
        "dtype": str(params[0].dtype).removeprefix("torch.") if params else None,
        "rank": mapper.config.rank,
        "top_k": mapper.config.top_k,
        "fit_r2": tuple(
            sum(v) / len(v) if v else None for v in (mapper.config.fit_r2_key, mapper.config.fit_r2_value)
        ),
    }


def environment() -> dict[str, Any]:
    """Facts a reader needs to interpret the timings: machine, threads, library versions."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


# -- the benchmark ------------------------------------------------------------------------------------
def _measure(row: dict, name: str, fn: Callable[[], Any], device, repeats: int, warmup: int) -> float:
    """Store the median wall ms as `row[name]` and median CPU ms as `row[name + '_cpu']`; return the wall ms."""
    wall, cpu = time_call(fn, device, repeats, warmup)
    row[name], row[f"{name}_cpu"] = median_ms(wall), median_ms(cpu)
    return row[name]


@torch.no_grad()
def run_benchmark(
    source: torch.nn.Module,
    target: torch.nn.Module,
    mappers: dict[str, KVMapper] | KVMapper,
    seq_lens: Sequence[int] = DEFAULT_SEQ_LENS,
    repeats: int = 5,
    warmup: int = 1,
    decode_steps: int = 8,
    measure_ttft: bool = True,
    measure_decode: bool = True,
    measure_memory: bool = True,
    measure_full_forward: bool = True,
    compile_rope: bool | str = False,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Time transfer against the target's own prefill at each sequence length (batch 1).

    Args:
        source, target: causal LMs on the same device (their dtype is the cache dtype).
        mappers: one `KVMapper` or several by name (e.g. full rank and reduced ranks); every one is timed
            for (b); (c) and (d) use the first. Put them on the models' device and dtype beforehand.
        seq_lens: context lengths in tokens.
        repeats / warmup: timed and untimed calls per measurement; medians are reported.
        decode_steps: single-token steps timed per repeat for (d).
        compile_rope: time the transfer with `TransferredCache(..., compile_rope=True)` (True), or both ways ("both":
            extra entries named "<mapper> +compile").

    Returns:
        `{"environment", "settings", "mappers": {name: size}, "results": [one dict per seq_len]}`, times in ms,
        memory in bytes.
    """
    if isinstance(mappers, KVMapper):
        mappers = {"mapper": mappers}
    variants = [(name, mapper, bool(compile_rope)) for name, mapper in mappers.items()]
    if compile_rope == "both":
        variants = [(name, m, False) for name, m in mappers.items()] + [(f"{n} +compile", m, True) for n, m in mappers.items()]
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    vocab = text_config(target.config).vocab_size
    generator = torch.Generator().manual_seed(seed)
    first = next(iter(mappers))
    results = []
    stages = len(seq_lens) * (3 + len(variants) + 2 * measure_ttft + measure_decode)
    bar = tqdm(total=stages, desc="bench", unit="stage", disable=not progress)

    def step(name: str, seq_len: int):
        bar.set_postfix_str(f"T={seq_len} {name}")
        bar.update(1)

    for seq_len in seq_lens:
        ids = torch.randint(4, vocab, (1, seq_len), generator=generator).to(device)
        row: dict[str, Any] = {"seq_len": seq_len}
        source_cache = prefill(source, ids)
        _measure(row, "source_prefill_ms", lambda: prefill(source, ids), device, max(1, repeats // 2), 0)
        step("source prefill", seq_len)
        _measure(row, "prefill_body_ms", lambda: prefill(target, ids), device, repeats, warmup)
        step("target prefill (body)", seq_len)
        if measure_full_forward:
            full = lambda: target(input_ids=ids, use_cache=True)  # noqa: E731  (logits for every position)
            _measure(row, "prefill_full_ms", full, device, repeats, warmup)
        step("target forward (full)", seq_len)
        flops = prefill_flops(target.config, seq_len)
        row["prefill_gflop"] = flops["total"] / 1e9
        row["transfer"] = {}
        for name, mapper, compiled in variants:
            convert = lambda m=mapper, c=compiled: TransferredCache(  # noqa: E731
                source_cache, m, num_recompute_tokens=0, compile_rope=c
            ).convert_all()
            entry: dict[str, Any] = {"compile_rope": compiled}
            ms = _measure(entry, "ms", convert, device, repeats, warmup)
            entry.update({
                "speedup_vs_body": row["prefill_body_ms"] / ms,
                "cpu_speedup_vs_body": row["prefill_body_ms_cpu"] / max(entry["ms_cpu"], 1e-9),
                "mapping_gflop": mapping_flops(mapper, seq_len) / 1e9,
            })  # fmt: skip
            entry["flop_ratio"] = row["prefill_gflop"] / max(entry["mapping_gflop"], 1e-12)
            if measure_memory:
                entry["peak_bytes"] = peak_memory(convert, device)
            row["transfer"][name] = entry
            step(f"transfer {name}", seq_len)
        if measure_memory:
            row["prefill_body_peak_bytes"] = peak_memory(lambda: prefill(target, ids), device)
        mapper = mappers[first]
        if measure_ttft:
            kwargs = dict(max_new_tokens=1, do_sample=False, pad_token_id=target.config.pad_token_id or 0)
            own = lambda: target.generate(ids, **kwargs)  # noqa: E731
            transferred = lambda: target.generate(  # noqa: E731
                ids, **kwargs,
                cache=TransferredCache(source_cache, mapper, num_recompute_tokens=1, compile_rope=compile_rope is True),
            )
            _measure(row, "ttft_own_ms", own, device, repeats, warmup)
            step("TTFT own", seq_len)
            _measure(row, "ttft_transfer_ms", transferred, device, repeats, warmup)
            row["ttft_speedup"] = row["ttft_own_ms"] / row["ttft_transfer_ms"]
            step("TTFT transfer", seq_len)
        if measure_decode:
            row.update(_decode_times(target, ids, source_cache, mapper, device, repeats, warmup, decode_steps, generator))
            step("decode", seq_len)
        results.append(row)
        source_cache = None  # free it before the next length's prefill
    bar.close()
    return {
        "environment": environment(),
        "settings": {
            "device": str(device), "dtype": str(dtype).removeprefix("torch."), "batch_size": 1, "repeats": repeats,
            "warmup": warmup, "decode_steps": decode_steps, "seq_lens": list(seq_lens),
            "source": getattr(source.config, "_name_or_path", None) or "random-init",
            "target": getattr(target.config, "_name_or_path", None) or "random-init",
            "attn_implementation": getattr(target.config, "_attn_implementation", None),
        },  # fmt: skip
        "mappers": {name: mapper_size(m) for name, m, _ in variants},
        "results": results,
    }


def _decode_times(target, ids, source_cache, mapper, device, repeats, warmup, steps, generator) -> dict[str, float]:
    """Median single-token decode step on a transferred cache vs. the target's own cache (same tokens)."""
    vocab = text_config(target.config).vocab_size
    new = torch.randint(4, vocab, (1, steps), generator=generator).to(device)
    caches = {
        "own": prefill(target, ids),
        "transfer": TransferredCache(source_cache, mapper, num_recompute_tokens=0).convert_all(),
    }
    times: dict[str, list[float]] = {name: [] for name in caches}
    cpu: dict[str, list[float]] = {name: [] for name in caches}
    for repeat in range(warmup + repeats):
        for name, cache in caches.items():  # interleaved, so drifting machine load hits both alike
            for i in range(steps):
                synchronize(device)
                start, start_cpu = time.perf_counter(), time.process_time()
                target(input_ids=new[:, i : i + 1], cache=cache, use_cache=True)
                synchronize(device)
                if repeat >= warmup:
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
            cache.crop(-steps)
    own, transfer = median_ms(times["own"]), median_ms(times["transfer"])
    own_cpu, transfer_cpu = median_ms(cpu["own"]), median_ms(cpu["transfer"])
    return {
        "decode_own_ms": own, "decode_transfer_ms": transfer, "decode_overhead_pct": 100 * (transfer / own - 1),
        "decode_own_ms_cpu": own_cpu, "decode_transfer_ms_cpu": transfer_cpu,
        "decode_overhead_pct_cpu": 100 * (transfer_cpu / max(own_cpu, 1e-9) - 1),
    }  # fmt: skip


# -- building what to time --------------------------------------------------------------------------------
def family_shaped_models(vocab_size: int = 4096, seed: int = 0, max_position_embeddings: int = 8192):
    """Random-weight Qwen3 models with the bundled family's shapes (timing is independent of the weights)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    models = []
    for i, name in enumerate(("small", "large")):
        torch.manual_seed(seed + i)
        config = Qwen3Config(
            vocab_size=vocab_size, num_key_value_heads=2, head_dim=32, max_position_embeddings=max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
            pad_token_id=0, **FAMILY_SHAPES[name],
        )  # fmt: skip
        model = Qwen3ForCausalLM(config).eval()
        model.config._name_or_path = f"random-init family-shaped {name}"
        models.append(model)
    return models[0], models[1]


def _calibration_ids(target_path: str | None, text_path: str | None, num_tokens: int, seq_len: int, vocab: int, seed: int):
    if text_path:
        from transformers import AutoTokenizer

        if target_path is None:
            raise ValueError("--calibration-text needs --target (its tokenizer) ")
        tokenizer = AutoTokenizer.from_pretrained(target_path)
        ids = tokenizer(Path(text_path).read_text(), return_tensors="pt").input_ids[0]
        rows = min(len(ids) // seq_len, max(num_tokens // seq_len, 1))
        if rows == 0:
            raise ValueError(f"{text_path} has {len(ids)} tokens, fewer than one {seq_len}-token sequence")
        return ids[: rows * seq_len].view(rows, seq_len)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (max(num_tokens // seq_len, 1), seq_len), generator=generator)


def build_mappers(
    source, target, rank_specs: Sequence[str], top_k: int | str = 4, statistics=None, calibration_ids=None,
    ridge_lambda: float = 0.01, progress: bool = True,
) -> tuple[dict[str, KVMapper], Any]:
    """Solve one mapper per rank spec from one set of statistics (collected here if not given)."""
    if statistics is None:
        statistics = collect_statistics(source, target, calibration_ids, stride=4, progress=progress)
    mappers = {}
    for spec in rank_specs:
        k, rest = top_k, spec
        if spec.startswith("k") and ":" in spec:  # "k2:full", "k1:8": another number of source layers
            k, rest = spec[1:].split(":", 1)
            k = k if k == "all" else int(k)
        kwargs = parse_rank_spec(rest)
        mappers[f"k={k} {rest}"] = solve_mapper(statistics, top_k=k, ridge_lambda=ridge_lambda, **kwargs)
    return mappers, statistics


@torch.no_grad()
def mapper_quality(source, target, mappers: dict[str, KVMapper], heldout_ids: torch.Tensor) -> dict[str, dict]:
    """Held-out K/V R^2 of each mapper as stored and with its weights rounded to bf16 (storage option).

    Returns:
        `{name: {"fit_r2": (key, value), "heldout_r2": (key, value), "heldout_r2_bf16": (key, value)}}`, means
        over target layers.
    """
    import copy

    def mean(values):
        return sum(values) / len(values) if values else None

    out = {}
    for name, mapper in mappers.items():
        rounded = copy.deepcopy(mapper).to(torch.bfloat16).to(next(mapper.parameters()).dtype)
        entry = {"fit_r2": (mean(mapper.config.fit_r2_key or []), mean(mapper.config.fit_r2_value or []))}
        for label, m in (("heldout_r2", mapper), ("heldout_r2_bf16", rounded)):
            r2 = kv_r2(source, target, m, heldout_ids, progress=False)
            entry[label] = (mean(r2["key"]), mean(r2["value"]))
        out[name] = entry
    return out


def reexec_with_passive_omp(module: str, argv: Sequence[str]) -> None:
    """Re-run this program with `OMP_WAIT_POLICY=PASSIVE` unless the user set a policy: OpenMP reads it at load."""
    if "OMP_WAIT_POLICY" in os.environ:
        return
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


def run_from_args(args) -> dict[str, Any]:
    """The `bench` command (`hf-kvtransfer bench`, whose parser defines `args`): build models and mappers from
    the arguments, run, return the report (the CLI writes it with `reporting.save_bench_report`)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = check_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    seq_lens = args.seq_lens or (QUICK_SEQ_LENS if args.quick else DEFAULT_SEQ_LENS)
    repeats = args.repeats or (3 if args.quick else 5)
    ranks = args.ranks if not (args.quick and args.ranks == ["full", "16", "8"]) else ["full", "8"]
    if (args.source is None) != (args.target is None):
        raise ValueError("give both --source and --target, or neither (random models with --shapes family)")
    if args.source:
        source = load_model(args.source, "source", dtype=torch.float32, device="cpu")
        target = load_model(args.target, "target", dtype=torch.float32, device="cpu")
    else:
        source, target = family_shaped_models(max_position_embeddings=max(8192, max(seq_lens)))
    source, target = source.to(device), target.to(device)  # calibrate where the models run
    if args.mapper:
        mappers = {}
        for item in args.mapper:
            name, _, path = item.rpartition("=")
            mappers[name or Path(path).name] = KVMapper.from_pretrained(path)
    else:
        statistics = None
        if args.statistics:
            statistics = KVStatistics.load(args.statistics)
        ids = None
        if statistics is None:
            vocab = text_config(target.config).vocab_size
            ids = _calibration_ids(args.target, args.calibration_text, args.calibration_tokens, 512, vocab, seed=1)
        top_k = args.top_k if args.top_k == "all" else int(args.top_k)
        mappers, _ = build_mappers(source, target, ranks, top_k=top_k, statistics=statistics, calibration_ids=ids)
    quality = None
    if args.heldout_tokens:
        vocab = text_config(target.config).vocab_size
        heldout = _calibration_ids(args.target, args.heldout_text, args.heldout_tokens, 512, vocab, seed=2)
        quality = mapper_quality(source, target, mappers, heldout.to(device))
    source, target = source.to(device, dtype), target.to(device, dtype)
    # The mapper computes in the cache dtype on accelerators (bf16 GEMMs accumulate in fp32), in fp32 on CPU,
    # unless its spec named a dtype ("full@bf16": bf16 GEMMs, e.g. on CPUs with AMX, into the fp32 cache).
    default = dtype if device.type == "cuda" else torch.float32
    named = {n for n in mappers if "@" in n}
    mappers = {n: m.to(device) if n in named else m.to(device, default) for n, m in mappers.items()}
    report = run_benchmark(
        source, target, mappers, seq_lens=seq_lens, repeats=repeats, warmup=args.warmup,
        decode_steps=4 if args.quick and args.decode_steps == 8 else args.decode_steps,
        measure_ttft=not args.no_ttft, measure_decode=not args.no_decode,
        compile_rope={"off": False, "on": True, "both": "both"}[args.compile],
    )  # fmt: skip
    report["settings"]["command"] = " ".join(sys.argv)
    if quality is not None:
        for name, entry in quality.items():
            report["mappers"][name].update(entry)
    return report


if __name__ == "__main__":
    # `python -m hf_kvtransfer.commands.bench ...` is `hf-kvtransfer bench ...`: one parser, the CLI's.
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "hf_kvtransfer.commands.cli", "bench", *sys.argv[1:]])
