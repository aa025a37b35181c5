"""hf_kvtransfer.core.hub against a real HTTP server speaking the Hub API (tests/hub_server.py), with raw mapper files.

Each test gets its own server and an empty huggingface_hub cache (fixtures in tests/hub_fixtures.py).
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, ModelCard, constants
from huggingface_hub.errors import (
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors.torch import load_file, save_file

from hf_kvtransfer.core.hub import (
    MapperAuthError,
    MapperGatedError,
    MapperHubError,
    MapperNotFoundError,
    MapperOfflineError,
    MapperRevisionNotFoundError,
    NotAMapperError,
    push_mapper_dir,
    render_model_card,
    resolve_mapper_dir,
)

# The `hub_server` / `unreachable_hub` fixtures (a no-op if conftest.py already lists the plugin).
pytest_plugins = ["hub_fixtures"]

# huggingface_hub's LFS upload passes a file object as `data=`, which httpx2 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

MAPPER_FILES = {"config.json", "model.safetensors", "README.md"}


def mapper_config(num_source: int = 3, num_target: int = 4, **overrides) -> dict:
    """A config.json like KVMapper writes (the keys the Hub layer and the card read)."""

    def fingerprint(model_type: str, layers: int) -> dict:
        return {"model_type": model_type, "num_hidden_layers": layers, "num_key_value_heads": 2, "head_dim": 16,
                "vocab_size": 96, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}  # fmt: skip

    config = {
        "mapper_type": "ridge",
        "source_model_id": "Qwen/Qwen3-14B",
        "source_revision": "a" * 40,
        "target_model_id": "Qwen/Qwen3-32B",
        "target_revision": "b" * 40,
        "source_fingerprint": fingerprint("qwen3", num_source),
        "target_fingerprint": fingerprint("qwen3", num_target),
        "top_k": 2,
        "ridge_lambda": 0.01,
        "selected_layers": [[t % num_source, (t + 1) % num_source] for t in range(num_target)],
        "fit_r2_key": [0.9 + 0.01 * t for t in range(num_target)],
        "fit_r2_value": [0.8 - 0.1 * t for t in range(num_target)],
        "heldout_r2_key": [0.85 + 0.01 * t for t in range(num_target)],
        "heldout_r2_value": [0.7 - 0.1 * t for t in range(num_target)],
        "calibration": {"dataset": "HuggingFaceFW/fineweb-edu", "config": "sample-10BT", "split": "train",
                        "text_field": "text", "num_sequences": 500, "seq_len": 1024, "stride": 4,
                        "num_tokens": 128_000},  # fmt: skip
        "num_parameters": 12_345,
        "library_version": "0.1.0",
    }
    config.update(overrides)
    return config


def make_mapper_dir(path: Path, *, seed: int = 0, repo_id: str | None = None, config: dict | None = None):
    """Write config.json, model.safetensors (float32 + bfloat16 tensors) and README.md; return (path, tensors)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "layers.0.key.weight": torch.randn(32, 64, generator=g),
        "layers.0.key.bias": torch.randn(32, generator=g),
        "layers.1.value.weight": torch.randn(32, 64, generator=g).to(torch.bfloat16),
    }
    config = config or mapper_config()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    render_model_card(config, repo_id).save(str(path / "README.md"))
    return path, tensors


def assert_same_tensors(folder: Path, expected: dict[str, torch.Tensor]) -> None:
    loaded = load_file(str(folder / "model.safetensors"))
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def assert_one_line(exc: pytest.ExceptionInfo, *fragments: str) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# -- push and pull ------------------------------------------------------------------------------------------------


