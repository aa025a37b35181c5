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
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, constants, get_token, snapshot_download
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

from .checkpoint import INDEX_NAME, WEIGHT_PATTERNS, WEIGHTS_NAME, checkpoint_info, has_weights, weight_files

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

from ..version import __version__
from .card import HUB_ID, LIBRARY_NAME, render_model_card

logger = logging.getLogger(__name__)

# The files of a mapper directory (= a Hub repo).
CONFIG_NAME = "config.json"
CARD_NAME = "README.md"
# The run report (model selection curves, training logs, timings, evaluation): read by the model card, never
# needed to load or apply the mapper.
REPORT_NAME = "fit_report.json"
MAPPER_FILES = (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME)
_REQUIRED_CONFIG_KEYS = ("mapper_type", "selected_layers")
_COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")


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
    local = _local_mapper_dir(name, revision)
    if local is not None:
        return local
    repo_id = name
    offline = local_files_only or _offline_mode()
    download = dict(
        repo_id=repo_id,
        cache_dir=cache_dir,
        token=token,
        local_files_only=offline,
        force_download=force_download,
        library_name=LIBRARY_NAME,
        library_version=__version__,
    )
    try:
        with _hub_errors(repo_id, revision, token=token, offline=offline):
            snapshot, hint = _download_mapper(download, revision)
    except (MapperNotFoundError, MapperOfflineError) as exc:
        # Not on the Hub (or no Hub): the name was perhaps a local path with a typo; say that there is none either.
        raise type(exc)(f"{missing_local_path_message(name, bare=True)}, and {exc}") from exc.__cause__
    _check_mapper_folder(snapshot, _describe(repo_id, revision), hint)
    return snapshot


def _local_mapper_dir(name: str, revision: str | None) -> Path | None:
    """`name` as a local mapper directory (checked), None when it is a Hub repo id; raises when it is a file or a
    path that does not exist."""
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
    return None


def _download_mapper(download: dict[str, Any], revision: str | None) -> tuple[Path, Callable[[], str]]:
    """The snapshot of a mapper repo (`snapshot_download` keywords `download`), its config checked before the
    weights are fetched, and the hint on what the repo holds for the messages of a folder that is no mapper."""
    repo_id, cache_dir = download["repo_id"], download["cache_dir"]
    # config.json alone first: a mistyped id that names a model must not start a multi-GB download.
    snapshot = Path(snapshot_download(revision=revision, allow_patterns=[CONFIG_NAME], **download))
    hint = lambda: _repo_files_hint(repo_id, snapshot.name, cache_dir)  # noqa: E731
    _check_mapper_config(snapshot / CONFIG_NAME, _describe(repo_id, revision), hint)
    # The rest from the commit the config came from (a push in between cannot pair it with other weights).
    pinned = snapshot.name if _COMMIT_HASH.match(snapshot.name) else revision
    # Weights: model.safetensors, or the shard index and every shard (checkpoint.WEIGHT_PATTERNS).
    patterns = [*WEIGHT_PATTERNS, CARD_NAME, REPORT_NAME]
    snapshot = Path(snapshot_download(revision=pinned, allow_patterns=patterns, **download))
    return snapshot, hint


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
    explicit (./x, ../x, /x, ~/x), has a `.`/`..` segment or more than one `/`. Any other `org/name` is a Hub repo
    id, even next to a local `org/` folder (models downloaded under `./Qwen/...`); when the Hub does not have it
    either, the error says that no such local directory exists."""
    parts = name.replace("\\", "/").split("/")
    return (
        os.path.isabs(name)
        or name.startswith(("./", "../", "~", ".\\", "..\\"))
        or any(p in (".", "..") for p in parts)
        or name.count("/") > 1
        or "\\" in name
    )


def missing_local_path_message(name: str, what: str = "local directory", bare: bool = False) -> str:
    """"local directory X does not exist" and, when its parent exists, what that parent holds (`bare`: without the
    advice that follows, for a message that goes on)."""
    parent = Path(name).expanduser().parent
    message = f"{what} {name} does not exist"
    if str(parent) not in ("", ".") and parent.is_dir():
        entries = sorted(p.name for p in parent.iterdir() if not p.name.startswith("."))
        shown = ", ".join(entries[:8]) + (", ..." if len(entries) > 8 else "")
        message += f" ({parent} holds: {shown or 'nothing'})"
    if bare:
        return message
    if not HUB_ID.match(name):
        return message + " and it is not a valid Hub repo id either (org/name); check the path"
    return message + "; check the path (a Hub repo id looks like org/name)"


def is_missing_local_path(name: str | os.PathLike) -> bool:
    """A name meant as a local path (see `_looks_like_path`) where nothing exists: report it, never ask the Hub."""
    name = os.fspath(name)
    return not Path(name).expanduser().exists() and (_looks_like_path(name) or not HUB_ID.match(name))


def is_offline_mode() -> bool:
    """Offline mode as huggingface_hub means it, read when called (`HF_HUB_OFFLINE` set after import counts too)."""
    return _offline_mode()


def is_transport_error(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a connection-level failure: the Hub could not be reached."""
    return any(isinstance(e, _transport_errors()) for e in _causes(exc))


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
    operations, weights = _upload_operations(folder, config, repo_id)
    api = HfApi(token=write_token, library_name=LIBRARY_NAME, library_version=__version__)
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


