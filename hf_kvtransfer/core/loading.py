"""Loading models and tokenizers by id or path, dtype names, and where a model lives: one copy for every caller."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

# Every dtype name the library accepts (CLI options, rank specs "@bf16", config strings).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype | None, allow_auto: bool = False) -> torch.dtype | str:
    """`"bfloat16"`, `"bf16"`, `torch.bfloat16` -> `torch.bfloat16`; `"auto"` / None -> `"auto"` when allowed."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if allow_auto:
            return "auto"
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {'auto, ' if allow_auto else ''}{', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`."""
    return str(dtype).removeprefix("torch.")


def check_device(device: str | torch.device) -> torch.device:
    """`torch.device(device)`, refusing a CUDA device this torch cannot use with a line that says what to do."""
    try:
        device = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {str(device)!r}: use cpu, cuda or cuda:N ({exc})") from exc
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise ValueError(
                f"CUDA is not available in this torch build (torch {torch.__version__}); use --device cpu or install "
                "a CUDA build (https://pytorch.org/get-started/locally/)"
            )
        if not torch.cuda.is_available():
            raise ValueError(
                f"CUDA is not available (torch {torch.__version__} found no usable GPU: check the driver and "
                "CUDA_VISIBLE_DEVICES); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{device} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def model_device(model: nn.Module) -> torch.device:
    """The device of a model's first parameter (where its inputs go)."""
    return next(model.parameters()).device


def _check_local(name, which: str) -> None:
    """A missing local model directory is reported as such, never sent to the Hub as a (malformed) repo id."""
    if isinstance(name, (str, os.PathLike)):
        from .hub import is_missing_local_path, missing_local_path_message

        if is_missing_local_path(name):
            raise FileNotFoundError(missing_local_path_message(os.fspath(name), f"{which} model: local directory"))


def _hub_model_check(name, which: str, revision: str | None) -> bool:
    """Ask the Hub once about a model id before transformers does: a mistyped id fails at once (transformers'
    downloads retry for ~30 s when the Hub cannot be reached, and a missing repo only after several requests).

    Returns whether the Hub was unreachable (then load from the local cache only: no retries). Raises
    `FileNotFoundError` naming the id when the Hub has no such repo or revision.
    """
    if not isinstance(name, (str, os.PathLike)) or os.path.exists(os.path.expanduser(os.fspath(name))):
        return False
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    from .hub import is_offline_mode, is_transport_error, missing_local_path_message

    if is_offline_mode():
        return False
    name = os.fspath(name)
    try:
        HfApi().model_info(name, revision=revision)  # one request, never retried
    except GatedRepoError:
        return False  # transformers says how to get access
    except RepositoryNotFoundError as exc:
        raise FileNotFoundError(
            f"{missing_local_path_message(name, f'{which} model: local directory', bare=True)}, and the Hub "
            f"({constants.ENDPOINT}) has no model repo {name!r}: check the id for typos; if the repo is private, "
            "run `hf auth login` with an account that can read it"
        ) from exc
    except RevisionNotFoundError as exc:
        raise FileNotFoundError(f"{which} model {name!r} has no revision {revision!r} on the Hub") from exc
    except Exception as exc:  # noqa: BLE001 - anything else is transformers' to report, except an unreachable Hub
        return is_transport_error(exc)
    return False


def _unreachable_error(name, what: str, exc: Exception) -> OSError:
    from huggingface_hub import constants

    return OSError(
        f"could not reach the Hub at {constants.ENDPOINT} to fetch the {what} {os.fspath(name)!r}, and it is "
        "not in the local cache: check your network connection (or HF_ENDPOINT), or pass a local model directory"
    )


def load_tokenizer(name: str, which: str = "model", revision: str | None = None, trust_remote_code: bool = False):
    """`AutoTokenizer.from_pretrained`, with an error that names the model the tokenizer was for."""
    from transformers import AutoTokenizer

    _check_local(name, which)
    unreachable = _hub_model_check(name, which, revision)
    try:
        return AutoTokenizer.from_pretrained(
            str(name), revision=revision, trust_remote_code=trust_remote_code, **({"local_files_only": True} if unreachable else {})
        )
    except Exception as exc:  # transformers raises OSError/ValueError/EnvironmentError variants
        if unreachable:
            raise _unreachable_error(name, f"{which} tokenizer", exc) from exc
        raise OSError(f"could not load the {which} tokenizer from {str(name)!r}: {exc}") from exc


def load_model(
    name: str,
    which: str = "model",
    *,
    revision: str | None = None,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = None,
    device_map: str | dict | None = None,
    trust_remote_code: bool = False,
):
    """A causal LM in eval mode: `AutoModelForCausalLM.from_pretrained`, then moved to `device` (or placed by
    accelerate's `device_map`); errors name the model and what was asked.

    Args:
        dtype: a torch dtype, a name from `DTYPES`, or "auto" (the checkpoint's dtype).
    """
    from transformers import AutoModelForCausalLM

    _check_local(name, which)
    if device is not None and device_map is None:
        check_device(device)  # before a download or a load that would be wasted
    unreachable = _hub_model_check(name, which, revision)
    kwargs: dict[str, Any] = {"revision": revision, "dtype": parse_dtype(dtype, allow_auto=True)}
    if unreachable:
        kwargs["local_files_only"] = True  # the cache or a clear error, not 30 s of retries
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(str(name), **kwargs)
    except Exception as exc:
        if unreachable:
            raise _unreachable_error(name, f"{which} model", exc) from exc
        raise OSError(f"could not load the {which} model from {str(name)!r}: {exc}") from exc
    if device is not None and device_map is None:
        model = model.to(check_device(device))
    return model.eval()


def load_pair(
    source: str, target: str, device: str | torch.device = "cpu", dtype: str | torch.dtype = torch.float32
):
    """`(source model, target model, target tokenizer)` by id or path, both in eval mode on `device`."""
    return (
        load_model(source, "source", dtype=dtype, device=device),
        load_model(target, "target", dtype=dtype, device=device),
        load_tokenizer(target, "target"),
    )


__all__ = ["DTYPES", "check_device", "dtype_name", "load_model", "load_pair", "load_tokenizer", "model_device", "parse_dtype"]
