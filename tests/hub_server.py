"""A local, in-memory Hugging Face Hub for tests: the part of the Hub HTTP API that huggingface_hub 2.x calls.

Model repos only. What is real here: commits (40-hex oids, parents, a file table per commit, so an older revision
serves older content), branches, tags and pull-request refs (``refs/pr/N``); regular files (base64 in the NDJSON
commit) and LFS files (batch API, a signed ``PUT`` with a sha256 check, downloads redirected to a "CDN" on another
origin, as on huggingface.co, so the client drops its Authorization header there); private and gated repos; write
tokens vs read tokens; README.md metadata validation (``/api/validate-yaml`` and on commit). Errors carry the Hub's
``X-Error-Code`` / ``X-Error-Message`` headers, so huggingface_hub raises its real exception classes.

    server = HubServer().start()       # http://127.0.0.1:<free port>
    ...                                # point huggingface_hub at server.url: see tests/hub_fixtures.py
    server.stop()                      # the port closes: from then on the Hub is unreachable ("network down")

Only the Python standard library (+ PyYAML, a huggingface_hub dependency) is used.
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import hashlib
import hmac
import itertools
import json
import re
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

import yaml

# Tokens the server knows. Anything else in `Authorization: Bearer ...` is rejected as the Hub does.
WRITE_TOKEN = "hf_kvtest_write_0123456789abcdef"
READ_TOKEN = "hf_kvtest_read_0123456789abcdef"
OTHER_USER_TOKEN = "hf_kvtest_stranger_0123456789ab"
USER = "kvtester"
ORG = "kvorg"
OTHER_USER = "stranger"

_TOKENS = {
    WRITE_TOKEN: {"user": USER, "orgs": [ORG], "role": "write"},
    READ_TOKEN: {"user": USER, "orgs": [ORG], "role": "read"},
    OTHER_USER_TOKEN: {"user": OTHER_USER, "orgs": [], "role": "write"},
}

MAX_REGULAR_FILE_SIZE = 10 * 1024 * 1024  # the Hub rejects larger non-LFS files
_REGEX_YAML_BLOCK = re.compile(r"^(\s*---(?:\r\n|\r|\n))([\S\s]*?)((?:\r\n|\r|\n)---[ \t]*(\r\n|\n|$))")
_REPO_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_COMMIT_OID = re.compile(r"^[0-9a-f]{40}$")

# The .gitattributes the Hub writes in a new model repo (abridged): these paths are stored with LFS.
DEFAULT_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in (
        "*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib", "*.lfs.*",
        "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb",
        "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors", "saved_model/**/*", "*.tar.*",
        "*.tar", "*.tflite", "*.tgz", "*.wasm", "*.xz", "*.zip", "*.zst", "*tfevents*",
    )
)  # fmt: skip

# License ids the Hub accepts in card metadata (https://huggingface.co/docs/hub/repositories-licenses).
HUB_LICENSES = frozenset(
    """apache-2.0 mit openrail bigscience-openrail-m creativeml-openrail-m bigscience-bloom-rail-1.0
    bigcode-openrail-m afl-3.0 artistic-2.0 bsl-1.0 bsd bsd-2-clause bsd-3-clause bsd-3-clause-clear c-uda cc
    cc0-1.0 cc-by-2.0 cc-by-2.5 cc-by-3.0 cc-by-4.0 cc-by-sa-3.0 cc-by-sa-4.0 cc-by-nc-2.0 cc-by-nc-3.0
    cc-by-nc-4.0 cc-by-nd-4.0 cc-by-nc-nd-3.0 cc-by-nc-nd-4.0 cc-by-nc-sa-2.0 cc-by-nc-sa-3.0 cc-by-nc-sa-4.0
    cdla-sharing-1.0 cdla-permissive-1.0 cdla-permissive-2.0 wtfpl ecl-2.0 epl-1.0 epl-2.0 etalab-2.0 eupl-1.1
    eupl-1.2 agpl-3.0 gfdl gpl gpl-2.0 gpl-3.0 lgpl lgpl-2.1 lgpl-3.0 isc h-research intel-research lppl-1.3c
    ms-pl apple-ascl apple-amlr mpl-2.0 odc-by odbl openrail++ osl-3.0 postgresql ofl-1.1 ncsa unlicense zlib
    pddl lgpl-lr deepfloyd-if-license fair-noncommercial-research-license llama2 llama3 llama3.1 llama3.2
    llama3.3 llama4 gemma unknown other""".split()
)
BASE_MODEL_RELATIONS = ("adapter", "merge", "quantized", "finetune")


def git_blob_oid(data: bytes) -> str:
    """The git object id of a blob: sha1 over a `blob <size>\\0` header and the content."""
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def parse_card_metadata(content: str) -> tuple[dict | None, str | None]:
    """(metadata, error) of a README.md: metadata is None when the card has no YAML block."""
    match = _REGEX_YAML_BLOCK.search(content)
    if match is None:
        return None, None
    try:
        data = yaml.safe_load(match.group(2))
    except yaml.YAMLError as exc:
        return None, f"Error parsing YAML metadata: {_one_line(exc)}"
    if data is None:
        return {}, None
    if not isinstance(data, dict):
        return None, "YAML metadata must be a dictionary (key: value pairs)"
    return data, None


def validate_card_metadata(content: str) -> tuple[list[str], list[str]]:
    """(errors, warnings) for a model card, the checks of the Hub's `/api/validate-yaml` that matter here."""
    data, error = parse_card_metadata(content)
    if error is not None:
        return [error], []
    if not data:
        return [], ["Empty or missing yaml metadata in repo card"]
    errors: list[str] = []
    warnings: list[str] = []

    def check_ids(key: str, kind: str) -> None:
        if key not in data:
            return
        value = data[key]
        values = [value] if isinstance(value, str) else value
        if not _is_str_list(values):
            errors.append(f'"{key}" must be a string or a list of strings')
            return
        for v in values:
            if not _REPO_ID.match(v) or "--" in v or ".." in v:
                errors.append(f'"{key}" must contain valid {kind} ids ("namespace/name"), got "{v}"')

    if "tags" in data and not _is_str_list(data["tags"]):
        errors.append('"tags" must be an array of strings')
    check_ids("base_model", "model")
    check_ids("datasets", "dataset")
    if "base_model_relation" in data:
        if data["base_model_relation"] not in BASE_MODEL_RELATIONS:
            errors.append(f'"base_model_relation" must be one of {list(BASE_MODEL_RELATIONS)}')
        elif "base_model" not in data:
            errors.append('"base_model_relation" requires "base_model"')
    if "license" in data:
        lic = data["license"]
        if not isinstance(lic, str) or lic not in HUB_LICENSES:
            errors.append(f'"license" must be one of the Hub license ids (or "other"), got {lic!r}')
        elif lic == "other" and not ("license_name" in data and "license_link" in data):
            warnings.append('"license: other" should come with "license_name" and "license_link"')
    for key in ("library_name", "pipeline_tag", "license_name", "license_link", "model_name"):
        if key in data and not isinstance(data[key], str):
            errors.append(f'"{key}" must be a string')
    for key in ("language", "metrics"):
        if key in data and not (isinstance(data[key], str) or _is_str_list(data[key])):
            errors.append(f'"{key}" must be a string or a list of strings')
    if "model-index" in data:
        errors.extend(_validate_model_index(data["model-index"]))
    return errors, warnings


