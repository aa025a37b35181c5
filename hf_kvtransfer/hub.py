"""Hub layer: find a mapper folder (local or on the Hub), publish one, and render its model card.

Only `config.json`, the safetensors weights (one file, or shards + index) and `README.md` travel (no pickle, no
code). Every huggingface_hub error is re-raised as a `MapperHubError` subclass whose one-line message names the repo
and says what to do; the original error stays attached as `__cause__`.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, ModelCard, ModelCardData, constants, get_token, snapshot_download
from huggingface_hub.errors import (
    BadRequestError,
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from .checkpoint import INDEX_NAME, WEIGHT_PATTERNS, checkpoint_info, has_weights, weight_files

try:  # huggingface_hub >= 2.0; older versions raise its parent class
    from huggingface_hub.errors import IncompleteSnapshotError
except ImportError:  # pragma: no cover
    IncompleteSnapshotError = LocalEntryNotFoundError

__all__ = [
    "MapperAuthError",
    "MapperGatedError",
    "MapperHubError",
    "MapperNotFoundError",
    "MapperOfflineError",
    "MapperRevisionNotFoundError",
    "NotAMapperError",
    "push_mapper_dir",
    "render_model_card",
    "resolve_mapper_dir",
]

from .version import __version__

logger = logging.getLogger(__name__)

# The files of a mapper directory (= a Hub repo).
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"
# The run report (model selection curves, training logs, timings, evaluation): read by the model card, never
# needed to load or apply the mapper.
REPORT_NAME = "fit_report.json"
MAPPER_FILES = (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME)
LIBRARY_NAME = "hf-kvtransfer"
CARD_TEMPLATE = "mapper_card.md"
DEFAULT_LICENSE = "apache-2.0"
PAPER_URL = "https://arxiv.org/abs/2608.03893"
_REQUIRED_CONFIG_KEYS = ("mapper_type", "selected_layers")
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")
_DATA_FILE_SUFFIXES = {".json", ".jsonl", ".txt", ".csv", ".tsv", ".parquet", ".arrow", ".gz", ".zst", ".bin"}


# -- errors ------------------------------------------------------------------------------------------------------


class MapperHubError(OSError):
    """A mapper could not be fetched from, or published to, the Hugging Face Hub (or a local folder)."""


class MapperNotFoundError(MapperHubError):
    """The repo does not exist, or is private and the token cannot read it (or the local path does not exist)."""


class MapperGatedError(MapperHubError):
    """The repo is gated and this account has not accepted its conditions."""


class MapperRevisionNotFoundError(MapperHubError):
    """The branch, tag or commit does not exist in the repo."""


class NotAMapperError(MapperHubError):
    """The folder or repo lacks `config.json` / `model.safetensors`, or its config is not a mapper config."""


class MapperOfflineError(MapperHubError):
    """The Hub cannot be reached (offline mode or network down) and the mapper is not in the local cache."""


class MapperAuthError(MapperHubError):
    """Publishing needs a token with write access, and there is none or the Hub refused it."""


# -- resolve -----------------------------------------------------------------------------------------------------


def resolve_mapper_dir(
    pretrained: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
) -> Path:
    """Return a local directory holding a mapper's `config.json` and `model.safetensors` (and `README.md`).

    A local directory is used as is. Anything else is a Hub repo id: only `config.json`, `model.safetensors` and
    `README.md` are downloaded (never pickles or code), into the huggingface_hub cache, `config.json` first, so a
    wrong repo id (a model instead of a mapper) fails before its weights are fetched. `HF_HUB_OFFLINE=1` (read when
    called, not only at import) acts like `local_files_only=True`.

    Args:
        pretrained: a local directory, or a Hub repo id such as `"org/qwen3-14b-to-qwen3-32b"`.
        revision: branch, tag or commit hash on the Hub (default: the main branch). Ignored for local directories.
        cache_dir: huggingface_hub cache directory (default: `HF_HUB_CACHE`).
        token: Hub token for private or gated repos (default: the stored `hf auth login` token).
        local_files_only: use the cache only; never touch the network.
        force_download: download again even if the files are cached.

    Returns:
        `pathlib.Path` of the directory.

    Raises:
        MapperNotFoundError, MapperGatedError, MapperRevisionNotFoundError, NotAMapperError, MapperOfflineError:
            subclasses of `MapperHubError` (an `OSError`), each with a one-line message naming the repo and what to
            do; the huggingface_hub error is the `__cause__`.

    Example:
        ```python
        >>> path = resolve_mapper_dir("org/qwen3-14b-to-qwen3-32b", revision="v1")
        >>> sorted(p.name for p in path.iterdir())
        ['README.md', 'config.json', 'model.safetensors']
        ```
    """
    name = os.fspath(pretrained)
    path = Path(name).expanduser()
    if path.is_dir():
        if revision is not None:
            logger.warning("ignoring revision=%r: %s is a local directory", revision, path)
        _check_mapper_folder(path, f"local directory {path}")
        return path
    if path.exists():
        raise NotAMapperError(
            f"{name} is a file: pass the directory that holds {CONFIG_NAME} and {WEIGHTS_NAME}, or a Hub repo id"
        )
    if _looks_like_path(name):
        raise MapperNotFoundError(missing_local_path_message(name))

    repo_id = name
    offline = local_files_only or _offline_mode()
    where = _describe(repo_id, revision)
    download = dict(
        repo_id=repo_id,
        cache_dir=cache_dir,
        token=token,
        local_files_only=offline,
        force_download=force_download,
        library_name=LIBRARY_NAME,
        library_version=_library_version(),
    )
    with _hub_errors(repo_id, revision, token=token, offline=offline):
        # config.json alone first: a mistyped id that names a model must not start a multi-GB download.
        snapshot = Path(snapshot_download(revision=revision, allow_patterns=[CONFIG_NAME], **download))
        hint = lambda: _repo_files_hint(repo_id, snapshot.name, cache_dir)  # noqa: E731
        _check_mapper_config(snapshot / CONFIG_NAME, where, hint)
        # The rest from the commit the config came from (a push in between cannot pair it with other weights).
        pinned = snapshot.name if _COMMIT_HASH.match(snapshot.name) else revision
        # Weights: model.safetensors, or the shard index and every shard (checkpoint.WEIGHT_PATTERNS).
        patterns = [*WEIGHT_PATTERNS, CARD_NAME, REPORT_NAME]
        snapshot = Path(snapshot_download(revision=pinned, allow_patterns=patterns, **download))
    _check_mapper_folder(snapshot, where, hint)
    return snapshot


def _check_mapper_folder(path: Path, where: str, hint: Callable[[], str] = str) -> None:
    """Raise NotAMapperError unless `path` holds a mapper config.json and model.safetensors."""
    _check_mapper_config(path / CONFIG_NAME, where, hint)
    if not has_weights(path):
        raise NotAMapperError(f"{where} has no {WEIGHTS_NAME}{hint()}: it is not a complete hf-kvtransfer mapper")


def _check_mapper_config(config_path: Path, where: str, hint: Callable[[], str] = str) -> None:
    if not config_path.is_file():
        raise NotAMapperError(
            f"{where} has no {CONFIG_NAME}{hint()}: it is not a hf-kvtransfer mapper "
            "(a mapper holds config.json and model.safetensors, as written by KVMapper.save_pretrained)"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise NotAMapperError(f"{where}: {CONFIG_NAME} is not valid JSON ({exc}); re-save the mapper") from exc
    missing = [k for k in _REQUIRED_CONFIG_KEYS if not isinstance(config, dict) or k not in config]
    if not missing:
        return
    if isinstance(config, dict) and "model_type" in config:
        raise NotAMapperError(
            f"{where} looks like a transformers model (model_type={config['model_type']!r}), not a hf-kvtransfer "
            "mapper: pass the id or folder of the mapper, not of a model"
        )
    raise NotAMapperError(f"{where}: {CONFIG_NAME} lacks {missing}, so it is not a hf-kvtransfer mapper config")


def _repo_files_hint(repo_id: str, commit: str, cache_dir) -> str:
    """' (it holds a, b, c)' from the tree listing huggingface_hub cached; '' if there is none."""
    try:
        from huggingface_hub import get_cached_repo_tree

        files = sorted(f.path for f in get_cached_repo_tree(repo_id, revision=commit, cache_dir=cache_dir))
    except Exception:  # an older huggingface_hub, or no listing cached: the hint is optional
        return ""
    shown = ", ".join(files[:8]) + (", ..." if len(files) > 8 else "")
    return f" (it holds {shown})" if files else " (it is empty)"


def _looks_like_path(name: str) -> bool:
    """Whether a name that is not an existing path is still meant as one (never sent to the Hub): it is
    explicit (./x, ../x, /x, ~/x), has a `.`/`..` segment or more than one `/`, or its parent folder exists
    here (`mappers/typo` next to a `mappers/` folder is a typo, not a Hub repo)."""
    parts = name.replace("\\", "/").split("/")
    return (
        os.path.isabs(name)
        or name.startswith(("./", "../", "~", ".\\", "..\\"))
        or any(p in (".", "..") for p in parts)
        or name.count("/") > 1
        or "\\" in name
        or (len(parts) == 2 and Path(parts[0]).is_dir())
    )


def missing_local_path_message(name: str, what: str = "local directory") -> str:
    """"local directory X does not exist" and, when its parent exists, what that parent holds."""
    parent = Path(name).expanduser().parent
    message = f"{what} {name} does not exist"
    if str(parent) not in ("", ".") and parent.is_dir():
        entries = sorted(p.name for p in parent.iterdir() if not p.name.startswith("."))
        shown = ", ".join(entries[:8]) + (", ..." if len(entries) > 8 else "")
        message += f" ({parent} holds: {shown or 'nothing'})"
    if not _HUB_ID.match(name):
        return message + " and it is not a valid Hub repo id either (org/name); check the path"
    return message + "; check the path (a Hub repo id looks like org/name)"


def is_missing_local_path(name: str | os.PathLike) -> bool:
    """A name meant as a local path (see `_looks_like_path`) where nothing exists: report it, never ask the Hub."""
    name = os.fspath(name)
    return not Path(name).expanduser().exists() and (_looks_like_path(name) or not _HUB_ID.match(name))


def _offline_mode() -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once at import; honour it when set later too.
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.is_offline_mode() or env.upper() in constants.ENV_VARS_TRUE_VALUES


# -- push --------------------------------------------------------------------------------------------------------


def push_mapper_dir(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | bool | None = None,
    create_pr: bool = False,
) -> str:
    """Publish a saved mapper folder to the Hub: `config.json`, `model.safetensors` and `README.md` in one commit.

    Creates the repo if needed (`private` applies only then) and the branch `revision` if it does not exist yet
    (starting from the main branch). A missing `README.md` is rendered from `config.json`.

    Args:
        folder: directory written by `KVMapper.save_pretrained`.
        repo_id: `"namespace/name"` of the target repo.
        private: visibility of a newly created repo (default: the account's default, usually public).
        revision: branch to commit to (default: main); created if missing.
        commit_message: default `"Upload <type> KV mapper <source> -> <target>"`.
        token: a token with write access (default: the stored `hf auth login` token).
        create_pr: open a pull request (`refs/pr/N`) against `revision` instead of committing to it.

    Returns:
        The commit URL (a `huggingface_hub.CommitInfo`, a `str` that also carries `.oid` and `.pr_url`).

    Raises:
        MapperAuthError: no token (raised before any network call), or the Hub refused it.
        NotAMapperError: `folder` lacks `config.json` or `model.safetensors`.
        MapperHubError: any other Hub failure (message names the repo and the fix).

    Example:
        ```python
        >>> mapper.save_pretrained("out/mapper")
        >>> push_mapper_dir("out/mapper", "my-org/qwen3-14b-to-qwen3-32b", private=True)
        'https://huggingface.co/my-org/qwen3-14b-to-qwen3-32b/commit/...'
        ```
    """
    folder = Path(folder)
    _check_mapper_folder(folder, f"folder {folder}")
    config = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    if _offline_mode():
        raise MapperOfflineError(
            f"cannot push to Hub repo '{repo_id}': offline mode is on (HF_HUB_OFFLINE=1); unset it to publish"
        )
    write_token = _write_token(token, repo_id)
    card, report = folder / CARD_NAME, folder / REPORT_NAME
    report_data = json.loads(report.read_text(encoding="utf-8")) if report.is_file() else None
    card_content: str | bytes = (
        str(card)
        if card.is_file()
        else str(render_model_card(config, repo_id, report=report_data, checkpoint=checkpoint_info(folder))).encode()
    )
    weights = [f.name for f in weight_files(folder)] + ([INDEX_NAME] if (folder / INDEX_NAME).is_file() else [])
    operations = [
        CommitOperationAdd(path_in_repo=CONFIG_NAME, path_or_fileobj=str(folder / CONFIG_NAME)),
        *(CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name)) for name in weights),
        CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card_content),
    ]
    if report.is_file():
        operations.append(CommitOperationAdd(path_in_repo=REPORT_NAME, path_or_fileobj=str(report)))
    api = HfApi(token=write_token, library_name=LIBRARY_NAME, library_version=_library_version())
    with _hub_errors(repo_id, revision, token=write_token, pushing=True):
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None and revision != constants.DEFAULT_REVISION and not revision.startswith("refs/"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        # Weight files of an earlier push in the other layout (single file vs shards) go in the same commit.
        stale = [f for f in api.list_repo_files(repo_id, revision=revision) if _is_weight_file(f) and f not in weights]
        operations += [CommitOperationDelete(path_in_repo=f) for f in stale]
        info = api.create_commit(
            repo_id,
            operations=operations,
            commit_message=commit_message or _default_commit_message(config),
            revision=revision,
            create_pr=create_pr,
        )
    logger.info("pushed mapper to %s (%s)", repo_id, info.pr_url or info.commit_url)
    return info


def _is_weight_file(name: str) -> bool:
    return name in (WEIGHTS_NAME, INDEX_NAME) or any(fnmatch.fnmatch(name, p) for p in WEIGHT_PATTERNS)


def _write_token(token: str | bool | None, repo_id: str) -> str:
    hint = "run `hf auth login` or pass token="
    if token is False:
        raise MapperAuthError(f"cannot push to Hub repo '{repo_id}' with token=False: pushing needs a token; {hint}")
    if isinstance(token, str) and token:
        return token
    stored = get_token()
    if stored is None:
        raise MapperAuthError(
            f"pushing to Hub repo '{repo_id}' needs a Hugging Face token with write access and none was found: {hint}"
        )
    return stored


def _default_commit_message(config: dict) -> str:
    source, target = config.get("source_model_id"), config.get("target_model_id")
    pair = f" {source} -> {target}" if source and target else ""
    return f"Upload {config.get('mapper_type', '')} KV mapper{pair}".replace("  ", " ")


# -- error translation -----------------------------------------------------------------------------------------


def _describe(repo_id: str, revision: str | None) -> str:
    return f"Hub repo '{repo_id}'" + (f" at revision '{revision}'" if revision else "")


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level errors of whichever HTTP client huggingface_hub uses (httpx2 in 2.x, httpx in 1.x)."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(module).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _refs_hint(repo_id: str, token: str | bool | None) -> str:
    try:
        refs = HfApi(token=token).list_repo_refs(repo_id)
    except Exception:  # best effort: the message stays useful without it
        return ""
    branches = ", ".join(b.name for b in refs.branches) or "none"
    tags = ", ".join(t.name for t in refs.tags) or "none"
    return f" (branches: {branches}; tags: {tags})"


@contextmanager
def _hub_errors(repo_id: str, revision: str | None, *, token=None, offline: bool = False, pushing: bool = False):
    """Re-raise huggingface_hub errors as MapperHubError subclasses with a one-line, actionable message."""
    where = _describe(repo_id, revision)
    endpoint = constants.ENDPOINT
    login = "pass token= or run `hf auth login`"
    cache_hint = "once downloaded, a mapper loads offline with local_files_only=True or HF_HUB_OFFLINE=1"
    try:
        yield
    except MapperHubError:
        raise
    except GatedRepoError as exc:
        raise MapperGatedError(
            f"{where} is gated: accept its conditions at {endpoint}/{repo_id} while logged in, then {login}"
        ) from exc
    except RepositoryNotFoundError as exc:
        if pushing:
            raise MapperAuthError(
                f"cannot write to {where}: the Hub says it does not exist for this token; check the repo id and "
                f"that the token has write access to the '{repo_id.split('/')[0]}' namespace"
            ) from exc
        raise MapperNotFoundError(
            f"{where} was not found on the Hub ({endpoint}): check the repo id for typos; if the repo is private, "
            f"{login} with an account that can read it"
        ) from exc
    except RevisionNotFoundError as exc:
        raise MapperRevisionNotFoundError(
            f"revision '{revision}' does not exist in Hub repo '{repo_id}'{_refs_hint(repo_id, token)}: pass an "
            f"existing branch, tag or commit hash (list them with HfApi().list_repo_refs('{repo_id}'))"
        ) from exc
    except LocalEntryNotFoundError as exc:  # nothing usable in the cache, and the Hub was not asked or not reached
        http_error = next((e for e in _causes(exc) if isinstance(e, HfHubHTTPError)), None)
        if offline or any(isinstance(e, OfflineModeIsEnabled) for e in _causes(exc)):
            partial = " completely" if isinstance(exc, IncompleteSnapshotError) else ""
            raise MapperOfflineError(
                f"{where} is not{partial} in the local cache and offline mode is on (local_files_only=True or "
                "HF_HUB_OFFLINE=1): download it once with network access, or pass a local mapper directory"
            ) from exc
        if http_error is not None:
            status = http_error.response.status_code if http_error.response is not None else "?"
            raise MapperHubError(
                f"the Hub ({endpoint}) answered HTTP {status} for {where} and it is not in the local cache: "
                f"try again later ({_one_line(http_error.server_message or '')})"
            ) from exc
        raise MapperOfflineError(
            f"could not reach the Hub at {endpoint} to fetch {where}, and it is not in the local cache: check your "
            f"network connection (or HF_ENDPOINT); {cache_hint}"
        ) from exc
    except EntryNotFoundError as exc:
        raise NotAMapperError(
            f"{where} lacks a file a mapper needs ({CONFIG_NAME} and {WEIGHTS_NAME}): it is not a hf-kvtransfer "
            "mapper repo"
        ) from exc
    except HFValidationError as exc:
        raise MapperNotFoundError(
            f"'{repo_id}' is neither a local directory nor a valid Hub repo id ('namespace/name'): {_one_line(exc)}"
        ) from exc
    except OfflineModeIsEnabled as exc:
        raise MapperOfflineError(f"cannot reach {where}: offline mode is on (HF_HUB_OFFLINE=1); unset it") from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        detail = _one_line(exc.server_message or exc)
        if status in (401, 403):
            action = "write to" if pushing else "read"
            raise MapperAuthError(
                f"the Hub refused the token to {action} {where} (HTTP {status}: {detail}): check that the token is "
                f"valid and has {'write' if pushing else 'read'} access, then {login}"
            ) from exc
        if isinstance(exc, BadRequestError):
            raise MapperHubError(f"the Hub rejected the request for {where}: {detail}") from exc
        raise MapperHubError(
            f"the Hub ({endpoint}) answered HTTP {status} for {where}: {detail}; try again later"
        ) from exc
    except ValueError as exc:
        if pushing and str(exc).startswith("Invalid metadata in README.md"):
            raise MapperHubError(
                f"the Hub rejected the model card metadata of {where}: {_one_line(exc)}; fix README.md"
            ) from exc
        raise
    except _transport_errors() as exc:
        action = f"push to {where}" if pushing else f"fetch {where}"
        raise MapperOfflineError(
            f"could not reach the Hub at {endpoint} to {action} ({type(exc).__name__}): check your network "
            f"connection (or HF_ENDPOINT)" + ("" if pushing else f"; {cache_hint}")
        ) from exc


# -- model card --------------------------------------------------------------------------------------------------


def render_model_card(
    config: dict, repo_id: str | None = None, report: dict | None = None, checkpoint: dict | None = None
) -> ModelCard:
    """Render a mapper's model card from `hub_cards/mapper_card.md`, its `config.json` contents and its run report.

    Metadata: `library_name: hf-kvtransfer`, tags (`kv-cache`, `kv-cache-transfer`, the model families),
    `base_model` = [source, target] with `base_model_relation: adapter` (a mapper is used together with both
    models, and the Hub would read two base models as a merge otherwise), the calibration dataset when it is a Hub
    id, and the license. Missing optional fields are skipped.

    Args:
        config: the mapper config as a dict (what `config.json` holds).
        repo_id: the Hub repo the card is for; used in the usage snippet.
        report: the run report (`fit_report.json`: `eval_results`, `model_selection`, ...), when there is one.
        checkpoint: `checkpoint.checkpoint_info(folder)` of the saved weights (files, total size), when known.

    Returns:
        `huggingface_hub.ModelCard`; `.save("README.md")` writes it.

    Example:
        ```python
        >>> card = render_model_card(json.load(open("mapper/config.json")), "my-org/qwen3-14b-to-qwen3-32b")
        >>> card.data.base_model
        ['Qwen/Qwen3-14B', 'Qwen/Qwen3-32B']
        ```
    """
    source_id, target_id = config.get("source_model_id"), config.get("target_model_id")
    source_fp, target_fp = config.get("source_fingerprint") or {}, config.get("target_fingerprint") or {}
    calibration = config.get("calibration") or {}
    base_models = list(dict.fromkeys(m for m in (source_id, target_id) if _is_hub_id(m)))
    dataset = calibration.get("dataset")
    families = [fp.get("model_type") for fp in (source_fp, target_fp) if isinstance(fp.get("model_type"), str)]
    card_data = ModelCardData(
        library_name=LIBRARY_NAME,
        license=config.get("license") or DEFAULT_LICENSE,
        tags=["kv-cache", "kv-cache-transfer", *families],
        base_model=base_models or None,
        base_model_relation="adapter" if base_models else None,
        datasets=[dataset] if _is_hub_id(dataset) and not _is_data_file(dataset) else None,
    )
    return ModelCard.from_template(
        card_data,
        template_str=_template_text(),
        repo_ref=repo_id or "path/to/this/mapper",
        repo_id=repo_id,
        title=_title(config),
        mapper_type=config.get("mapper_type", "ridge"),
        source=_model_facts(source_id, config.get("source_revision"), source_fp, "SOURCE_MODEL_ID"),
        target=_model_facts(target_id, config.get("target_revision"), target_fp, "TARGET_MODEL_ID"),
        fit=_fit_facts(config) + _checkpoint_facts(checkpoint),
        calibration=_calibration_facts(calibration),
        layers=_layer_rows(config),
        top_k=config.get("top_k"),
        has_revisions=bool(config.get("source_revision") or config.get("target_revision")),
        has_heldout=bool(config.get("heldout_r2_key") or config.get("heldout_r2_value")),
        r2_summary=_r2_summary(config),
        eval_rows=_eval_rows((report or {}).get("eval_results")),
        selection=_selection_facts((report or {}).get("model_selection")),
        library_version=config.get("library_version"),
        paper_url=PAPER_URL,
    )


def _template_text() -> str:
    try:  # installed (wheel or editable): shipped as the package data of hf_kvtransfer.hub_cards
        return resources.files("hf_kvtransfer.hub_cards").joinpath(CARD_TEMPLATE).read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        # a source checkout on sys.path without installation: the canonical copy is <repo>/hub_cards/
        return (Path(__file__).resolve().parent.parent / "hub_cards" / CARD_TEMPLATE).read_text(encoding="utf-8")


def _is_hub_id(value: Any) -> bool:
    return (
        isinstance(value, str)
        and bool(_HUB_ID.match(value))
        and "--" not in value
        and ".." not in value
        and not os.path.exists(value)
    )


def _is_data_file(value: str) -> bool:
    return Path(value).suffix.lower() in _DATA_FILE_SUFFIXES


def _title(config: dict) -> str:
    names = []
    for role in ("source", "target"):
        model_id = config.get(f"{role}_model_id")
        fingerprint = config.get(f"{role}_fingerprint") or {}
        names.append(model_id.rstrip("/").rsplit("/", 1)[-1] if model_id else fingerprint.get("model_type") or role)
    return f"KV-cache mapper {names[0]} → {names[1]}"


def _cell(value: Any) -> str:
    """A Markdown table cell: `-` for missing values, pipes escaped."""
    if value is None or value == "":
        return "–"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _number(value: Any, digits: int = 4) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _cell(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}" if 1e-3 <= abs(value) < 1e5 or value == 0 else f"{value:.3g}"


def _plain(value: Any) -> str:
    """Hyper-parameters as written: 1000000.0 -> 1,000,000; 0.001 -> 0.001; lists and strings unchanged."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return f"{value:g}" if isinstance(value, float) else _cell(value)


def _model_facts(model_id: str | None, revision: str | None, fingerprint: dict, placeholder: str) -> dict[str, str]:
    rope = fingerprint.get("rope_parameters") or {}
    rope_text = None
    if isinstance(rope, dict) and rope:
        rope_text = str(rope.get("rope_type", "default"))
        for key, label in (("rope_theta", "theta"), ("factor", "factor")):
            if rope.get(key) is not None:
                rope_text += f", {label}={_plain(rope[key])}"
    if fingerprint.get("partial_rotary_factor") not in (None, 1, 1.0):
        rope_text = f"{rope_text or 'default'}, partial={fingerprint['partial_rotary_factor']}"
    link = f"[{model_id}](https://huggingface.co/{model_id})" if _is_hub_id(model_id) else _cell(model_id)
    return {
        "id": model_id or placeholder,
        "link": link,
        "revision": _cell(revision),
        "revision_arg": f', revision="{revision}"' if revision else "",
        "model_type": _cell(fingerprint.get("model_type")),
        "layers": _cell(fingerprint.get("num_hidden_layers")),
        "kv_heads": _cell(fingerprint.get("num_key_value_heads")),
        "head_dim": _cell(fingerprint.get("head_dim")),
        "vocab_size": _cell(fingerprint.get("vocab_size")),
        "rope": _cell(rope_text),
    }


def _fit_facts(config: dict) -> list[tuple[str, str]]:
    facts = [("Mapper type", _cell(config.get("mapper_type", "ridge")))]
    if config.get("top_k") is not None:
        facts.append(("Source layers per target layer (k)", _number(config["top_k"])))
    if config.get("ridge_lambda") is not None and config.get("mapper_type", "ridge") in ("ridge", "lowrank"):
        facts.append(("Ridge lambda (on centered data)", _plain(config["ridge_lambda"])))
    for key, value in (config.get("mlp") or {}).items():
        facts.append((f"MLP {key.replace('_', ' ')}", _plain(value)))
    if config.get("rank"):
        ranks = ", ".join(f"{k}/{v}" for k, v in config["rank"])
        facts.append(("Reduced rank (key/value per target layer)", ranks))
    if config.get("num_parameters") is not None:
        facts.append(("Parameters", _number(config["num_parameters"])))
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}.get(config.get("dtype") or "")
    if itemsize and config.get("num_parameters") is not None:
        facts.append(("Weights", f"{config['dtype']}, {config['num_parameters'] * itemsize / 2**20:.2f} MiB"))
    return facts


