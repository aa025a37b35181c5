"""Model configs without the models: a local folder or file, the Hub, or the architecture facts shipped here.

`plan` (and anything else that needs only shapes) must work offline for the families people actually use, so
the package ships the published `config.json` of common models in `hf_kvtransfer/known_configs/` (Qwen3,
Qwen2.5, Llama-3.1/3.2, Mistral-7B-v0.3, Ministral-8B). `load_model_config` tries, in order: a local directory
holding `config.json` or a JSON file; the Hub through `AutoConfig`; the shipped config of a known id.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from transformers import AutoConfig, PreTrainedConfig

logger = logging.getLogger(__name__)

__all__ = ["known_model_ids", "known_config_dict", "load_model_config"]

KNOWN_CONFIGS_DIR = "known_configs"
# Variants that share the base model's architecture (same KV shapes and RoPE): looked up by the base id.
_VARIANT_SUFFIXES = ("-Instruct", "-Base", "-it", "-chat")


@lru_cache(maxsize=1)
def _known_index() -> dict[str, str]:
    """lower-case repo id -> file name of its shipped config."""
    folder = resources.files(__package__).joinpath(KNOWN_CONFIGS_DIR)
    index = {}
    for entry in folder.iterdir():
        if entry.name.endswith(".json"):
            index[entry.name.removesuffix(".json").replace("--", "/").lower()] = entry.name
    return index


def known_model_ids() -> list[str]:
    """Hub ids whose architecture facts ship with the package (usable with no network)."""
    return sorted(json.loads(_read_known(name))["_name_or_path"] for name in _known_index().values())


def _read_known(file_name: str) -> str:
    return resources.files(__package__).joinpath(KNOWN_CONFIGS_DIR, file_name).read_text(encoding="utf-8")


def known_config_dict(name: str) -> dict[str, Any] | None:
    """The shipped `config.json` of Hub id `name` (case-insensitive; `-Instruct`/`-Base` variants map to the
    base model's architecture), or None when it is not known."""
    key = name.strip().rstrip("/").lower()
    index = _known_index()
    if key not in index:
        for suffix in _VARIANT_SUFFIXES:
            if key.endswith(suffix.lower()) and key.removesuffix(suffix.lower()) in index:
                logger.info("no shipped config for %s: using the architecture of its base model", name)
                key = key.removesuffix(suffix.lower())
                break
        else:
            return None
    return json.loads(_read_known(index[key]))


def _config_from_dict(data: dict[str, Any], where: str) -> PreTrainedConfig:
    data = dict(data)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{where} has no `model_type`: it is not a transformers model config")
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{where}: transformers cannot build a {model_type!r} config from it ({exc})") from exc


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub endpoint opens: huggingface_hub retries an unreachable Hub for ~30 s."""
    from huggingface_hub import constants

    return _endpoint_reachable(constants.ENDPOINT, timeout)


@lru_cache(maxsize=8)
def _endpoint_reachable(endpoint: str, timeout: float) -> bool:
    # Cached per process: a plan names two models, a test suite many.
    split = urlsplit(endpoint)
    port = split.port or (443 if split.scheme == "https" else 80)
    try:
        with socket.create_connection((split.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.is_offline_mode() or env.upper() in constants.ENV_VARS_TRUE_VALUES


def _local_config(name: str) -> PreTrainedConfig | None:
    """`load_model_config`'s config from a local folder or JSON file named `name`; None when `name` names neither
    and may be a Hub id."""
    path = Path(name).expanduser()
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"local directory {path} has no config.json: pass a model folder or a Hub id")
        path = config_path
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path} does not hold a JSON object (a model config.json)")
        config = _config_from_dict(data, str(path))
        config._name_or_path = name
        return config
    if name.startswith(("./", "../", "/", "~")) or name.endswith(".json"):
        raise FileNotFoundError(f"{name} does not exist (and it is not a Hub id): check the path")
    return None


def _hub_config(
    name: str, known: bool, revision: str | None, token: str | bool | None, use_hub: bool
) -> tuple[PreTrainedConfig | None, Exception | None]:
    """`(config, None)` from the Hub, else `(None, why not)`: skipped in offline mode, with `use_hub=False`, or when
    the Hub endpoint does not answer for a `known` id (one shipped with this package)."""
    if not use_hub or _offline():
        return None, OSError("offline mode" if use_hub else "use_hub=False")
    if known and not _hub_reachable():
        return None, OSError("the Hub endpoint does not answer")
    try:
        return AutoConfig.from_pretrained(name, revision=revision, token=token), None
    except (OSError, ValueError) as exc:  # not found, gated, network down, not a transformers repo
        return None, exc


def load_model_config(
    name_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    use_hub: bool = True,
) -> PreTrainedConfig:
    """A model's transformers config, from wherever it can be had without loading the model.

    Tries, in order: a local directory holding `config.json`, or a local JSON file; the Hugging Face Hub
    (`AutoConfig.from_pretrained`, skipped in offline mode, with `use_hub=False`, or when a known id's Hub
    endpoint does not answer); the architecture facts shipped with this package for known ids
    (`known_model_ids()`), e.g. when the Hub is unreachable or the repo is gated.

    Args:
        name_or_path: a local folder or `.json` file, or a Hub id such as `"Qwen/Qwen3-0.6B"`.
        revision, token: passed to the Hub.
        use_hub: set False to never touch the network.

    Returns:
        `transformers.PreTrainedConfig` (`_name_or_path` set to `name_or_path`).

    Raises:
        FileNotFoundError / ValueError: the local path does not exist or holds no model config.
        OSError: neither the Hub nor the shipped configs know `name_or_path`; the message says what was tried.

    Example:
        ```python
        >>> config = load_model_config("Qwen/Qwen3-0.6B")  # works offline: shipped architecture facts
        >>> config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        (28, 8, 128)
        ```
    """
    name = os.fspath(name_or_path)
    local = _local_config(name)
    if local is not None:
        return local
    known = known_config_dict(name)
    config, hub_error = _hub_config(name, known is not None, revision, token, use_hub)
    if config is not None:
        return config
    if known is not None:
        # A warning, not info: the plan's numbers then come from the architecture shipped here, not from the Hub.
        logger.warning(
            "using the config of %s shipped with hf-kvtransfer (the Hub did not provide it: %s)",
            name, " ".join(str(hub_error).split())[:200],
        )  # fmt: skip
        config = _config_from_dict(known, f"shipped config of {name}")
        config._name_or_path = name
        return config
    raise OSError(
        f"cannot get the config of {name!r}: it is not a local folder or file, the Hub did not provide it "
        f"({' '.join(str(hub_error).split())[:300]}), and it is not one of the shipped configs "
        f"({', '.join(known_model_ids())}); pass a local model folder or a config.json"
    ) from hub_error