def _upload_operations(folder: Path, config: dict, repo_id: str) -> tuple[list[CommitOperationAdd], list[str]]:
    """The files a push adds (config, weights, the model card, rendered when the folder has none, and the run
    report if any), and the names of the weight files among them."""
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
    return operations, weights


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


_LOGIN = "pass token= or run `hf auth login`"
_CACHE_HINT = "once downloaded, a mapper loads offline with local_files_only=True or HF_HUB_OFFLINE=1"


@dataclass(frozen=True)
class _HubCall:
    """What an error's message names: the repo (`where`: with its revision), the Hub endpoint, and what the call
    was doing (reading offline, pushing)."""

    repo_id: str
    revision: str | None
    token: Any
    offline: bool
    pushing: bool
    where: str
    endpoint: str


@contextmanager
def _hub_errors(repo_id: str, revision: str | None, *, token=None, offline: bool = False, pushing: bool = False):
    """Re-raise huggingface_hub errors as MapperHubError subclasses with a one-line, actionable message."""
    call = _HubCall(repo_id, revision, token, offline, pushing, _describe(repo_id, revision), constants.ENDPOINT)
    try:
        yield
    except MapperHubError:
        raise
    except Exception as exc:
        error = _translated(exc, call)
        if error is None:
            raise
        raise error from exc


def _translated(exc: Exception, call: _HubCall) -> MapperHubError | None:
    """`exc` as the MapperHubError that says what to do (None: not a Hub error; it is re-raised as is)."""
    where, repo_id = call.where, call.repo_id
    if isinstance(exc, (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError)):
        return _repo_error(exc, call)
    # Nothing usable in the cache, and the Hub was not asked or not reached.
    if isinstance(exc, LocalEntryNotFoundError):
        return _cache_miss_error(exc, call)
    if isinstance(exc, EntryNotFoundError):
        return NotAMapperError(
            f"{where} lacks a file a mapper needs ({CONFIG_NAME} and {WEIGHTS_NAME}): it is not a hf-kvtransfer "
            "mapper repo"
        )
    if isinstance(exc, HFValidationError):
        return MapperNotFoundError(
            f"'{repo_id}' is neither a local directory nor a valid Hub repo id ('namespace/name'): {_one_line(exc)}"
        )
    if isinstance(exc, OfflineModeIsEnabled):
        return MapperOfflineError(f"cannot reach {where}: offline mode is on (HF_HUB_OFFLINE=1); unset it")
    if isinstance(exc, HfHubHTTPError):
        return _http_error(exc, call)
    if isinstance(exc, ValueError):
        if call.pushing and str(exc).startswith("Invalid metadata in README.md"):
            return MapperHubError(
                f"the Hub rejected the model card metadata of {where}: {_one_line(exc)}; fix README.md"
            )
        return None
    if isinstance(exc, _transport_errors()):
        action = f"push to {where}" if call.pushing else f"fetch {where}"
        return MapperOfflineError(
            f"could not reach the Hub at {call.endpoint} to {action} ({type(exc).__name__}): check your network "
            f"connection (or HF_ENDPOINT)" + ("" if call.pushing else f"; {_CACHE_HINT}")
        )
    return None