def _checkpoint_facts(checkpoint: dict | None) -> list[tuple[str, str]]:
    if not checkpoint or not checkpoint.get("files"):
        return []
    files = checkpoint["files"]
    shards = checkpoint.get("num_shards") or 0
    layout = f"{shards} safetensors shards + index" if shards else ", ".join(files)
    return [("Checkpoint", f"{checkpoint['total_size'] / 2**20:,.2f} MiB ({checkpoint['total_size']:,} bytes) in {layout}")]


def _calibration_facts(calibration: dict) -> list[tuple[str, str]]:
    labels = {
        "dataset": "Dataset", "config": "Config", "split": "Split", "text_field": "Text field",
        "num_sequences": "Sequences", "seq_len": "Tokens per sequence",
        "stride": "Token stride (every n-th token used)", "num_tokens": "Tokens used for the fit",
    }  # fmt: skip
    facts = []
    for key, label in labels.items():
        value = calibration.get(key)
        if value is None:
            continue
        if key == "dataset" and _is_hub_id(value) and not _is_data_file(value):
            value = f"[{value}](https://huggingface.co/datasets/{value})"
        facts.append((label, _number(value) if key != "dataset" else str(value)))
    facts.extend((key.replace("_", " ").capitalize(), _cell(v)) for key, v in calibration.items() if key not in labels)
    return facts


