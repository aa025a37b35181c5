"""Peak memory of loading and using a large mapper: is there a hidden second copy of its weights?

A synthetic pair sized so the float32 mapper is ~540 MB (source: 8 layers x 8 KV heads x 128, target: 16 layers
x 8 x 128, top_k=4: 16 x 2 maps of 4096 -> 1024, random weights). Each phase runs in a fresh process and reads
the kernel's peak resident set (VmHWM, reset through /proc/self/clear_refs just before the phase):

- load:      `KVMapper.from_pretrained` of a single-file and of a sharded checkpoint;
- transfer:  `TransferredCache(source_cache, mapper).convert_all()`, twice (the first call may build caches);
- forward:   one target forward over the last prompt token on a fresh `TransferredCache` (lazy conversion).

"extra" = peak - (resident before the phase) - (what the phase must allocate: the mapper for a load, the target
KV cache for a transfer). Prints a table and writes JSON.

Usage:
    python research/mapper_memory/mapper_memory.py --seq-len 2048 --output mapper_memory.json

(with the package installed; from a source checkout, `PYTHONPATH=. python research/mapper_memory/mapper_memory.py ...`)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

MiB = 2**20
SOURCE = dict(num_hidden_layers=8, num_key_value_heads=8, num_attention_heads=8, head_dim=128, hidden_size=256)
TARGET = dict(num_hidden_layers=16, num_key_value_heads=8, num_attention_heads=8, head_dim=128, hidden_size=256)
TOP_K = 4


def _rss() -> int:
    """Current and peak resident set size (bytes) from /proc/self/status."""
    status = Path("/proc/self/status").read_text()
    values = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("Vm")}
    return values["VmRSS"], values["VmHWM"]


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _configs():
    from transformers import Qwen3Config

    common = dict(intermediate_size=512, vocab_size=1024, max_position_embeddings=32768)
    return Qwen3Config(**common, **SOURCE), Qwen3Config(**common, **TARGET)


def _make_mapper():
    import torch

    from hf_kvtransfer import KVMapper, MapperConfig

    source, target = _configs()
    selected = [list(range(t % 5, t % 5 + TOP_K)) for t in range(TARGET["num_hidden_layers"])]  # 5 distinct selections
    mapper = KVMapper(MapperConfig(source.to_dict(), target.to_dict(), selected, top_k=TOP_K))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mapper.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return mapper


def _stacked_bytes(mapper) -> int:
    """Bytes of tensors `cache.py` keeps on the mapper between transfers (`mapper.__dict__["_stacked"]`)."""
    store = mapper.__dict__.get("_stacked", {})
    return sum(t.numel() * t.element_size() for _, t in store.values())


def _phase(name: str, directory: str, seq_len: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from hf_kvtransfer import KVMapper, TransferredCache

    out: dict = {"phase": name}
    if name.startswith("load"):
        before, _ = _rss()
        _reset_peak()
        mapper = KVMapper.from_pretrained(directory)
        after, peak = _rss()
        nbytes = sum(p.numel() * p.element_size() for p in mapper.parameters())
        return {**out, "before": before, "peak": peak, "after": after, "needed": nbytes, "mapper_bytes": nbytes}
    mapper = KVMapper.from_pretrained(directory)
    nbytes = sum(p.numel() * p.element_size() for p in mapper.parameters())
    src = mapper.source_layout
    g = torch.Generator().manual_seed(1)
    # seq_len + 1 cached tokens: the last one is left for the target to recompute (num_recompute_tokens=1).
    shape = (1, src.num_kv_heads, seq_len + 1, src.head_dim)
    source_cache = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(src.num_layers)]
    tgt = mapper.target_layout
    target_cache = 2 * tgt.num_layers * tgt.num_kv_heads * seq_len * tgt.head_dim * 4
    out.update(mapper_bytes=nbytes, needed=target_cache)
    if name == "transfer":
        runs = []
        for _ in range(2):
            before, _ = _rss()
            _reset_peak()
            cache = TransferredCache(source_cache, mapper, num_recompute_tokens=1, num_exact_layers=0).convert_all()
            after, peak = _rss()
            runs.append({"before": before, "peak": peak, "after": after, "stacked_bytes": _stacked_bytes(mapper)})
            del cache
        return {**out, **runs[0], "second": runs[1]}
    # forward: a target model of these KV shapes runs over the last prompt token on a fresh transferred cache
    from transformers import Qwen3ForCausalLM

    _, target_config = _configs()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(target_config).eval()
    ids = torch.randint(3, 1000, (1, seq_len + 1))
    before, _ = _rss()
    _reset_peak()
    with torch.no_grad():
        cache = TransferredCache(source_cache, mapper, num_recompute_tokens=1, model=model)
        model(ids[:, -1:], past_key_values=cache, use_cache=True)
    after, peak = _rss()
    return {**out, "before": before, "peak": peak, "after": after, "stacked_bytes": _stacked_bytes(mapper)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--output", default="mapper_memory.json")
    parser.add_argument("--shard-size", default="100MB", help="max_shard_size of the sharded checkpoint")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=1 << 20,
                        help="MALLOC_MMAP_THRESHOLD_ for the measured processes (0: glibc's default)")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        print(json.dumps(_phase(args.phase, args.dir, args.seq_len)))
        return 0

    repo_root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{repo_root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if args.malloc_mmap_threshold:
        # glibc then serves large blocks with mmap and returns them on free: RSS tracks live tensors, so what a
        # phase leaves behind is what it keeps, not freed memory the allocator holds on to.
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    with tempfile.TemporaryDirectory() as tmp:
        mapper = _make_mapper()
        mapper.save_pretrained(f"{tmp}/single", max_shard_size="100GB")
        mapper.save_pretrained(f"{tmp}/sharded", max_shard_size=args.shard_size)
        num_shards = len(list(Path(f"{tmp}/sharded").glob("model-*.safetensors")))
        del mapper
        rows = []
        for phase, directory in (("load", "single"), ("load-sharded", "sharded"), ("transfer", "single"), ("forward", "single")):
            cmd = [sys.executable, __file__, "--phase", phase, "--dir", f"{tmp}/{directory}", "--seq-len", str(args.seq_len)]
            result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
    for row in rows:
        row["extra"] = row["peak"] - row["before"] - row["needed"]
        if "second" in row:
            row["second"]["extra"] = row["second"]["peak"] - row["second"]["before"] - row["needed"]
    report = {"malloc_mmap_threshold": args.malloc_mmap_threshold, "seq_len": args.seq_len, "top_k": TOP_K, "source": SOURCE, "target": TARGET, "shards": num_shards, "rows": rows}
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")

    print(f"mapper: {rows[0]['mapper_bytes'] / MiB:.1f} MiB float32; transfer of {args.seq_len} tokens, batch 1; "
          f"sharded checkpoint: {num_shards} shards of <= {args.shard_size}")
    print("| phase | RSS before | peak | after | must allocate | extra at peak | kept on the mapper |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    shown = []
    for row in rows:
        shown.append((row["phase"], row))
        if "second" in row:
            shown.append(("transfer (2nd)", {**row["second"], "needed": row["needed"]}))
    for name, row in shown:
        stacked = row.get("stacked_bytes")
        print(
            f"| {name} | {row['before'] / MiB:,.0f} MiB | {row['peak'] / MiB:,.0f} MiB | {row['after'] / MiB:,.0f} MiB | "
            f"{row['needed'] / MiB:,.0f} MiB | {row['extra'] / MiB:,.0f} MiB | "
            f"{'' if stacked is None else f'{stacked / MiB:,.0f} MiB'} |"
        )
    print(f"results in {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