def _validate_model_index(index: Any) -> list[str]:
    if not isinstance(index, list):
        return ['"model-index" must be a list']
    for entry in index:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            return ['"model-index" entries need a "name"']
        for result in entry.get("results") or []:
            if not isinstance(result, dict) or not isinstance(result.get("task"), dict):
                return ['"model-index[].results[]" needs a "task" with a "type"']
            if not isinstance(result["task"].get("type"), str):
                return ['"model-index[].results[].task.type" must be a string']
            dataset = result.get("dataset")
            if not isinstance(dataset, dict) or not all(isinstance(dataset.get(k), str) for k in ("name", "type")):
                return ['"model-index[].results[].dataset" needs a "name" and a "type"']
            metrics = result.get("metrics")
            if not isinstance(metrics, list) or not all(
                isinstance(m, dict) and isinstance(m.get("type"), str) and "value" in m for m in metrics
            ):
                return ['"model-index[].results[].metrics" must be a list of {type, value}']
    return []


# -- storage -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredFile:
    path: str
    size: int
    blob_oid: str  # git blob id: of the content (regular) or of the LFS pointer
    lfs_sha256: str | None = None
    content: bytes | None = None  # regular files only; LFS bytes live in HubState.lfs_store

    @property
    def pointer_size(self) -> int:
        return len(lfs_pointer(self.lfs_sha256, self.size)) if self.lfs_sha256 else 0


@dataclass
class Commit:
    oid: str
    parents: tuple[str, ...]
    files: dict[str, StoredFile]
    title: str
    message: str
    author: str
    date: str


@dataclass
class Repo:
    repo_id: str
    private: bool
    created_at: str
    gated: str | bool = False  # False, "auto" or "manual"
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    prs: dict[int, str] = field(default_factory=dict)
    lfs_oids: set[str] = field(default_factory=set)
    granted_users: set[str] = field(default_factory=set)  # users accepted on a gated repo

    @property
    def namespace(self) -> str:
        return self.repo_id.split("/")[0]

    def resolve(self, revision: str | None) -> str | None:
        """Commit oid of a branch, tag, refs/... name or full commit id; None if it does not exist."""
        rev = revision or "main"
        for prefix, table in (("refs/heads/", self.branches), ("refs/tags/", self.tags)):
            if rev.startswith(prefix) and rev[len(prefix) :] in table:
                return table[rev[len(prefix) :]]
        if rev in self.branches:
            return self.branches[rev]
        if rev in self.tags:
            return self.tags[rev]
        match = re.fullmatch(r"refs/pr/(\d+)", rev)
        if match and int(match[1]) in self.prs:
            return self.prs[int(match[1])]
        if _COMMIT_OID.match(rev) and rev in self.commits:
            return rev
        return None

    def writable_ref(self, revision: str | None) -> tuple[str, Any] | None:
        """("branch", name) or ("pr", number) a commit can move; None for tags, commit ids and unknown names."""
        rev = revision or "main"
        if rev.startswith("refs/heads/"):
            rev = rev[len("refs/heads/") :]
        if rev in self.branches:
            return ("branch", rev)
        match = re.fullmatch(r"refs/pr/(\d+)", rev)
        if match and int(match[1]) in self.prs:
            return ("pr", int(match[1]))
        return None