def _at(values: Any, i: int) -> str:
    return _number(values[i]) if isinstance(values, list) and i < len(values) else "–"


def _layer_rows(config: dict) -> list[dict[str, str]]:
    rows = []
    for t, sources in enumerate(config.get("selected_layers") or []):
        rows.append({
            "target": str(t),
            "sources": ", ".join(str(s) for s in sources) if isinstance(sources, list) else _cell(sources),
            "r2_key": _at(config.get("fit_r2_key"), t),
            "r2_value": _at(config.get("fit_r2_value"), t),
            "heldout_key": _at(config.get("heldout_r2_key"), t),
            "heldout_value": _at(config.get("heldout_r2_value"), t),
        })  # fmt: skip
    return rows


def _r2_summary(config: dict) -> str | None:
    parts = []
    for key, label in (("fit_r2_key", "fit R² K"), ("fit_r2_value", "fit R² V"),
                       ("heldout_r2_key", "held-out R² K"), ("heldout_r2_value", "held-out R² V")):  # fmt: skip
        values = [v for v in config.get(key) or [] if isinstance(v, (int, float)) and math.isfinite(v)]
        if values:
            parts.append(f"mean {label} = {sum(values) / len(values):.4f} (min {min(values):.4f})")
    return "; ".join(parts) or None