def test_push_then_resolve_round_trip(hub_server, tmp_path, monkeypatch):
    repo_id = f"{hub_server.user}/qwen3-14b-to-32b"
    folder, tensors = make_mapper_dir(tmp_path / "m", repo_id=repo_id)
    monkeypatch.setenv("HF_TOKEN", hub_server.write_token)  # the token `hf auth login` would have stored

    url = push_mapper_dir(folder, repo_id)

    head = hub_server.head(repo_id)
    assert url == f"{hub_server.url}/{repo_id}/commit/{head.oid}"
    assert set(head.files) == MAPPER_FILES | {".gitattributes"}
    assert len(hub_server.requests_matching("POST", "/commit/")) == 1  # one commit for all three files
    weights = (folder / "model.safetensors").read_bytes()
    assert head.files["model.safetensors"].lfs_sha256 == hashlib.sha256(weights).hexdigest()  # went through LFS
    assert head.files["config.json"].lfs_sha256 is None

    monkeypatch.delenv("HF_TOKEN")
    path = resolve_mapper_dir(repo_id)
    assert path.name == head.oid and path.is_relative_to(Path(constants.HF_HUB_CACHE))
    assert sorted(p.name for p in path.iterdir()) == sorted(MAPPER_FILES)
    assert (path / "model.safetensors").read_bytes() == weights
    assert_same_tensors(path, tensors)
    assert json.loads((path / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    downloaded = {p.rsplit("/", 1)[-1] for m, p, _ in hub_server.requests if m == "GET" and "/resolve/" in p}
    assert downloaded <= MAPPER_FILES  # never .gitattributes or anything else in the repo


def test_push_to_branch_then_pull_by_revision(hub_server, tmp_path):
    repo_id = f"{hub_server.org}/mapper"
    token = hub_server.write_token
    folder_v1, tensors_v1 = make_mapper_dir(tmp_path / "v1", seed=1)
    folder_v2, tensors_v2 = make_mapper_dir(tmp_path / "v2", seed=2)
    push_mapper_dir(folder_v1, repo_id, token=token)
    main_before = hub_server.head(repo_id).oid

    push_mapper_dir(folder_v2, repo_id, token=token, revision="experiment", commit_message="try k=4")

    assert hub_server.head(repo_id).oid == main_before  # main did not move
    branch_head = hub_server.head(repo_id, "experiment")
    assert branch_head.title == "try k=4" and branch_head.parents == (main_before,)
    hub_server.tree_page_size = 2  # snapshot_download must follow the tree's Link pagination
    assert_same_tensors(resolve_mapper_dir(repo_id, revision="experiment"), tensors_v2)
    assert_same_tensors(resolve_mapper_dir(repo_id), tensors_v1)


def test_pull_older_content_by_tag_and_by_commit(hub_server, tmp_path):
    repo_id = f"{hub_server.user}/mapper"
    token = hub_server.write_token
    folder_v1, tensors_v1 = make_mapper_dir(tmp_path / "v1", seed=1)
    folder_v2, tensors_v2 = make_mapper_dir(tmp_path / "v2", seed=2)
    v1 = push_mapper_dir(folder_v1, repo_id, token=token)
    HfApi(token=token).create_tag(repo_id, tag="v1.0")
    push_mapper_dir(folder_v2, repo_id, token=token)

    assert_same_tensors(resolve_mapper_dir(repo_id), tensors_v2)
    assert_same_tensors(resolve_mapper_dir(repo_id, revision="v1.0"), tensors_v1)
    assert_same_tensors(resolve_mapper_dir(repo_id, revision=v1.oid), tensors_v1)


def test_push_as_pull_request(hub_server, tmp_path):
    repo_id = f"{hub_server.user}/mapper"
    token = hub_server.write_token
    push_mapper_dir(make_mapper_dir(tmp_path / "v1", seed=1)[0], repo_id, token=token)
    main_before = hub_server.head(repo_id).oid
    folder_v2, tensors_v2 = make_mapper_dir(tmp_path / "v2", seed=2)

    info = push_mapper_dir(folder_v2, repo_id, token=token, create_pr=True)

    assert info.pr_url == f"{hub_server.url}/{repo_id}/discussions/1" and info.pr_revision == "refs/pr/1"
    assert hub_server.head(repo_id).oid == main_before
    assert_same_tensors(resolve_mapper_dir(repo_id, revision="refs/pr/1"), tensors_v2)


def test_push_unchanged_folder_makes_no_new_commit(hub_server, tmp_path):
    repo_id = f"{hub_server.user}/mapper"
    folder, _ = make_mapper_dir(tmp_path / "m")
    first = push_mapper_dir(folder, repo_id, token=hub_server.write_token)
    second = push_mapper_dir(folder, repo_id, token=hub_server.write_token)
    assert second.oid == first.oid == hub_server.head(repo_id).oid
    assert len(hub_server.requests_matching("POST", "/commit/")) == 1


def test_push_renders_missing_card_and_creates_private_repo(hub_server, tmp_path):
    repo_id = f"{hub_server.user}/private-mapper"
    folder, tensors = make_mapper_dir(tmp_path / "m")
    (folder / "README.md").unlink()

    push_mapper_dir(folder, repo_id, token=hub_server.write_token, private=True)

    assert hub_server.repo(repo_id).private
    card = hub_server.file_bytes(repo_id, "README.md").decode()
    assert "library_name: hf-kvtransfer" in card and f'KVMapper.from_pretrained("{repo_id}")' in card
    with pytest.raises(MapperNotFoundError) as exc:  # private: invisible without a token
        resolve_mapper_dir(repo_id)
    assert_one_line(exc, repo_id, "private", "token")
    assert isinstance(exc.value.__cause__, RepositoryNotFoundError)
    assert_same_tensors(resolve_mapper_dir(repo_id, token=hub_server.read_token), tensors)


# -- offline ---------------------------------------------------------------------------------------------------


def test_offline_after_first_download(hub_server, tmp_path, monkeypatch):
    repo_id = f"{hub_server.user}/mapper"
    folder, tensors = make_mapper_dir(tmp_path / "m")
    push_mapper_dir(folder, repo_id, token=hub_server.write_token)
    online = resolve_mapper_dir(repo_id)
    online_exp = resolve_mapper_dir(repo_id, revision="main")
    requests = len(hub_server.requests)

    assert resolve_mapper_dir(repo_id, local_files_only=True) == online
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # set after huggingface_hub was imported: must still count
    assert resolve_mapper_dir(repo_id) == online
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what huggingface_hub itself reads
    assert resolve_mapper_dir(repo_id, revision="main") == online_exp
    assert len(hub_server.requests) == requests  # none of the above touched the network

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub_server.stop()  # network down: the cached snapshot still loads
    assert_same_tensors(resolve_mapper_dir(repo_id), tensors)


def test_offline_with_nothing_cached(hub_server, monkeypatch):
    with pytest.raises(MapperOfflineError) as exc:
        resolve_mapper_dir("kvtester/never-downloaded", local_files_only=True)
    assert_one_line(exc, "kvtester/never-downloaded", "not in the local cache", "offline mode")
    assert isinstance(exc.value.__cause__, LocalEntryNotFoundError)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MapperOfflineError):
        resolve_mapper_dir("kvtester/never-downloaded", revision="v2")
    assert hub_server.requests == []


def test_network_down(unreachable_hub, tmp_path):
    with pytest.raises(MapperOfflineError) as exc:
        resolve_mapper_dir("kvtester/mapper", revision="v1")
    assert_one_line(exc, "kvtester/mapper", "'v1'", "could not reach the Hub", unreachable_hub, "local_files_only")
    folder, _ = make_mapper_dir(tmp_path / "m")
    with pytest.raises(MapperOfflineError) as exc:
        push_mapper_dir(folder, "kvtester/mapper", token="hf_anything")
    assert_one_line(exc, "kvtester/mapper", "could not reach the Hub")


def test_force_download_fetches_again(hub_server, tmp_path):
    repo_id = f"{hub_server.user}/mapper"
    push_mapper_dir(make_mapper_dir(tmp_path / "m")[0], repo_id, token=hub_server.write_token)
    resolve_mapper_dir(repo_id)
    resolve_mapper_dir(repo_id)
    assert len(hub_server.requests_matching("GET", "/cdn-lfs/")) == 1  # cached the second time
    resolve_mapper_dir(repo_id, force_download=True)
    assert len(hub_server.requests_matching("GET", "/cdn-lfs/")) == 2


# -- errors ----------------------------------------------------------------------------------------------------


def test_repo_not_found(hub_server):
    with pytest.raises(MapperNotFoundError) as exc:
        resolve_mapper_dir("kvtester/no-such-mapper")
    assert_one_line(exc, "'kvtester/no-such-mapper'", "typos", "hf auth login")
    assert isinstance(exc.value.__cause__, RepositoryNotFoundError)
    with pytest.raises(MapperNotFoundError) as exc:
        resolve_mapper_dir("not a repo id")
    assert_one_line(exc, "not a repo id", "neither a local directory nor a valid Hub repo id")
    assert isinstance(exc.value.__cause__, HFValidationError)


def test_gated_repo(hub_server, tmp_path):
    repo_id = f"{hub_server.user}/gated-mapper"
    folder, tensors = make_mapper_dir(tmp_path / "m")
    push_mapper_dir(folder, repo_id, token=hub_server.write_token)
    HfApi(token=hub_server.write_token).update_repo_settings(repo_id, gated="auto")

    for token in (None, hub_server.other_user_token):  # anonymous (401) and a user not accepted yet (403)
        with pytest.raises(MapperGatedError) as exc:
            resolve_mapper_dir(repo_id, token=token)
        assert_one_line(exc, repo_id, "gated", "accept its conditions", f"{hub_server.url}/{repo_id}")
        assert isinstance(exc.value.__cause__, GatedRepoError)
    hub_server.grant_access(repo_id, "stranger")
    assert_same_tensors(resolve_mapper_dir(repo_id, token=hub_server.other_user_token), tensors)


def test_wrong_revision_lists_branches_and_tags(hub_server, tmp_path):
    repo_id = f"{hub_server.user}/mapper"
    push_mapper_dir(make_mapper_dir(tmp_path / "m")[0], repo_id, token=hub_server.write_token)
    HfApi(token=hub_server.write_token).create_tag(repo_id, tag="v1")
    with pytest.raises(MapperRevisionNotFoundError) as exc:
        resolve_mapper_dir(repo_id, revision="v2")
    assert_one_line(exc, "'v2'", repo_id, "branches: main", "tags: v1", "list_repo_refs")
    assert isinstance(exc.value.__cause__, RevisionNotFoundError)
    with pytest.raises(MapperRevisionNotFoundError):
        resolve_mapper_dir(repo_id, revision="0" * 40)  # a commit hash that does not exist


def test_repo_without_weights_is_not_a_mapper(hub_server, tmp_path):
    repo_id = f"{hub_server.user}/half-mapper"
    api = HfApi(token=hub_server.write_token)
    api.create_repo(repo_id)
    api.upload_file(path_or_fileobj=json.dumps(mapper_config()).encode(), path_in_repo="config.json", repo_id=repo_id)
    with pytest.raises(NotAMapperError) as exc:
        resolve_mapper_dir(repo_id)
    assert_one_line(exc, repo_id, "no model.safetensors", "it holds .gitattributes, config.json")

    api.create_repo(f"{repo_id}-2")
    with pytest.raises(NotAMapperError) as exc:
        resolve_mapper_dir(f"{repo_id}-2")
    assert_one_line(exc, f"{repo_id}-2", "no config.json", "not a hf-kvtransfer mapper")


def test_model_repo_is_rejected_before_its_weights_download(hub_server, tmp_path):
    repo_id = f"{hub_server.user}/a-model"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 2}))
    save_file({"w": torch.zeros(64, 64)}, str(model / "model.safetensors"))
    api = HfApi(token=hub_server.write_token)
    api.create_repo(repo_id)
    api.upload_folder(folder_path=str(model), repo_id=repo_id)

    with pytest.raises(NotAMapperError) as exc:
        resolve_mapper_dir(repo_id)
    assert_one_line(exc, repo_id, "looks like a transformers model", "model_type='qwen3'")
    assert not [r for r in hub_server.requests if "model.safetensors" in r[1] and r[0] in ("GET", "HEAD")]


