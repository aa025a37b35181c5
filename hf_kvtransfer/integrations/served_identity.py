"""Is the mapper for the models the engines serve? The vLLM connector's start-up identity checks, without vLLM.

A mapper records the source and target it was fit for (`MapperConfig.source_model_id` / `target_model_id`, their
revisions and config fingerprints). An engine serves a checkpoint by path or Hub id, at a revision, over some
tensor-parallel ranks. Served with a mapper made for another model, the transfer would hand the target KV of the
wrong shape or meaning: refused in one line. A revision that differs is only warned about (the same model, most
often re-uploaded; `warn_revision_mismatch=False` silences it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath


class IdentityError(ValueError):
    """The engine serves another model, or a layout, than the mapper was made for; the message names the fix."""


def model_name(model_id: str | None) -> str | None:
    """A model's name for comparing ids given in different forms: `Org/Name` -> `name`, a local directory -> its
    last component, a Hub cache snapshot (`.../models--Org--Name/snapshots/<hash>`) -> `name`."""
    if not model_id:
        return None
    parts = PurePath(str(model_id).rstrip("/")).parts
    for part in reversed(parts):
        if part.startswith("models--"):
            return part.split("--")[-1].lower()
    return parts[-1].lower() if parts else None


def same_model(a: str | None, b: str | None) -> bool | None:
    """True / False when both ids are known, None when either is not (nothing to compare)."""
    name_a, name_b = model_name(a), model_name(b)
    if name_a is None or name_b is None:
        return None
    return name_a == name_b


@dataclass
class ServedModel:
    """What an engine serves: `model_id` (path or Hub id), `revision`, KV heads and tensor-parallel ranks."""

    model_id: str | None
    revision: str | None
    num_key_value_heads: int
    tensor_parallel_size: int = 1


def check_served_target(mapper_config, served: ServedModel, mapper_id: str, served_model_id: str | None = None,
                        warn_revision_mismatch: bool = True) -> str | None:  # fmt: skip
    """Refuse (`IdentityError`, one line) a mapper whose target is not the served model, or a KV head layout the
    ranks cannot split; return a revision warning (None when there is nothing to say).

    `served_model_id` declares the served checkpoint to be that model (a local copy under another name)."""
    served_id = served_model_id or served.model_id
    target_id = mapper_config.target_model_id
    if same_model(target_id, served_id) is False:
        raise IdentityError(
            f"mapper {mapper_id} maps into target model {target_id!r}, but this engine serves {served_id!r}: serve "
            f"{target_id!r}, or load the mapper made for {served_id!r} (if {served_id!r} is a copy of {target_id!r}, "
            f"say so with kv_connector_extra_config['served_model_id']={target_id!r})"
        )
    heads, tp = served.num_key_value_heads, served.tensor_parallel_size
    if heads % tp and tp % heads:
        raise IdentityError(
            f"the target has {heads} KV heads, which {tp} tensor-parallel ranks can neither split nor replicate "
            f"evenly; serve it with a tensor_parallel_size that divides {heads} or that {heads} divides"
        )
    want, got = mapper_config.target_revision, served.revision
    if warn_revision_mismatch and want and got and want != got:
        return (f"mapper {mapper_id} was fit for revision {want!r} of {target_id!r}, this engine serves revision "
                f"{got!r}; if the weights differ, the mapped KV does not match them (silence this with "
                "kv_connector_extra_config['warn_revision_mismatch']=False)")  # fmt: skip
    return None


def stored_by_other_source(mapper_config, stored_model: str | None) -> str | None:
    """Why a store entry written by `stored_model` (the source engine's served model) is not the mapper's source,
    or None when it is (or either id is unknown)."""
    if same_model(mapper_config.source_model_id, stored_model) is False:
        return (f"the store entry was written by source model {stored_model!r}, the mapper maps from "
                f"{mapper_config.source_model_id!r}")  # fmt: skip
    return None


__all__ = ["IdentityError", "ServedModel", "check_served_target", "model_name", "same_model", "stored_by_other_source"]