class HubState:
    """All repos and LFS objects. Every access goes through `lock`."""

    def __init__(self):
        self.lock = threading.RLock()
        self.repos: dict[str, Repo] = {}
        self.lfs_store: dict[str, bytes] = {}  # sha256 -> content
        self._counter = itertools.count()

    def new_commit(self, repo: Repo, parent: str | None, files: dict[str, StoredFile], title: str,
                   message: str, author: str) -> Commit:  # fmt: skip
        seed = json.dumps([repo.repo_id, parent, sorted((p, f.blob_oid) for p, f in files.items()), title,
                           message, time.time_ns(), next(self._counter)])  # fmt: skip
        commit = Commit(
            oid=hashlib.sha1(seed.encode()).hexdigest(),
            parents=(parent,) if parent else (),
            files=files,
            title=title,
            message=message,
            author=author,
            date=_now(),
        )
        repo.commits[commit.oid] = commit
        return commit

    def create_repo(self, repo_id: str, *, private: bool = False, author: str = USER) -> Repo:
        with self.lock:
            repo = Repo(repo_id=repo_id, private=private, created_at=_now())
            content = DEFAULT_GITATTRIBUTES.encode()
            files = {".gitattributes": StoredFile(".gitattributes", len(content), git_blob_oid(content), None, content)}
            commit = self.new_commit(repo, None, files, "initial commit", "", author)
            repo.branches["main"] = commit.oid
            self.repos[repo_id] = repo
            return repo


# -- HTTP ----------------------------------------------------------------------------------------------------------