def test_push_needs_a_token_before_any_request(hub_server, tmp_path):
    folder, _ = make_mapper_dir(tmp_path / "m")
    for token in (None, False):
        with pytest.raises(MapperAuthError) as exc:
            push_mapper_dir(folder, "kvtester/mapper", token=token)
        assert_one_line(exc, "kvtester/mapper", "hf auth login", "token=")
    assert hub_server.requests == []


@pytest.mark.parametrize("case", ["read-only token", "foreign namespace", "invalid token"])
def test_push_refused_by_the_hub(hub_server, tmp_path, case):
    repo_id, token = {
        "read-only token": ("kvtester/mapper", hub_server.read_token),
        "foreign namespace": ("someone-else/mapper", hub_server.write_token),
        "invalid token": ("kvtester/mapper", "hf_not_a_real_token"),
    }[case]
    folder, _ = make_mapper_dir(tmp_path / "m")
    with pytest.raises(MapperAuthError) as exc:
        push_mapper_dir(folder, repo_id, token=token)
    assert_one_line(exc, repo_id, "refused the token", "write access")
    assert not hub_server.requests_matching("POST", "/commit/")


def test_push_rejects_folder_without_weights(hub_server, tmp_path):
    folder, _ = make_mapper_dir(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(NotAMapperError) as exc:
        push_mapper_dir(folder, "kvtester/mapper", token=hub_server.write_token)
    assert_one_line(exc, str(folder), "no model.safetensors")
    assert hub_server.requests == []


def test_local_directory_first(hub_server, tmp_path):
    folder, tensors = make_mapper_dir(tmp_path / "kvtester" / "mapper")
    assert resolve_mapper_dir(folder) == folder
    assert resolve_mapper_dir(str(folder), revision="ignored") == folder
    assert hub_server.requests == []

    (folder / "config.json").unlink()
    with pytest.raises(NotAMapperError) as exc:
        resolve_mapper_dir(folder)
    assert_one_line(exc, str(folder), "no config.json")
    with pytest.raises(NotAMapperError) as exc:
        resolve_mapper_dir(folder / "model.safetensors")
    assert_one_line(exc, "is a file")
    with pytest.raises(MapperNotFoundError) as exc:
        resolve_mapper_dir(tmp_path / "does" / "not" / "exist")
    assert_one_line(exc, "does not exist", "check the path")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(NotAMapperError, match="looks like a transformers model"):
        resolve_mapper_dir(folder)


# -- model card ------------------------------------------------------------------------------------------------


def test_card_metadata_round_trips_and_validates(hub_server, tmp_path):
    repo_id = "kvorg/qwen3-14b-to-32b"
    config = mapper_config()
    report = {
        "eval_results": {"hellaswag_retention": 0.976},
        "model_selection": {"metric": "held-out R^2", "top_k_candidates": [1, 2, 4],
                            "chosen": [{"top_k": 2, "ridge_lambda": 0.01}], "heldout_tokens": 4096},
    }  # fmt: skip
    card = render_model_card(config, repo_id, report=report)
    card.save(str(tmp_path / "README.md"))

    data = ModelCard.load(tmp_path / "README.md").data.to_dict()
    assert data["library_name"] == "hf-kvtransfer"
    assert data["tags"] == ["kv-cache", "kv-cache-transfer", "qwen3"]
    assert data["base_model"] == ["Qwen/Qwen3-14B", "Qwen/Qwen3-32B"]
    assert data["base_model_relation"] == "adapter"
    assert data["datasets"] == ["HuggingFaceFW/fineweb-edu"]
    assert data["license"] == "apache-2.0"
    card.validate()  # POST /api/validate-yaml on the test Hub

    text = card.text
    for line in (
        "from hf_kvtransfer import KVMapper, TransferredCache, prefill",
        f'mapper = KVMapper.from_pretrained("{repo_id}")',
        "src_cache = prefill(source, input_ids)",
        "out = target.generate(input_ids, cache=TransferredCache(src_cache, mapper, model=target), max_new_tokens=64)",
    ):
        assert line in text
    assert f'AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-32B", revision="{"b" * 40}")' in text
    for t, (sources, r2k, r2v, hk, hv) in enumerate(
        zip(config["selected_layers"], config["fit_r2_key"], config["fit_r2_value"], config["heldout_r2_key"],
            config["heldout_r2_value"])  # fmt: skip
    ):
        row = f"| {t} | {', '.join(map(str, sources))} | {r2k:.4f} | {r2v:.4f} | {hk:.4f} | {hv:.4f} |"
        assert row in text, row
    assert "| hellaswag_retention | 0.9760 |" in text
    assert "**k candidates**: 1, 2, 4" in text and "**Chosen**: k = 2, lambda = 0.01" in text
    assert "**Ridge lambda (on centered data)**: 0.01" in text and "**Tokens used for the fit**: 128,000" in text
    assert "Directional" in text and "Same tokenizer" in text and "Pinned to model revisions" in text


def test_card_skips_missing_optional_fields(hub_server, tmp_path):
    config = mapper_config(source_model_id="/models/src", target_model_id=None, calibration={"dataset": "data.jsonl"},
                           mapper_type="mlp", mlp={"hidden_sizes": [1024, 1024], "lr": 0.001})  # fmt: skip
    for key in ("source_revision", "target_revision", "heldout_r2_key", "heldout_r2_value",
                "num_parameters", "license", "library_version"):  # fmt: skip
        config.pop(key, None)
    config["target_fingerprint"]["model_type"] = "llama"
    card = render_model_card(config)
    card.save(str(tmp_path / "README.md"))
    data = ModelCard.load(tmp_path / "README.md").data.to_dict()
    assert "base_model" not in data and "datasets" not in data and "base_model_relation" not in data
    assert data["license"] == "apache-2.0" and data["tags"] == ["kv-cache", "kv-cache-transfer", "qwen3", "llama"]
    card.validate()
    assert "held-out" not in card.text and "## Evaluation results" not in card.text
    assert 'KVMapper.from_pretrained("path/to/this/mapper")' in card.text
    assert "| 3 | 0, 1 | 0.9300 | 0.5000 |" in card.text
    assert "**MLP hidden sizes**: [1024, 1024]" in card.text and "small MLP" in card.text


@pytest.mark.parametrize(
    "metadata, complaint",
    [
        ("tags: kv-cache", "tags"),
        ("base_model: 12", "base_model"),
        ("base_model: /local/path/model", "base_model"),
        ("license: not-a-license", "license"),
        ("base_model_relation: glued\nbase_model: a/b", "base_model_relation"),
        ("tags: [unclosed", "YAML"),
    ],
)
def test_push_with_invalid_card_metadata_is_rejected(hub_server, tmp_path, metadata, complaint):
    folder, _ = make_mapper_dir(tmp_path / "m")
    (folder / "README.md").write_text(f"---\n{metadata}\n---\n# card\n")
    repo_id = f"{hub_server.user}/bad-card"
    with pytest.raises(MapperHubError) as exc:
        push_mapper_dir(folder, repo_id, token=hub_server.write_token)
    assert_one_line(exc, repo_id, "README", complaint)
    assert hub_server.head(repo_id).title == "initial commit"  # nothing was committed


@pytest.mark.parametrize("metadata", ["base_model: 12", "license: not-a-license", "datasets: [./local.jsonl]"])
def test_model_card_validate_uses_the_hub_rules(hub_server, metadata):
    with pytest.raises(ValueError, match=metadata.split(":")[0]):
        ModelCard(f"---\n{metadata}\n---\n# card\n").validate()


# -- the test Hub itself ---------------------------------------------------------------------------------------


def test_hub_server_checks_lfs_uploads_and_serves_ranges(hub_server):
    repo_id = f"{hub_server.user}/raw"
    HfApi(token=hub_server.write_token).create_repo(repo_id)
    auth = {"Authorization": f"Bearer {hub_server.write_token}", "Content-Type": "application/json"}

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)

    def call(method: str, url: str, data: bytes | None = None, headers: dict | None = None):
        request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
        try:
            with opener.open(request) as response:
                return response.status, response.read(), response.headers
        except urllib.error.HTTPError as err:
            return err.code, err.read(), err.headers

    good = b"the real content"
    oid = hashlib.sha256(good).hexdigest()
    batch = {"operation": "upload", "objects": [{"oid": oid, "size": len(good)}], "hash_algo": "sha256"}
    status, body, _ = call("POST", f"{hub_server.url}/{repo_id}.git/info/lfs/objects/batch",
                           json.dumps(batch).encode(), auth)  # fmt: skip
    href = json.loads(body)["objects"][0]["actions"]["upload"]["href"]
    status, body, _ = call("PUT", href, b"fake content!!!!")  # same size, wrong bytes
    assert status == 400 and b"sha256 mismatch" in body
    status, body, _ = call("PUT", href.replace("sig=", "sig=0"), good)
    assert status == 403
    assert call("PUT", href, good)[0] == 200

    commit = "\n".join(json.dumps(line) for line in (
        {"key": "header", "value": {"summary": "add"}},
        {"key": "lfsFile", "value": {"path": "blob.bin", "algo": "sha256", "oid": "1" * 64, "size": 3}},
    ))  # fmt: skip
    status, body, headers = call("POST", f"{hub_server.url}/api/models/{repo_id}/commit/main", commit.encode(), auth)
    assert status == 400 and b"does not exist" in body  # an LFS pointer to a never-uploaded object

    commit = "\n".join(json.dumps(line) for line in (
        {"key": "header", "value": {"summary": "add"}},
        {"key": "lfsFile", "value": {"path": "blob.bin", "algo": "sha256", "oid": oid, "size": len(good)}},
    ))  # fmt: skip
    status, body, _ = call("POST", f"{hub_server.url}/api/models/{repo_id}/commit/main", commit.encode(), auth)
    assert status == 200 and json.loads(body)["commitOid"] == hub_server.head(repo_id).oid

    status, _, headers = call("HEAD", f"{hub_server.url}/{repo_id}/resolve/main/blob.bin")
    assert status == 302 and headers["X-Linked-Etag"] == f'"{oid}"' and int(headers["X-Linked-Size"]) == len(good)
    assert headers["X-Repo-Commit"] == hub_server.head(repo_id).oid
    status, body, headers = call("GET", headers["Location"], headers={"Range": "bytes=4-7"})
    assert status == 206 and body == good[4:8] and headers["Content-Range"] == f"bytes 4-7/{len(good)}"