def _selection_facts(selection: Any) -> list[tuple[str, str]]:
    """How k / lambda were chosen (from the run report), as card lines."""
    if not isinstance(selection, dict):
        return []
    facts = []
    if selection.get("metric"):
        facts.append(("Metric", _cell(selection["metric"])))
    for key, label in (("top_k_candidates", "k candidates"), ("ridge_lambda_candidates", "Lambda candidates")):
        if selection.get(key):
            facts.append((label, ", ".join(_plain(v) for v in selection[key])))
    for choice in selection.get("chosen") or []:
        if isinstance(choice, dict):
            facts.append(("Chosen", f"k = {_plain(choice.get('top_k'))}, lambda = {_plain(choice.get('ridge_lambda'))}"))
    if selection.get("heldout_tokens") is not None:
        facts.append(("Held-out tokens", _number(selection["heldout_tokens"])))
    return facts


def _eval_rows(results: Any) -> list[tuple[str, str]]:
    if not isinstance(results, dict):
        return []
    rows = []
    for name, value in results.items():
        if isinstance(value, dict):
            rows.extend((f"{name} / {k}", _number(v)) for k, v in value.items())
        else:
            rows.append((str(name), _number(value)))
    return [(_cell(name), value) for name, value in rows]


def _library_version() -> str:
    return __version__
