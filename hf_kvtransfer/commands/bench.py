"""Latency and memory of KV transfer against the target's own prefill, measured in one process.

For each sequence length: (a) the target's own prefill (transformer body, as the paper times it, and the full
forward with logits), (b) the transfer itself (the mapper's exact layers computed by the target, then strip source
RoPE + map + apply target RoPE for every other layer: `TransferredCache(..., model=target).convert_all()`), (c) time to first token (`timing.time_to_first_token`) **at the mapper's
defaults** (its exact layers, which the target computes itself, and `TransferredCache`'s recomputed tokens) and, beside
it, with every layer mapped (0 exact layers, 1 recomputed token: the transfer's own cost, which loses what the context
said on a mapper that needs exact layers), both against the target's own prefill, (d) one decode step on a
transferred cache vs. a plain `DynamicCache`, (e) peak memory of (a) and (b), and (f) the mapper's parameters and
bytes, with the prefill's FLOPs over those of (b) (`core.flops`). Warm-up first, medians over repeats; results as
JSON, a markdown table and a PNG plot (`reporting.save_bench_report`).

`run(BenchConfig(...))` builds the models and mappers a config names and runs the benchmark; the command line
(`hf-kvtransfer bench`, `commands/cli.py`) owns the arguments and re-executes itself with `OMP_WAIT_POLICY=PASSIVE`
(OpenMP busy-waiting makes small CPU ops cost milliseconds on a shared machine, and the variable only takes effect
before torch loads). The setting, the thread count and the machine are recorded in the results.

Example:
    ```python
    >>> from hf_kvtransfer.commands.bench import BenchConfig, run
    >>> config = BenchConfig("examples/family/small", "examples/family/large", random_weights=True, seq_lens=(512, 1024))
    >>> report = run(config)
    >>> report["results"][0]["ttft_defaults_ms"], report["settings"]["ttft_defaults"]["num_exact_layers"]
    ```
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core.cache import TransferredCache
from ..core.defaults import DEFAULT_NUM_RECOMPUTE_TOKENS, resolve_exact_window, resolve_num_exact_layers
from ..core.flops import exact_layers_flops, mapping_flops, prefill_flops
from ..core.capture import cache_argument, prefill
from ..core.loading import DTYPES, check_device, load_model
from ..core.map_inputs import maps_read
from ..core.mapper import KVMapper
from ..core.options import with_options
from ..core.progress import progress_bar
from ..core.rope import text_config
from ..core.stats import KVStatistics
from ..evaluation.evaluate import kv_r2
from ..evaluation.timing import DEFAULT_SEQ_LENS, QUICK_SEQ_LENS, median_ms, synchronize, time_call, time_to_first_token
from ..fitting.accumulate import collect_statistics
from ..fitting.config import parse_rank_spec
from ..fitting.fit import solve_mapper
from .reporting import origin_of_exact_layers, ttft_settings_line

logger = logging.getLogger(__name__)

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


@dataclasses.dataclass(frozen=True)
class BenchTiming:
    """The options of `run_benchmark` (each one also accepted as a keyword of `run_benchmark`).

    Attributes:
        repeats / warmup: timed and untimed calls per measurement; medians are reported.
        decode_steps: single-token steps timed per repeat for (d).
        measure_ttft, measure_decode, measure_memory, measure_full_forward: which measurements run.
        num_exact_layers, num_recompute_tokens: the configuration time to first token is timed at, as
            `TransferredCache` takes them (default None: the first mapper's exact layers and the cache's default of
            recomputed tokens, i.e. what a user gets). Beside it, every layer mapped (0 exact layers, 1 recomputed
            token) is timed too and labelled as such.
        exact_layers_origin: where the exact-layer count came from, for the report (default: said from the mapper).
        seed, progress: the random prompts' seed; a progress bar.
    """

    repeats: int = 5
    warmup: int = 1
    decode_steps: int = 8
    measure_ttft: bool = True
    measure_decode: bool = True
    measure_memory: bool = True
    measure_full_forward: bool = True
    num_exact_layers: int | None = None
    num_recompute_tokens: int | None = None
    exact_layers_origin: str | None = None
    seed: int = 0
    progress: bool = True


@torch.no_grad()
def _stage_bar(stages: int, progress: bool) -> tuple[Any, Callable[[str, int], None]]:
    """A progress bar over `stages` stages and `step(name, seq_len)`, which names a stage and advances the bar."""
    bar = progress_bar(total=stages, desc="bench", unit="stage", enabled=progress)

    def step(name: str, seq_len: int):
        bar.set_postfix_str(f"T={seq_len} {name}")
        bar.update(1)

    return bar, step


def run_benchmark(
    source: torch.nn.Module,
    target: torch.nn.Module,
    mappers: dict[str, KVMapper] | KVMapper,
    seq_lens: Sequence[int] = DEFAULT_SEQ_LENS,
    timing: BenchTiming | None = None,
    **keywords: Any,
) -> dict[str, Any]:
    """Time transfer against the target's own prefill at each sequence length (batch 1).

    Args:
        source, target: causal LMs on the same device (their dtype is the cache dtype).
        mappers: one `KVMapper` or several by name (e.g. full rank and reduced ranks); every one is timed
            for (b); (c) and (d) use the first. Put them on the models' device and dtype beforehand.
        seq_lens: context lengths in tokens.
        timing: the options (`BenchTiming`); any of its fields may be given as a keyword instead (`repeats=3`).

    Returns:
        `{"environment", "settings", "mappers": {name: size}, "results": [one dict per seq_len]}`, times in ms,
        memory in bytes. `settings["ttft_defaults"]` / `settings["ttft_all_mapped"]` say the exact layers and
        recomputed tokens each time to first token used; rows hold `ttft_own_ms`, `ttft_defaults_ms`,
        `ttft_defaults_speedup`, `ttft_all_mapped_ms`, `ttft_all_mapped_speedup`.
    """
    o = with_options(BenchTiming, timing, keywords, "run_benchmark")
    if isinstance(mappers, KVMapper):
        mappers = {"mapper": mappers}
    device = next(target.parameters()).device
    vocab = text_config(target.config).vocab_size
    generator = torch.Generator().manual_seed(o.seed)
    first = next(iter(mappers))
    mappers[first].resolve_num_exact_layers(o.num_exact_layers)  # a count the target cannot take: refused before timing
    stages = len(seq_lens) * (3 + len(mappers) + 2 * o.measure_ttft + o.measure_decode)
    bar, step = _stage_bar(stages, o.progress)
    results = []
    for seq_len in seq_lens:
        ids = torch.randint(4, vocab, (1, seq_len), generator=generator).to(device)
        row: dict[str, Any] = {"seq_len": seq_len}
        source_cache = prefill(source, ids)
        _time_prefills(row, source, target, ids, o, step)
        _time_transfers(row, source_cache, target, mappers, ids, o, step)
        if o.measure_memory:
            row["prefill_body_peak_bytes"] = peak_memory(lambda: prefill(target, ids), device)
        if o.measure_ttft:
            _time_first_tokens(row, source, target, mappers[first], ids, o, step)
        if o.measure_decode:
            row.update(_decode_times(target, ids, source_cache, mappers[first], device, o.repeats, o.warmup,
                                     o.decode_steps, generator))  # fmt: skip
            step("decode", seq_len)
        results.append(row)
        source_cache = None  # free it before the next length's prefill
    bar.close()
    return {
        "environment": environment(),
        "settings": _bench_settings(source, target, mappers, first, seq_lens, o),
        "mappers": {name: mapper_size(m) for name, m in mappers.items()},
        "results": results,
    }


def _time_prefills(row: dict[str, Any], source, target, ids, o: BenchTiming, step) -> None:
    """The source's prefill, the target's prefill (body) and full forward, and the prefill's FLOPs."""
    device, seq_len = ids.device, ids.shape[-1]
    _measure(row, "source_prefill_ms", lambda: prefill(source, ids), device, max(1, o.repeats // 2), 0)
    step("source prefill", seq_len)
    _measure(row, "prefill_body_ms", lambda: prefill(target, ids), device, o.repeats, o.warmup)
    step("target prefill (body)", seq_len)
    if o.measure_full_forward:
        full = lambda: target(input_ids=ids, use_cache=True)  # noqa: E731  (logits for every position)
        _measure(row, "prefill_full_ms", full, device, o.repeats, o.warmup)
    step("target forward (full)", seq_len)
    row["prefill_gflop"] = prefill_flops(target.config, seq_len)["total"] / 1e9


def _time_transfers(row: dict[str, Any], source_cache, target, mappers: dict[str, KVMapper], ids, o: BenchTiming, step) -> None:
    """Each mapper's whole transfer at its exact layers (computed by the target, then the maps): `row["transfer"]`."""
    device, seq_len = ids.device, ids.shape[-1]
    row["transfer"] = {}
    for name, mapper in mappers.items():
        convert = lambda m=mapper: TransferredCache(  # noqa: E731
            source_cache, m, num_recompute_tokens=0, num_exact_layers=o.num_exact_layers, model=target
        ).convert_all()
        exact, window = resolve_num_exact_layers(mapper, o.num_exact_layers), resolve_exact_window(mapper, None)
        entry: dict[str, Any] = {"num_exact_layers": exact, "exact_window": window}
        ms = _measure(entry, "ms", convert, device, o.repeats, o.warmup)
        entry.update({
            "speedup_vs_body": row["prefill_body_ms"] / ms,
            "cpu_speedup_vs_body": row["prefill_body_ms_cpu"] / max(entry["ms_cpu"], 1e-9),
            "exact_gflop": exact_layers_flops(target.config, seq_len, exact, window=window) / 1e9,
            "mapping_gflop": mapping_flops(mapper, seq_len, exact) / 1e9,
        })  # fmt: skip
        # What was timed: the exact layers and the maps.
        entry["flop_ratio"] = row["prefill_gflop"] / max(entry["exact_gflop"] + entry["mapping_gflop"], 1e-12)
        if o.measure_memory:
            entry["peak_bytes"] = peak_memory(convert, device)
        row["transfer"][name] = entry
        step(f"transfer {name}", seq_len)


def _time_first_tokens(row: dict[str, Any], source, target, mapper: KVMapper, ids, o: BenchTiming, step) -> None:
    """Time to first token at the configuration asked for (the defaults) and with every layer mapped."""
    seq_len = ids.shape[-1]
    at_defaults = time_to_first_token(
        source, target, mapper, ids, num_exact_layers=o.num_exact_layers,
        num_recompute_tokens=o.num_recompute_tokens, repeats=o.repeats,
    )  # fmt: skip
    step("TTFT at the defaults (and own prefill)", seq_len)
    # A mapper whose maps read the target's residual cannot map every layer: no such row for it.
    all_mapped = time_to_first_token(
        source, target, mapper, ids, num_exact_layers=0, num_recompute_tokens=1, repeats=o.repeats, measure_own=False
    ) if not mapper.needs_exact_layers else None
    row.update({
        "ttft_own_ms": at_defaults["target_prefill_ms"],
        "ttft_defaults_ms": at_defaults["transfer_ms"], "ttft_defaults_speedup": at_defaults["speedup"],
        "ttft_defaults_num_exact_layers": at_defaults["num_exact_layers"],
        "ttft_defaults_num_recompute_tokens": at_defaults["num_recompute_tokens"],
        "ttft_all_mapped_ms": all_mapped["transfer_ms"] if all_mapped else None,
        "ttft_all_mapped_speedup": at_defaults["target_prefill_ms"] / all_mapped["transfer_ms"] if all_mapped else None,
    })  # fmt: skip
    step("TTFT all mapped", seq_len)


def _bench_settings(source, target, mappers: dict[str, KVMapper], first: str, seq_lens, o: BenchTiming) -> dict[str, Any]:
    """The report's `settings`: the machine's side of the run and what each time to first token used."""
    parameter = next(target.parameters())
    settings = {
        "device": str(parameter.device), "dtype": str(parameter.dtype).removeprefix("torch."), "batch_size": 1,
        "repeats": o.repeats, "warmup": o.warmup, "decode_steps": o.decode_steps, "seq_lens": list(seq_lens),
        "source": getattr(source.config, "_name_or_path", None) or "random-init",
        "target": getattr(target.config, "_name_or_path", None) or "random-init",
        "attn_implementation": getattr(target.config, "_attn_implementation", None),
        "num_target_layers": len(mappers[first].layers),
    }  # fmt: skip
    if o.measure_ttft:
        # What each time to first token used (the recomputed tokens per length are in the rows).
        mapper = mappers[first]
        origin = o.exact_layers_origin
        settings["ttft_mapper"] = first
        settings["ttft_defaults"] = {
            "num_exact_layers": mapper.resolve_num_exact_layers(o.num_exact_layers),
            "exact_window": mapper.config.exact_window,
            "maps_read": maps_read(mapper.config, mapper.resolve_num_exact_layers(o.num_exact_layers)),
            "exact_layers_origin": origin if origin is not None else origin_of_exact_layers(mapper, o.num_exact_layers),
            "num_recompute_tokens": o.num_recompute_tokens,  # None: TransferredCache's default
            "num_recompute_tokens_default": DEFAULT_NUM_RECOMPUTE_TOKENS,
        }  # fmt: skip
        settings["ttft_all_mapped"] = (
            {"num_exact_layers": 0, "num_recompute_tokens": 1} if not mapper.needs_exact_layers
            else None  # its maps read the target's residual, computed in exact layers
        )
    return settings


def _decode_times(target, ids, source_cache, mapper, device, repeats, warmup, steps, generator) -> dict[str, float]:
    """Median single-token decode step on a transferred cache vs. the target's own cache (same tokens)."""
    vocab = text_config(target.config).vocab_size
    new = torch.randint(4, vocab, (1, steps), generator=generator).to(device)
    caches = {
        "own": prefill(target, ids),
        "transfer": TransferredCache(source_cache, mapper, num_recompute_tokens=0, model=target).convert_all(),
    }
    times: dict[str, list[float]] = {name: [] for name in caches}
    cpu: dict[str, list[float]] = {name: [] for name in caches}
    for repeat in range(warmup + repeats):
        for name, cache in caches.items():  # interleaved, so drifting machine load hits both alike
            for i in range(steps):
                synchronize(device)
                start, start_cpu = time.perf_counter(), time.process_time()
                target(input_ids=new[:, i : i + 1], use_cache=True, **{cache_argument(target): cache})
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
def random_weight_model(name_or_path: str, seed: int = 0, min_positions: int = 0) -> torch.nn.Module:
    """A causal LM of `name_or_path`'s config (a model folder, a `config.json`, or an id `load_model_config` knows)
    with random weights: timing depends on the shapes, not the weights. `max_position_embeddings` is raised to
    `min_positions` where it is smaller."""
    from transformers import AutoModelForCausalLM

    from .model_configs import load_model_config

    config = load_model_config(name_or_path)
    if getattr(config, "max_position_embeddings", min_positions) < min_positions:
        config.max_position_embeddings = min_positions
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.config._name_or_path = f"random weights, config of {name_or_path}"
    return model


def _calibration_ids(target_path: str | None, text_path: str | None, num_tokens: int, seq_len: int, vocab: int, seed: int):
    if text_path:
        from transformers import AutoTokenizer

        if target_path is None:
            raise ValueError(f"{text_path} needs a target whose tokenizer reads it")
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


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What `run` builds and times (`hf-kvtransfer bench` makes one from its arguments).

    Args:
        source, target: model folders or Hub ids; with `random_weights`, anything `load_model_config` reads (a
            model folder, a `config.json`, a known Hub id offline), and the models get random weights.
        random_weights: time models of these configs with random weights (no checkpoints needed).
        mappers: saved mappers to time, each `"[NAME=]PATH"`; empty: mappers are solved here, one per `ranks` spec.
        exact_layers: the target's first layers computed by the target itself in the time to first token at the
            defaults (None: the first mapper's own number; a mapper solved here records none, so
            `TransferredCache`'s default applies: there is no content probe to choose one).
        recompute_tokens: prompt tokens the target recomputes in that time to first token (None:
            `TransferredCache`'s default).
        statistics: saved `KVStatistics` to solve mappers from (else collected here).
        calibration_text, calibration_tokens: the text the statistics are collected on (tokenized with the target's
            tokenizer; None: random tokens, fine for timing) and how many tokens.
        heldout_tokens, heldout_text: also report held-out K/V R^2 per mapper on this many tokens (0: skip).
        top_k, ranks: source layers per target layer, and the mappers to solve (`parse_rank_spec`, optionally
            `kN:SPEC` for another top-k and `SPEC@bf16` for a weight dtype); the first is used for time to first token.
        seq_lens, repeats, warmup, decode_steps: what is timed, how often (medians), untimed calls first.
        device, dtype, threads: where and how (None: CUDA when available; bf16 on CUDA, float32 on CPU; torch's).
        ttft, decode: whether time to first token / the decode step are measured.

    Example:
        ```python
        >>> config = BenchConfig.quick("examples/family/small", "examples/family/large", random_weights=True)
        >>> config.seq_lens
        (512, 1024, 4096, 8192)
        ```
    """

    source: str
    target: str
    random_weights: bool = False
    mappers: tuple[str, ...] = ()
    exact_layers: int | None = None
    recompute_tokens: int | None = None
    statistics: str | None = None
    calibration_text: str | None = None
    calibration_tokens: int = 16384
    heldout_tokens: int = 0
    heldout_text: str | None = None
    top_k: int | str = 4
    ranks: tuple[str, ...] = ("full", "16", "8")
    seq_lens: tuple[int, ...] = DEFAULT_SEQ_LENS
    repeats: int = 5
    warmup: int = 1
    decode_steps: int = 8
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    ttft: bool = True
    decode: bool = True

    def __post_init__(self):
        for name in ("mappers", "ranks", "seq_lens"):  # lists from argparse or a caller: stored as tuples
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.top_k != "all":
            object.__setattr__(self, "top_k", int(self.top_k))
        if not self.seq_lens or min(self.seq_lens) < 2:
            raise ValueError(f"seq_lens must be lengths of at least 2 tokens, got {list(self.seq_lens)}")
        if self.repeats < 1 or self.warmup < 0 or self.decode_steps < 1:
            raise ValueError(
                f"repeats and decode_steps must be >= 1 and warmup >= 0, got repeats {self.repeats}, decode_steps "
                f"{self.decode_steps}, warmup {self.warmup}"
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.exact_layers is not None and self.exact_layers < 0:
            raise ValueError(f"exact_layers must be >= 0, got {self.exact_layers}")
        if self.recompute_tokens is not None and self.recompute_tokens < 1:
            raise ValueError(
                f"recompute_tokens must be >= 1 (the target is fed the prompt's last token), got {self.recompute_tokens}"
            )
        if self.random_weights and self.mappers:
            raise ValueError(
                "saved mappers were fit on trained models: time them with the checkpoints (drop --random-weights)"
            )

    @classmethod
    def quick(cls, source: str, target: str, **overrides) -> BenchConfig:
        """Fewer lengths, repeats, decode steps and mappers (`hf-kvtransfer bench --quick`); `overrides` win."""
        quick = dict(seq_lens=QUICK_SEQ_LENS, repeats=3, decode_steps=4, ranks=("full", "8"))
        return cls(source, target, **{**quick, **overrides})


def _bench_models(config: BenchConfig, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """`run`'s source and target (random weights or loaded in float32), on `device`: calibration runs there."""
    if config.random_weights:
        positions = max(config.seq_lens)
        source = random_weight_model(config.source, seed=0, min_positions=positions)
        target = random_weight_model(config.target, seed=1, min_positions=positions)
    else:
        source = load_model(config.source, "source", dtype=torch.float32, device="cpu")
        target = load_model(config.target, "target", dtype=torch.float32, device="cpu")
    return source.to(device), target.to(device)


def _bench_mappers(config: BenchConfig, source, target) -> tuple[dict[str, KVMapper], str | None]:
    """`run`'s mappers by name, loaded (`config.mappers`: `[name=]path`) or solved here (`build_mappers`), and where
    their exact layers come from when that is not what the first one records (None then)."""
    origin = None
    if config.mappers:
        mappers = {}
        for item in config.mappers:
            name, _, path = item.rpartition("=")
            mappers[name or Path(path).name] = KVMapper.from_pretrained(path)
        for mapper in mappers.values():
            mapper.check_compatible(source.config, target.config)
    else:
        statistics = KVStatistics.load(config.statistics) if config.statistics else None
        ids = None
        if statistics is None:
            vocab = text_config(target.config).vocab_size
            ids = _calibration_ids(config.target, config.calibration_text, config.calibration_tokens, 512, vocab, seed=1)
        mappers, _ = build_mappers(source, target, config.ranks, top_k=config.top_k, statistics=statistics, calibration_ids=ids)
        if config.exact_layers is None:
            # A fit chooses the exact layers with its content probe; a solve here has none to run.
            origin = (
                "solved here without a content probe, so TransferredCache's default for a mapper that records none; "
                "a fitted mapper records its own (--mapper), or set --exact-layers"
            )
    return mappers, origin


def run(config: BenchConfig, announce: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Build the models and mappers `config` names, time them (`run_benchmark`) and return the report.

    `announce` receives one line before the timing starts: the exact layers and recomputed tokens the time to first
    token uses (the command line prints it). The command line writes the report with `reporting.save_bench_report`.
    """
    if config.threads:
        torch.set_num_threads(config.threads)
    device = check_device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[config.dtype] if config.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    source, target = _bench_models(config, device)
    mappers, origin = _bench_mappers(config, source, target)
    first = next(iter(mappers.values()))
    if config.exact_layers is not None and config.exact_layers > len(first.layers):
        raise ValueError(
            f"exact_layers must be in [0, {len(first.layers)}] (the target's layers), got {config.exact_layers}"
        )
    if origin is None:
        origin = origin_of_exact_layers(first, config.exact_layers)
    quality = None
    if config.heldout_tokens:
        vocab = text_config(target.config).vocab_size
        heldout = _calibration_ids(config.target, config.heldout_text, config.heldout_tokens, 512, vocab, seed=2)
        quality = mapper_quality(source, target, mappers, heldout.to(device))
    source, target = source.to(device, dtype), target.to(device, dtype)
    # The mapper computes in the cache dtype on accelerators (bf16 GEMMs accumulate in fp32), in fp32 on CPU,
    # unless its spec named a dtype ("full@bf16": bf16 GEMMs, e.g. on CPUs with AMX, into the fp32 cache).
    default = dtype if device.type == "cuda" else torch.float32
    named = {n for n in mappers if "@" in n}
    mappers = {n: m.to(device) if n in named else m.to(device, default) for n, m in mappers.items()}
    if config.ttft and announce is not None:
        exact = first.resolve_num_exact_layers(config.exact_layers)
        announce(ttft_settings_line(exact, len(first.layers), origin, config.recompute_tokens, first.config.exact_window,
                                    maps_read(first.config, exact)))  # fmt: skip
    report = run_benchmark(
        source, target, mappers, seq_lens=config.seq_lens, repeats=config.repeats, warmup=config.warmup,
        decode_steps=config.decode_steps, measure_ttft=config.ttft, measure_decode=config.decode,
        num_exact_layers=config.exact_layers, num_recompute_tokens=config.recompute_tokens, exact_layers_origin=origin,
    )  # fmt: skip
    report["settings"]["config"] = dataclasses.asdict(config)
    if quality is not None:
        for name, entry in quality.items():
            report["mappers"][name].update(entry)
    return report