def _repo_error(exc: HfHubHTTPError, call: _HubCall) -> MapperHubError:
    """A gated repo, a repo that does not exist (for this token), or a revision that does not exist in it."""
    where, repo_id = call.where, call.repo_id
    if isinstance(exc, GatedRepoError):
        return MapperGatedError(
            f"{where} is gated: accept its conditions at {call.endpoint}/{repo_id} while logged in, then {_LOGIN}"
        )
    if isinstance(exc, RepositoryNotFoundError):
        if call.pushing:
            return MapperAuthError(
                f"cannot write to {where}: the Hub says it does not exist for this token; check the repo id and "
                f"that the token has write access to the '{repo_id.split('/')[0]}' namespace"
            )
        return MapperNotFoundError(
            f"{where} was not found on the Hub ({call.endpoint}): check the repo id for typos; if the repo is private, "
            f"{_LOGIN} with an account that can read it"
        )
    return MapperRevisionNotFoundError(
        f"revision '{call.revision}' does not exist in Hub repo '{repo_id}'{_refs_hint(repo_id, call.token)}: pass an "
        f"existing branch, tag or commit hash (list them with HfApi().list_repo_refs('{repo_id}'))"
    )


def _cache_miss_error(exc: LocalEntryNotFoundError, call: _HubCall) -> MapperHubError:
    """Not in the cache: offline mode on, the Hub answering an HTTP error, or the Hub not reached."""
    http_error = next((e for e in _causes(exc) if isinstance(e, HfHubHTTPError)), None)
    if call.offline or any(isinstance(e, OfflineModeIsEnabled) for e in _causes(exc)):
        partial = " completely" if isinstance(exc, IncompleteSnapshotError) else ""
        return MapperOfflineError(
            f"{call.where} is not{partial} in the local cache and offline mode is on (local_files_only=True or "
            "HF_HUB_OFFLINE=1): download it once with network access, or pass a local mapper directory"
        )
    if http_error is not None:
        status = http_error.response.status_code if http_error.response is not None else "?"
        return MapperHubError(
            f"the Hub ({call.endpoint}) answered HTTP {status} for {call.where} and it is not in the local cache: "
            f"try again later ({_one_line(http_error.server_message or '')})"
        )
    return MapperOfflineError(
        f"could not reach the Hub at {call.endpoint} to fetch {call.where}, and it is not in the local cache: check "
        f"your network connection (or HF_ENDPOINT); {_CACHE_HINT}"
    )


def _http_error(exc: HfHubHTTPError, call: _HubCall) -> MapperHubError:
    """Any other HTTP error: the token refused (401, 403), a bad request, or the Hub failing."""
    status = exc.response.status_code if exc.response is not None else None
    detail = _one_line(exc.server_message or exc)
    if status in (401, 403):
        action = "write to" if call.pushing else "read"
        return MapperAuthError(
            f"the Hub refused the token to {action} {call.where} (HTTP {status}: {detail}): check that the token is "
            f"valid and has {'write' if call.pushing else 'read'} access, then {_LOGIN}"
        )
    if isinstance(exc, BadRequestError):
        return MapperHubError(f"the Hub rejected the request for {call.where}: {detail}")
    return MapperHubError(
        f"the Hub ({call.endpoint}) answered HTTP {status} for {call.where}: {detail}; try again later"
    )
