"""Where a fit's resident memory goes up to its configuration probe: the process's resident set over the calibration
pass, its peak, and at the moment the fit hands the residual input's candidates to the probe the bytes of the CPU
tensors still alive (the sums the maps are solved from), largest shapes first.

It runs `hf-kvtransfer fit` with the given arguments, samples the resident set (VmRSS) every `--every` seconds, stops
the fit when the candidates are handed over (before any probe) and writes what it saw, with the process's CPU times
and page faults. Run it once as it is and once with `MALLOC_MMAP_THRESHOLD_=131072` in the environment to see what of
the resident set is freed memory that the C allocator keeps (the variable is recorded):

    OMP_NUM_THREADS=1 python research/fit_timing/fit_memory.py --output FILE -- --source examples/family_deep/source \\
        --target examples/family_deep/target --dataset examples/family_deep/calibration.txt --output DIR

Arguments after `--` are `hf-kvtransfer fit`'s (its `--output` is not written: the fit stops before it saves).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import threading
import time
from pathlib import Path

import torch


class _Handed(Exception):
    """Raised when the fit hands the probe its candidates: the fit stops there."""


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _live_cpu_tensors(top: int = 10) -> dict:
    """Bytes of the distinct CPU storages that live tensors hold, in all and by (dtype, shape)."""
    seen, by_shape, total = set(), {}, 0
    for obj in gc.get_objects():
        if not torch.is_tensor(obj) or obj.device.type != "cpu":
            continue
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
        key = f"{obj.dtype} {list(obj.shape)}"
        by_shape[key] = by_shape.get(key, 0) + storage.nbytes()
    largest = sorted(by_shape.items(), key=lambda kv: -kv[1])[:top]
    return {"mib": total / 2**20, "largest_mib": {k: v / 2**20 for k, v in largest}}


def measure(fit_args: list[str], every_s: float) -> dict:
    """The resident set over the fit that `fit_args` runs, up to the probe, and the live tensors there."""
    from hf_kvtransfer.commands.cli import main
    from hf_kvtransfer.fitting import residual_stats

    start, samples, found = time.time(), [], {}

    def sample() -> None:
        while not found:
            samples.append((round(time.time() - start, 1), _status_kb("VmRSS")))
            time.sleep(every_s)

    handed = residual_stats.ResidualFit.candidates

    def at_probe(self, mapper, statistics, config):
        gc.collect()
        found.update(seconds=round(time.time() - start, 1), rss_kb=_status_kb("VmRSS"), tensors=_live_cpu_tensors())
        raise _Handed

    threading.Thread(target=sample, daemon=True).start()
    residual_stats.ResidualFit.candidates = at_probe
    try:
        main(["fit", *fit_args])
    except _Handed:
        pass
    finally:
        residual_stats.ResidualFit.candidates = handed
    if not found:
        raise SystemExit("the fit searched no residual candidates (see its log): nothing was measured at the probe")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"at_probe": found, "peak_rss_kb": _status_kb("VmHWM"), "rss_samples_s_kb": samples,
            "user_s": usage.ru_utime, "system_s": usage.ru_stime, "minor_page_faults": usage.ru_minflt}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between resident-set samples (default 2)")
    parser.add_argument("--output", type=Path, help="write the figures as JSON here")
    parser.add_argument("fit_args", nargs=argparse.REMAINDER, help="after --: hf-kvtransfer fit's arguments")
    args = parser.parse_args(argv)
    fit_args = args.fit_args[1:] if args.fit_args[:1] == ["--"] else args.fit_args
    torch.set_num_threads(1)
    result = {"fit_args": fit_args, "threads": 1, "date": time.strftime("%Y-%m-%d"),
              "load_average": os.getloadavg(), "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
              "rss_kb_at_start": _status_kb("VmRSS"), **measure(fit_args, args.every)}  # fmt: skip
    text = json.dumps(result, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rss_samples_s_kb"}, indent=1))
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