class _Reply(Exception):
    """Raised by route handlers to answer an error: the Hub's status, X-Error-Code and message."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


def _lfs_patterns(files: dict[str, StoredFile]) -> list[str]:
    attrs = files.get(".gitattributes")
    if attrs is None or attrs.content is None:
        return []
    return [line.split()[0] for line in attrs.content.decode(errors="replace").splitlines()
            if "filter=lfs" in line and line.split()]  # fmt: skip


def _matches(path: str, patterns: list[str]) -> bool:
    name = path.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(path if "/" in pattern else name, pattern) for pattern in patterns)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's pooled client expects
    disable_nagle_algorithm = True  # headers and body go out in two writes: Nagle + delayed ACK = 40 ms each
    timeout = 900  # an idle keep-alive connection's socket: a hang guard, not a limit a loaded machine reaches
    server: _Server

    # -- plumbing ------------------------------------------------------------------------------------------------
    def log_message(self, format: str, *args: Any) -> None:  # silence stderr; requests are logged in `hub.requests`
        pass

    def do_GET(self):
        self._handle("GET")

    def do_HEAD(self):
        self._handle("HEAD")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")

    def do_DELETE(self):
        self._handle("DELETE")

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self, method: str) -> None:
        hub = self.server.hub
        # Read the whole body first: answering before it is consumed breaks the keep-alive connection.
        self.body = self._read_body()
        split = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        self.segments = [unquote(s) for s in split.path.split("/")[1:]]
        self.method = method
        self.user = None
        auth = self.headers.get("Authorization", "")
        with hub.state.lock:
            hub.requests.append((method, unquote(split.path), bool(auth)))
        try:
            if auth:
                token = auth[7:] if auth.lower().startswith("bearer ") else ""
                if token not in _TOKENS:
                    raise _Reply(401, "Invalid credentials in Authorization header")
                self.token_info = _TOKENS[token]
                self.user = self.token_info["user"]
            self._route()
        except _Reply as reply:
            self._error(reply)
        except Exception as exc:  # a server bug must show as a 500, not a hung client
            self._error(_Reply(500, f"test hub server error: {type(exc).__name__}: {exc}"))

    def _send(self, status: int, body: bytes | dict | list | str | None = None, headers: dict | None = None,
              content_type: str | None = None, length: int | None = None) -> None:  # fmt: skip
        if isinstance(body, (dict, list)):
            body, content_type = json.dumps(body).encode(), content_type or "application/json; charset=utf-8"
        elif isinstance(body, str):
            body, content_type = body.encode(), content_type or "text/plain; charset=utf-8"
        body = body or b""
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        for key, value in (headers or {}).items():
            self.send_header(key, str(value))
        self.end_headers()
        if self.method != "HEAD":
            self.wfile.write(body)

    def _error(self, reply: _Reply) -> None:
        headers = {"X-Error-Message": _one_line(reply.message), **reply.headers}
        if reply.code:
            headers["X-Error-Code"] = reply.code
        self._send(reply.status, {"error": reply.message}, headers)

    # -- auth helpers ------------------------------------------------------------------------------------------------
    def _repo(self, repo_id: str, *, write: bool = False) -> Repo:
        """The repo if this request may see it (and write to it); the Hub's errors otherwise."""
        hub = self.server.hub
        repo = hub.state.repos.get(repo_id)
        visible = repo is not None and (not repo.private or self._owns(repo.namespace))
        if not visible:
            # The Hub cannot tell "missing" from "private" apart for callers who may not see it.
            status = 404 if self.user else 401
            raise _Reply(status, "Repository not found", "RepoNotFound")
        if write:
            self._require_write(repo.namespace)
        return repo

    def _owns(self, namespace: str) -> bool:
        return self.user is not None and (namespace == self.user or namespace in self.token_info["orgs"])

    def _require_write(self, namespace: str) -> None:
        if self.user is None:
            raise _Reply(401, "You must be authenticated to write to the Hub: pass a token")
        if not self._owns(namespace) or self.token_info["role"] != "write":
            raise _Reply(403, f'You don\'t have the rights to write to the namespace "{namespace}" with this token')

    def _check_gate(self, repo: Repo) -> None:
        if not repo.gated or self._owns(repo.namespace) or self.user in repo.granted_users:
            return
        url = f"{self.server.hub.url}/{repo.repo_id}"
        if self.user is None:
            raise _Reply(401, f"Access to model {repo.repo_id} is restricted. You must have access to it and be "
                              "authenticated to access it. Please log in.", "GatedRepo")  # fmt: skip
        raise _Reply(403, f"Access to model {repo.repo_id} is restricted and you are not in the authorized list. "
                          f"Visit {url} to ask for access.", "GatedRepo")  # fmt: skip

    def _commit_at(self, repo: Repo, revision: str | None) -> Commit:
        oid = repo.resolve(revision)
        if oid is None:
            raise _Reply(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return repo.commits[oid]

    def _json_body(self) -> Any:
        try:
            return json.loads(self.body or b"{}")
        except ValueError as exc:
            raise _Reply(400, f"Invalid JSON body: {exc}") from exc

    # -- routing -----------------------------------------------------------------------------------------------------
    def _route(self) -> None:
        seg, method = self.segments, self.method
        hub = self.server.hub
        with hub.state.lock:
            if seg[:2] == ["api", "whoami-v2"] and method == "GET":
                return self._whoami()
            if seg[:2] == ["api", "agent-harnesses"]:
                return self._send(200, {"standardEnvVars": [], "harnesses": {}})
            if seg[:2] == ["api", "validate-yaml"] and method == "POST":
                return self._validate_yaml()
            if seg[:3] == ["api", "repos", "create"] and method == "POST":
                return self._create_repo()
            if seg[:3] == ["api", "repos", "delete"] and method == "DELETE":
                return self._delete_repo()
            if len(seg) >= 2 and seg[0] == "api" and seg[1] in ("datasets", "spaces", "kernels"):
                raise _Reply(404, "Repository not found (this test Hub serves model repos only)", "RepoNotFound")
            if len(seg) >= 4 and seg[:2] == ["api", "models"]:
                return self._model_api(f"{seg[2]}/{seg[3]}", seg[4:])
            if len(seg) == 3 and seg[:2] == ["api", "models"]:
                raise _Reply(404 if self.user else 401, "Repository not found", "RepoNotFound")
            if len(seg) >= 2 and seg[0] == "cdn-lfs":
                return self._cdn_download(seg[1])
            if len(seg) >= 2 and seg[0] == "lfs-upload" and method == "PUT":
                return self._lfs_put(seg[1])
            if len(seg) == 6 and seg[1].endswith(".git") and seg[2:5] == ["info", "lfs", "objects"]:
                repo_id = f"{seg[0]}/{seg[1][:-4]}"
                if seg[5] == "batch" and method == "POST":
                    return self._lfs_batch(repo_id)
                if seg[5] == "verify" and method == "POST":
                    return self._lfs_verify(repo_id)
            if len(seg) >= 4 and seg[2] == "resolve" and method in ("GET", "HEAD"):
                return self._resolve(f"{seg[0]}/{seg[1]}", seg[3], "/".join(seg[4:]))
            if len(seg) >= 3 and seg[1] == "resolve":  # single-segment repo ids are never created here
                raise _Reply(404 if self.user else 401, "Repository not found", "RepoNotFound")
        raise _Reply(404, f"{method} /{'/'.join(seg)} is not served by the test Hub")

    def _model_api(self, repo_id: str, rest: list[str]) -> None:
        method, action = self.method, (rest[0] if rest else None)
        if action is None and method == "GET":
            return self._model_info(repo_id, None)
        if action == "revision" and len(rest) >= 2 and method == "GET":
            return self._model_info(repo_id, rest[1])
        if action == "tree" and len(rest) >= 2 and method == "GET":
            return self._tree(repo_id, rest[1], "/".join(rest[2:]))
        if action == "refs" and method == "GET":
            return self._refs(repo_id)
        if action == "commits" and len(rest) >= 2 and method == "GET":
            return self._commits(repo_id, rest[1])
        if action == "preupload" and len(rest) >= 2 and method == "POST":
            return self._preupload(repo_id, rest[1])
        if action == "commit" and len(rest) >= 2 and method == "POST":
            return self._commit(repo_id, rest[1])
        if action == "branch" and len(rest) >= 2 and method in ("POST", "DELETE"):
            return self._branch(repo_id, rest[1])
        if action == "tag" and len(rest) >= 2 and method in ("POST", "DELETE"):
            return self._tag(repo_id, rest[1])
        if action == "settings" and method == "PUT":
            return self._settings(repo_id)
        raise _Reply(404, f"{method} /api/models/{repo_id}/{'/'.join(rest)} is not served by the test Hub")

    # -- account and repos -----------------------------------------------------------------------------------------
    def _whoami(self) -> None:
        if self.user is None:
            raise _Reply(401, "Invalid username or password.")
        info = self.token_info
        self._send(200, {
            "type": "user", "id": f"id-{info['user']}", "name": info["user"], "fullname": info["user"].title(),
            "email": f"{info['user']}@example.org", "emailVerified": True, "isPro": False,
            "orgs": [{"type": "org", "name": org, "fullname": org, "roleInOrg": "admin"} for org in info["orgs"]],
            "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": info["role"]}},
        })  # fmt: skip

    def _validate_yaml(self) -> None:
        payload = self._json_body()
        errors, warnings = validate_card_metadata(str(payload.get("content", "")))
        status = 400 if errors else 200
        if "text/plain" in self.headers.get("Accept", ""):  # what ModelCard.validate asks for
            return self._send(status, "\n".join(f"- {e}" for e in errors + warnings))
        self._send(status, {"errors": [{"message": e} for e in errors], "warnings": [{"message": w} for w in warnings]})

    def _create_repo(self) -> None:
        payload = self._json_body()
        if payload.get("type", "model") != "model":
            raise _Reply(400, "this test Hub serves model repos only")
        if self.user is None:
            raise _Reply(401, "You must be authenticated to create a repo: pass a token")
        name, namespace = payload.get("name") or "", payload.get("organization") or self.user
        if not _REPO_NAME.match(name) or "--" in name or ".." in name:
            raise _Reply(400, f"Invalid repo name {name!r}")
        self._require_write(namespace)
        repo_id = f"{namespace}/{name}"
        url = f"{self.server.hub.url}/{repo_id}"
        if repo_id in self.server.hub.state.repos:
            # huggingface_hub's create_repo(exist_ok=True) reads `url` from this 409 body.
            return self._send(409, {"error": "You already created this model repo", "url": url},
                              {"X-Error-Message": "You already created this model repo"})  # fmt: skip
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        self.server.hub.state.create_repo(repo_id, private=private, author=self.user)
        self._send(200, {"url": url, "name": repo_id, "id": f"repo-{repo_id}"})

    def _delete_repo(self) -> None:
        payload = self._json_body()
        repo_id = f"{payload.get('organization') or self.user}/{payload.get('name')}"
        self._repo(repo_id, write=True)
        del self.server.hub.state.repos[repo_id]
        self._send(200, {})

    def _settings(self, repo_id: str) -> None:
        repo = self._repo(repo_id, write=True)
        payload = self._json_body()
        if "gated" in payload:
            if payload["gated"] not in ("auto", "manual", False):
                raise _Reply(400, f"Invalid gated value {payload['gated']!r}")
            repo.gated = payload["gated"]
        if "private" in payload:
            repo.private = bool(payload["private"])
        if payload.get("visibility") in ("private", "public"):
            repo.private = payload["visibility"] == "private"
        self._send(200, {})

    # -- reading ---------------------------------------------------------------------------------------------------
    def _model_info(self, repo_id: str, revision: str | None) -> None:
        repo = self._repo(repo_id)
        commit = self._commit_at(repo, revision)
        card_data = None
        if "README.md" in commit.files:
            card_data, _ = parse_card_metadata(self._file_bytes(commit.files["README.md"]).decode(errors="replace"))
        card_data = card_data or {}
        siblings = []
        for f in sorted(commit.files.values(), key=lambda f: f.path):
            sibling: dict[str, Any] = {"rfilename": f.path}
            if self.query.get("blobs") in ("1", "true", "True"):
                sibling.update(size=f.size, blobId=f.blob_oid)
                if f.lfs_sha256:
                    sibling["lfs"] = {"sha256": f.lfs_sha256, "size": f.size, "pointerSize": f.pointer_size}
            siblings.append(sibling)
        tags = list(card_data.get("tags") or []) if _is_str_list(card_data.get("tags")) else []
        if isinstance(card_data.get("library_name"), str):
            tags.append(card_data["library_name"])
        self._send(200, {
            "_id": f"id-{repo_id}", "id": repo_id, "modelId": repo_id, "author": repo.namespace, "sha": commit.oid,
            "lastModified": commit.date, "createdAt": repo.created_at, "private": repo.private, "gated": repo.gated,
            "disabled": False, "downloads": 0, "likes": 0, "tags": tags, "cardData": card_data,
            "library_name": card_data.get("library_name"), "siblings": siblings, "spaces": [],
            "usedStorage": sum(f.size for f in commit.files.values()),
        })  # fmt: skip

    def _tree(self, repo_id: str, revision: str, path: str) -> None:
        repo = self._repo(repo_id)
        commit = self._commit_at(repo, revision)
        recursive = self.query.get("recursive", "").lower() in ("1", "true")
        prefix = f"{path}/" if path else ""
        if path and path in commit.files:
            raise _Reply(400, f"{path} is a file, not a directory")
        if path and not any(p.startswith(prefix) for p in commit.files):
            raise _Reply(404, f"{path} does not exist on {revision}", "EntryNotFound")
        entries: dict[str, dict] = {}
        for p, f in sorted(commit.files.items()):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix) :].split("/")
            for depth in range(1, len(rest)):  # the folders on the way
                folder = prefix + "/".join(rest[:depth])
                if recursive or depth == 1:
                    oid = hashlib.sha1(f"tree {commit.oid} {folder}".encode()).hexdigest()
                    entries.setdefault(folder, {"type": "directory", "oid": oid, "size": 0, "path": folder})
            if recursive or len(rest) == 1:
                entry: dict[str, Any] = {"type": "file", "oid": f.blob_oid, "size": f.size, "path": p}
                if f.lfs_sha256:
                    entry["lfs"] = {"oid": f.lfs_sha256, "size": f.size, "pointerSize": f.pointer_size}
                entries[p] = entry
        items = [entries[k] for k in sorted(entries)]
        # Cursor pagination with a GitHub-style Link header, like the Hub (page size is a knob for tests).
        start = int(self.query.get("cursor") or 0)
        page = items[start : start + self.server.hub.tree_page_size]
        headers = {}
        if start + len(page) < len(items):
            query = {k: v for k, v in self.query.items() if k != "cursor"} | {"cursor": start + len(page)}
            url = f"{self.server.hub.url}{urlsplit(self.path).path}?{urlencode(query)}"
            headers["Link"] = f'<{url}>; rel="next"'
        self._send(200, page, headers)

    def _refs(self, repo_id: str) -> None:
        repo = self._repo(repo_id)

        def ref(name: str, full: str, oid: str) -> dict:
            return {"name": name, "ref": full, "targetCommit": oid}

        data = {
            "branches": [ref(n, f"refs/heads/{n}", o) for n, o in sorted(repo.branches.items())],
            "tags": [ref(n, f"refs/tags/{n}", o) for n, o in sorted(repo.tags.items())],
            "converts": [],
        }
        if self.query.get("include_prs"):
            data["pullRequests"] = [ref(f"refs/pr/{n}", f"refs/pr/{n}", o) for n, o in sorted(repo.prs.items())]
        self._send(200, data)

    def _commits(self, repo_id: str, revision: str) -> None:
        repo = self._repo(repo_id)
        commit: Commit | None = self._commit_at(repo, revision)
        items = []
        while commit is not None:
            items.append({"id": commit.oid, "title": commit.title, "message": commit.message,
                          "authors": [{"user": commit.author}], "date": commit.date})  # fmt: skip
            commit = repo.commits[commit.parents[0]] if commit.parents else None
        self._send(200, items)

    def _file_bytes(self, f: StoredFile) -> bytes:
        return f.content if f.content is not None else self.server.hub.state.lfs_store[f.lfs_sha256]

    def _resolve(self, repo_id: str, revision: str, path: str) -> None:
        hub = self.server.hub
        repo = self._repo(repo_id)
        self._check_gate(repo)
        commit = self._commit_at(repo, revision)
        f = commit.files.get(path)
        if f is None:
            raise _Reply(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{f.blob_oid}"', "Accept-Ranges": "bytes"}
        if f.lfs_sha256 is None:
            return self._send_bytes(f.content, headers)
        headers.update({"X-Linked-Etag": f'"{f.lfs_sha256}"', "X-Linked-Size": f.size})
        if hub.cdn_url is None:
            return self._send_bytes(hub.state.lfs_store[f.lfs_sha256], headers)
        # Like huggingface.co: LFS content lives on a CDN (another origin) behind a signed, expiring URL.
        expires = int(time.time()) + 3600
        query = urlencode({"expires": expires, "sig": hub.sign("get", f.lfs_sha256, expires), "filename": path})
        headers["Location"] = f"{hub.cdn_url}/cdn-lfs/{f.lfs_sha256}?{query}"
        self._send(302, b"", headers)

    def _send_bytes(self, data: bytes, headers: dict) -> None:
        """200, or 206 for a `Range: bytes=a-b` request (huggingface_hub uses it to resume downloads)."""
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "").strip())
        if match and self.method == "GET" and (match[1] or match[2]):
            total = len(data)
            start, end = (int(match[1]), int(match[2]) if match[2] else total - 1) if match[1] else (
                total - int(match[2]), total - 1)  # fmt: skip
            if start >= total or start > end:
                raise _Reply(416, "Requested range not satisfiable", headers={"Content-Range": f"bytes */{total}"})
            end = min(end, total - 1)
            headers = {**headers, "Content-Range": f"bytes {start}-{end}/{total}"}
            return self._send(206, data[start : end + 1], headers, "application/octet-stream")
        self._send(200, data, headers, "application/octet-stream")

    def _cdn_download(self, sha256: str) -> None:
        hub = self.server.hub
        expires = int(self.query.get("expires") or 0)
        signed = hmac.compare_digest(self.query.get("sig", ""), hub.sign("get", sha256, expires))
        if not signed or expires < time.time():
            raise _Reply(403, "AccessDenied: invalid or expired signature")
        if sha256 not in hub.state.lfs_store:
            raise _Reply(404, "NoSuchKey")
        self._send_bytes(hub.state.lfs_store[sha256], {"ETag": f'"{sha256}"'})

    # -- writing ---------------------------------------------------------------------------------------------------
    def _preupload(self, repo_id: str, revision: str) -> None:
        repo = self._repo(repo_id, write=True)
        commit = self._commit_at(repo, revision)
        payload = self._json_body()
        lfs_patterns = _lfs_patterns(commit.files)
        gitignore = payload.get("gitIgnore")
        if gitignore is None and ".gitignore" in commit.files:
            gitignore = self._file_bytes(commit.files[".gitignore"]).decode(errors="replace")
        ignore = [ln.strip() for ln in (gitignore or "").splitlines() if ln.strip() and not ln.startswith("#")]
        files = []
        for item in payload.get("files", []):
            path, size = item["path"], int(item["size"])
            sample = base64.b64decode(item.get("sample") or "")
            lfs = _matches(path, lfs_patterns) or size > MAX_REGULAR_FILE_SIZE or b"\x00" in sample
            existing = commit.files.get(path)
            oid = None
            if existing is not None:  # what the client compares with its local oid to skip unchanged files
                oid = existing.lfs_sha256 if existing.lfs_sha256 else existing.blob_oid
            files.append({"path": path, "uploadMode": "lfs" if lfs else "regular",
                          "shouldIgnore": _matches(path, ignore), "oid": oid})  # fmt: skip
        self._send(200, {"files": files, "commitOid": commit.oid})

    def _lfs_batch(self, repo_id: str) -> None:
        hub = self.server.hub
        repo = self._repo(repo_id, write=True)
        payload = self._json_body()
        if payload.get("operation") != "upload":
            raise _Reply(400, "only the upload operation is served by the test Hub")
        objects = []
        for obj in payload.get("objects", []):
            oid, size = obj.get("oid", ""), obj.get("size")
            if not _SHA256.match(oid) or not isinstance(size, int) or size < 0:
                objects.append({"oid": str(oid), "size": size if isinstance(size, int) else 0,
                                "error": {"code": 422, "message": "Invalid oid or size"}})  # fmt: skip
                continue
            entry: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if oid not in repo.lfs_oids:
                expires = int(time.time()) + 3600
                query = urlencode({"repo": repo_id, "size": size, "expires": expires,
                                   "sig": hub.sign("put", f"{repo_id}:{oid}:{size}", expires)})  # fmt: skip
                entry["actions"] = {
                    "upload": {"href": f"{hub.url}/lfs-upload/{oid}?{query}", "expires_at": expires},
                    "verify": {"href": f"{hub.url}/{repo_id}.git/info/lfs/objects/verify", "header": {}},
                }
            objects.append(entry)
        self._send(200, {"transfer": "basic", "objects": objects}, content_type="application/vnd.git-lfs+json")

    def _lfs_put(self, sha256: str) -> None:
        hub = self.server.hub
        repo_id, size = self.query.get("repo", ""), int(self.query.get("size", -1))
        expires = int(self.query.get("expires", 0))
        if not hmac.compare_digest(self.query.get("sig", ""), hub.sign("put", f"{repo_id}:{sha256}:{size}", expires)):
            raise _Reply(403, "AccessDenied: invalid signature")
        if expires < time.time():
            raise _Reply(403, "AccessDenied: request has expired")
        if len(self.body) != size:
            raise _Reply(400, f"size mismatch: announced {size} bytes, received {len(self.body)}")
        if hashlib.sha256(self.body).hexdigest() != sha256:
            raise _Reply(400, "sha256 mismatch: the uploaded content does not match the announced oid")
        hub.state.lfs_store[sha256] = self.body
        hub.state.repos[repo_id].lfs_oids.add(sha256)
        self._send(200, b"", {"ETag": f'"{sha256}"'})

    def _lfs_verify(self, repo_id: str) -> None:
        repo = self._repo(repo_id)
        payload = self._json_body()
        oid = payload.get("oid")
        if oid not in repo.lfs_oids or len(self.server.hub.state.lfs_store[oid]) != payload.get("size"):
            raise _Reply(404, f"LFS object {oid} was not uploaded")
        self._send(200, {})

    def _commit(self, repo_id: str, revision: str) -> None:
        state = self.server.hub.state
        repo = self._repo(repo_id, write=True)
        create_pr = self.query.get("create_pr") in ("1", "true", "True")
        try:
            lines = [json.loads(line) for line in self.body.decode().splitlines() if line.strip()]
        except ValueError as exc:
            raise _Reply(400, f"Invalid NDJSON commit payload: {exc}") from exc
        if not lines or lines[0].get("key") != "header":
            raise _Reply(400, "The first NDJSON line of a commit must be its header")
        header = lines[0]["value"]
        base = self._commit_at(repo, revision)
        ref = repo.writable_ref(revision)
        if ref is None and not create_pr:
            raise _Reply(400, f"Invalid rev id: {revision} is not a branch; commits go to branches or refs/pr/N")
        parent = header.get("parentCommit")
        if parent and parent != base.oid:
            raise _Reply(412, "A commit has happened since. Please refresh and try again.")
        files = dict(base.files)
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value") or {}
            path = value.get("path", "")
            if key in ("file", "lfsFile", "deletedFile") and (
                not path or path.startswith("/") or ".." in path.split("/") or path.startswith(".git/")
            ):
                raise _Reply(400, f"Invalid path in commit: {path!r}")
            if key == "file":
                try:
                    content = base64.b64decode(value["content"], validate=True)
                except (binascii.Error, KeyError) as exc:
                    raise _Reply(400, f"Invalid base64 content for {path}") from exc
                if len(content) > MAX_REGULAR_FILE_SIZE:
                    raise _Reply(400, "Your push was rejected because it contains files larger than 10 MiB. "
                                      "Please use https://git-lfs.github.com/ to store large files.")  # fmt: skip
                files[path] = StoredFile(path, len(content), git_blob_oid(content), None, content)
            elif key == "lfsFile":
                oid = value.get("oid", "")
                if oid not in repo.lfs_oids:
                    raise _Reply(400, f"Your push was rejected because an LFS pointer pointed to a file that does "
                                      f"not exist: {path} (oid {oid})")  # fmt: skip
                size = len(state.lfs_store[oid])
                if value.get("size") not in (None, size):
                    raise _Reply(400, f"LFS size mismatch for {path}")
                files[path] = StoredFile(path, size, git_blob_oid(lfs_pointer(oid, size)), oid)
            elif key == "deletedFile":
                if files.pop(path, None) is None:
                    raise _Reply(404, "A file with this name doesn't exist", "EntryNotFound")
            elif key == "deletedFolder":
                prefix = path.rstrip("/") + "/"
                doomed = [p for p in files if p.startswith(prefix)]
                if not doomed:
                    raise _Reply(404, "A folder with this name doesn't exist", "EntryNotFound")
                for p in doomed:
                    del files[p]
            else:
                raise _Reply(400, f"Unknown commit operation {key!r}")
        if "README.md" in files and files.get("README.md") != base.files.get("README.md"):
            errors, _ = validate_card_metadata(self._file_bytes(files["README.md"]).decode(errors="replace"))
            if errors:
                raise _Reply(400, "Invalid metadata in README.md. " + " ".join(f"- {e}" for e in errors))
        commit = state.new_commit(repo, base.oid, files, header.get("summary") or "", header.get("description") or "",
                                  self.user)  # fmt: skip
        url = self.server.hub.url
        reply = {"success": True, "commitOid": commit.oid, "commitUrl": f"{url}/{repo_id}/commit/{commit.oid}",
                 "hookOutput": ""}  # fmt: skip
        if create_pr:
            number = max([0, *repo.prs]) + 1
            repo.prs[number] = commit.oid
            reply["pullRequestUrl"] = f"{url}/{repo_id}/discussions/{number}"
        elif ref[0] == "branch":
            repo.branches[ref[1]] = commit.oid
        else:
            repo.prs[ref[1]] = commit.oid
        self._send(200, reply)

    def _branch(self, repo_id: str, branch: str) -> None:
        repo = self._repo(repo_id, write=True)
        if self.method == "DELETE":
            if branch not in repo.branches:
                raise _Reply(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            if branch == "main":
                raise _Reply(403, "You cannot delete the default branch")
            del repo.branches[branch]
            return self._send(200, {})
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*", branch) or branch.startswith("refs/") or ".." in branch:
            raise _Reply(400, f"Invalid branch name {branch!r}")
        if branch in repo.branches:
            raise _Reply(409, "Reference already exists")
        start = self._json_body().get("startingPoint")
        repo.branches[branch] = self._commit_at(repo, start).oid
        self._send(200, {})

    def _tag(self, repo_id: str, revision: str) -> None:
        repo = self._repo(repo_id, write=True)
        if self.method == "DELETE":  # DELETE /api/models/{id}/tag/{tag}
            if repo.tags.pop(revision, None) is None:
                raise _Reply(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            return self._send(200, {})
        tag = self._json_body().get("tag", "")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*", tag or ""):
            raise _Reply(400, f"Invalid tag name {tag!r}")
        if tag in repo.tags:
            raise _Reply(409, "Tag already exists")
        repo.tags[tag] = self._commit_at(repo, revision).oid
        self._send(200, {})


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # keep-alive connections must not block stop()
    allow_reuse_address = True
    hub: HubServer


class HubServer:
    """The test Hub. `url` is its endpoint; `state` holds repos; `requests` logs (method, path, had_auth).

    Args:
        cdn: serve LFS downloads through a redirect to another origin ("localhost" instead of 127.0.0.1), as the
            real Hub does; False serves them directly from `/resolve`.
        tree_page_size: entries per page of `/tree` (the Hub uses 1000); small values exercise pagination.
    """

    write_token = WRITE_TOKEN
    read_token = READ_TOKEN
    other_user_token = OTHER_USER_TOKEN
    user = USER
    org = ORG

    def __init__(self, *, cdn: bool = True, tree_page_size: int = 1000):
        self.state = HubState()
        self.requests: list[tuple[str, str, bool]] = []
        self.tree_page_size = tree_page_size
        self._use_cdn = cdn
        self._secret = secrets.token_bytes(16)
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""
        self.cdn_url: str | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> HubServer:
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.hub = self
        port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{port}"
        self.cdn_url = f"http://localhost:{port}" if self._use_cdn and _localhost_is_loopback() else None
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the port: clients now get connection errors (the Hub is "down")."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def sign(self, action: str, subject: str, expires: int) -> str:
        return hmac.new(self._secret, f"{action}:{subject}:{expires}".encode(), hashlib.sha256).hexdigest()

    # -- direct state access for tests -----------------------------------------------------------------------------
    def repo(self, repo_id: str) -> Repo:
        return self.state.repos[repo_id]

    def create_repo(self, repo_id: str, *, private: bool = False) -> Repo:
        """Create a repo without HTTP (e.g. in another user's namespace)."""
        return self.state.create_repo(repo_id, private=private, author=repo_id.split("/")[0])

    def set_gated(self, repo_id: str, gated: str | bool = "auto") -> None:
        with self.state.lock:
            self.state.repos[repo_id].gated = gated

    def grant_access(self, repo_id: str, user: str) -> None:
        """Accept `user` on a gated repo (what "agree and access" does on the website)."""
        with self.state.lock:
            self.state.repos[repo_id].granted_users.add(user)

    def head(self, repo_id: str, branch: str = "main") -> Commit:
        repo = self.state.repos[repo_id]
        return repo.commits[repo.branches[branch]]

    def file_bytes(self, repo_id: str, path: str, revision: str = "main") -> bytes:
        repo = self.state.repos[repo_id]
        f = repo.commits[repo.resolve(revision)].files[path]
        return f.content if f.content is not None else self.state.lfs_store[f.lfs_sha256]

    def requests_matching(self, method: str | None = None, contains: str = "") -> list[tuple[str, str, bool]]:
        with self.state.lock:
            return [r for r in self.requests if (method is None or r[0] == method) and contains in r[1]]


def _localhost_is_loopback() -> bool:
    try:
        return any(info[4][0] == "127.0.0.1" for info in socket.getaddrinfo("localhost", None, socket.AF_INET))
    except OSError:
        return False


def free_closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


__all__ = ["HubServer", "WRITE_TOKEN", "READ_TOKEN", "OTHER_USER_TOKEN", "USER", "ORG", "OTHER_USER",
           "validate_card_metadata", "parse_card_metadata", "free_closed_port", "git_blob_oid"]  # fmt: skip
