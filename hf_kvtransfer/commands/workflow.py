"""The `hf-kvtransfer fit` / `solve` workflows: model ids in, mapper directories out (above the library core).

`fit_and_save` loads tokenizers and models, packs the calibration data, runs `fit_mapper`'s pass (resumable,
distributed under torchrun), solves and writes every mapper at once; `solve_and_save` solves more mappers from
statistics a fit kept. Both take one `FitConfig`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..core.loading import load_model, load_tokenizer, parse_dtype
from ..core.mapper import KVMapper
from ..core.mapper_types import MLP, RIDGE
from ..core.stats import KVStatistics
from ..fitting.calibration_pass import check_pair, check_tokenizers, remove_checkpoints
from ..fitting.probe_journal import remove_journals
from ..fitting.config import FitConfig, heldout_count, resolve_config
from ..fitting.fit import calibration_sample, fit_mappers, solve_mappers

logger = logging.getLogger(__name__)


def init_distributed() -> tuple[int, int, int, bool]:
    """Join the process group torchrun / accelerate launch describe in the environment (gloo on CPU, nccl on GPU).

    Returns:
        `(rank, world_size, local_rank, created)`; `created` says this call made the group (destroy it after).
    """
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world <= 1 or not dist.is_available():
        return 0, 1, local_rank, False
    created = False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
        created = True
    return dist.get_rank(), dist.get_world_size(), local_rank, created


def _replace_directory(tmp: Path, output: Path, overwrite: bool) -> None:
    """Move a finished temp directory into place; the old one (with `overwrite`) goes only after that."""
    if output.exists():
        if not overwrite:
            raise FileExistsError(f"{output} already exists; pass --overwrite (overwrite=True) or choose another --output")
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        os.rename(output, old)
        os.rename(tmp, output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, output)


def write_mappers(
    mappers: dict[str, KVMapper],
    output: str | os.PathLike,
    several: bool,
    overwrite: bool = False,
    push_to_hub: str | None = None,
    log: Callable[[str], None] | None = None,
) -> list[tuple[Path, KVMapper]]:
    """Save mappers under `output` (one subdirectory each when `several`) all at once: written to a temp
    directory and renamed into place, so a failure leaves no half-written mapper. Optionally push the first."""
    output = Path(output)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    results = []
    try:
        for name, mapper in mappers.items():
            mapper.save_pretrained(tmp / name if several else tmp, repo_id=push_to_hub)
            results.append((output / name if several else output, mapper))
        output.parent.mkdir(parents=True, exist_ok=True)
        _replace_directory(tmp, output, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if push_to_hub:
        url = results[0][1].push_to_hub(push_to_hub)
        (log or logger.info)(f"pushed to {url}")
    return results


def _check_output(output: Path, overwrite: bool, config: FitConfig, push_to_hub: str | None) -> None:
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite (overwrite=True) or choose another --output")
    if push_to_hub and config.several:
        raise ValueError(f"--push-to-hub publishes one mapper, but top_k asks for {len(config.top_k)}; give one k (or 'auto')")


def solve_and_save(
    stats_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    config: FitConfig | None = None,
    *,
    push_to_hub: str | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
    **overrides: Any,
) -> list[tuple[Path, KVMapper]]:
    """What `hf-kvtransfer solve` does: mappers from statistics a fit kept (`stats_dir`), without the models.

    Any k, lambda, rank or weight dtype (`config.top_k`, `ridge_lambda`, `rank`, `mapper_dtype`, `refit`) is
    solved from `stats_dir/train` (and `stats_dir/heldout` when the fit held sequences out: held-out R^2 per
    layer, `"auto"`, and the refit on all sequences, as `fit` does).
    """
    config, rest = resolve_config(config, overrides)
    if rest:
        raise TypeError(f"solve_and_save got unknown keyword argument(s) {sorted(rest)}")
    log = log or logger.info
    stats_dir, output = Path(stats_dir), Path(output_dir)
    if not (stats_dir / "train").exists():
        raise FileNotFoundError(
            f"{stats_dir} holds no statistics ({stats_dir / 'train'} is missing); write them with "
            "`hf-kvtransfer fit ... --stats-dir DIR`"
        )
    _check_output(output, overwrite, config, push_to_hub)
    train = KVStatistics.load(stats_dir / "train")
    heldout = KVStatistics.load(stats_dir / "heldout") if (stats_dir / "heldout").exists() else None
    mappers = solve_mappers(
        train, heldout, top_k=config.top_k_values, ridge_lambda=list(config.ridge_lambda), refit=config.refit,
        dtype=config.torch_mapper_dtype, **config.rank_kwargs,
    )  # fmt: skip
    return write_mappers(mappers, output, config.several, overwrite, push_to_hub, log)


def fit_checkpoint_dir(output_dir: str | os.PathLike, config: FitConfig) -> Path | None:
    """Where `fit_and_save` checkpoints partial statistics: `config.checkpoint_dir`, else STATS_DIR/checkpoints,
    else a hidden folder next to the output (ridge fits; None for an MLP fit without checkpoint_dir)."""
    if config.checkpoint_dir is not None:
        return Path(config.checkpoint_dir)
    if config.mapper_type != RIDGE:
        return None
    output = Path(output_dir)
    return Path(config.stats_dir) / "checkpoints" if config.stats_dir else output.with_name(f".{output.name}.fit-checkpoint")


def fit_and_save(
    source: str | os.PathLike,
    target: str | os.PathLike,
    output_dir: str | os.PathLike,
    config: FitConfig | None = None,
    *,
    dtype: str | torch.dtype | None = "auto",
    device_map: str | dict | None = None,
    source_revision: str | None = None,
    target_revision: str | None = None,
    trust_remote_code: bool = False,
    push_to_hub: str | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
    **overrides: Any,
) -> list[tuple[Path, KVMapper]]:
    """What `hf-kvtransfer fit` does: load both models, pack calibration data, run the pass, solve, write.

    Partial statistics are checkpointed in `config.stats_dir/checkpoints` (or a hidden directory next to
    `output_dir`), and so are the probe's scores of the candidates (`fitting/probe_journal.py`), so rerunning the
    same call resumes where it stopped; the mapper directory appears only when complete (temp dir
    + rename). Under torchrun / accelerate launch each rank takes a disjoint shard and rank 0 writes.

    Args:
        source, target: model ids or local directories (`AutoModelForCausalLM` / `AutoTokenizer`).
        output_dir: where the mapper goes; with several `top_k`, one subdirectory per k (`k1`, `kall`, ...).
        config: the fit (`FitConfig`; keyword overrides are applied on top of it).
        dtype, device_map, revisions, trust_remote_code: how the models are loaded; `dtype="auto"` is the
            checkpoint's dtype on a GPU and float32 on the CPU.
        log: a callable taking one line of text for the few facts a person should see (default: logger.info).

    Returns:
        `[(directory, mapper), ...]` on rank 0; `[]` on other ranks.
    """
    config, rest = resolve_config(config, overrides)
    if rest:
        raise TypeError(f"fit_and_save got unknown keyword argument(s) {sorted(rest)}")
    log = log or logger.info
    output = Path(output_dir)
    _check_output(output, overwrite, config, push_to_hub)
    torch_dtype = parse_dtype(dtype, allow_auto=True)  # fail on a typo before loading any model
    own_checkpoints = config.checkpoint_dir is None and config.mapper_type == RIDGE
    if own_checkpoints:
        config = config.replace(checkpoint_dir=str(fit_checkpoint_dir(output, config)))
    revisions = {"source": source_revision, "target": target_revision}
    with _process_group() as (rank, world, local_rank):
        if world > 1 and config.mapper_type == MLP:
            raise ValueError("the MLP mapper trains in one process: run `fit --mapper mlp` without torchrun")
        device_map, torch_dtype = _placement(device_map, torch_dtype, world, local_rank)
        # Cheap checks first (tokenizers, data), so a typo fails before two large models are loaded.
        src_tok, input_ids, info = _calibration_data(source, target, config, revisions, trust_remote_code)
        num_heldout = heldout_count(input_ids.shape[0], config.heldout_fraction)
        models = _load_checked_models(source, target, revisions, trust_remote_code, torch_dtype, device_map)
        # A top_k at or above the source's depth means every source layer (`fit.solve_mappers` logs it), so the
        # default top_k=8 also fits shallow sources.
        if rank == 0:
            log(
                f"calibration: {input_ids.shape[0]} x {config.seq_len} tokens from {info['dataset']} "
                f"({num_heldout} held out; every {config.stride}th token used; {world} process{'es' if world > 1 else ''})"
            )
        mappers = fit_mappers(
            *models, input_ids, config, source_model_id=str(source), target_model_id=str(target),
            source_revision=source_revision, target_revision=target_revision, calibration=info, log=log,
            tokenizer=src_tok,
        )  # fmt: skip
        del models
        results: list[tuple[Path, KVMapper]] = []
        if rank == 0:
            mappers = mappers if config.several else {"mapper": next(iter(mappers.values()))}
            results = write_mappers(mappers, output, config.several, overwrite, push_to_hub, log)
            if own_checkpoints:
                remove_journals(config.checkpoint_dir)
                remove_checkpoints(config.checkpoint_dir)
        if world > 1:
            import torch.distributed as dist

            dist.barrier()
        return results


@contextlib.contextmanager
def _process_group() -> Iterator[tuple[int, int, int]]:
    """`init_distributed` for the length of a `with`: yields `(rank, world_size, local_rank)` and destroys the
    process group on the way out if it made it."""
    rank, world, local_rank, created = init_distributed()
    try:
        yield rank, world, local_rank
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()


def _placement(
    device_map: str | dict | None, torch_dtype: torch.dtype | str | None, world: int, local_rank: int
) -> tuple[str | dict | None, torch.dtype | str | None]:
    """Where and in which dtype `fit_and_save` loads the models: this rank's GPU when CUDA is there and no
    `device_map` was given, and float32 for `"auto"` on the CPU."""
    if device_map is None and torch.cuda.is_available():
        device_map = {"": local_rank if world > 1 else torch.cuda.current_device()}
    if torch_dtype == "auto" and device_map is None:
        # On the CPU "auto" means float32: most CPUs have no bf16 matrix units and run bf16 matmuls several
        # times slower than float32, and features in bf16 would lose precision in the statistics.
        torch_dtype = torch.float32
    return device_map, torch_dtype


def _calibration_data(
    source: str | os.PathLike, target: str | os.PathLike, config: FitConfig, revisions: dict, trust_remote_code: bool
) -> tuple[Any, torch.Tensor, dict[str, Any]]:
    """Both tokenizers (checked to agree) and the packed calibration data: `(source tokenizer, input_ids, info)`."""
    src_tok = load_tokenizer(str(source), "source", revisions["source"], trust_remote_code)
    tgt_tok = load_tokenizer(str(target), "target", revisions["target"], trust_remote_code)
    check_tokenizers(src_tok, tgt_tok)
    input_ids, info = calibration_sample(src_tok, config)
    return src_tok, input_ids, info


def _load_checked_models(
    source: str | os.PathLike,
    target: str | os.PathLike,
    revisions: dict,
    trust_remote_code: bool,
    torch_dtype: torch.dtype | str | None,
    device_map: str | dict | None,
) -> list:
    """The source and target models, loaded as placed and checked to be a pair (`check_pair`)."""
    models = [
        load_model(str(name), which, revision=revisions[which], dtype=torch_dtype, device_map=device_map,
                   trust_remote_code=trust_remote_code)
        for name, which in ((source, "source"), (target, "target"))
    ]  # fmt: skip
    check_pair(*models)
    return models


__all__ = ["fit_and_save", "fit_checkpoint_dir", "init_distributed", "solve_and_save", "write_mappers"]
