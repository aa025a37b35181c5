"""KVMapper, TransferredCache and the CLI against the local Hub server (the README's publish / pull journeys)."""

import torch
from huggingface_hub import ModelCard

from conftest import random_ids
from hf_kvtransfer import KVMapper, TransferredCache, prefill
from hf_kvtransfer.core.cache import _load_mapper
from hf_kvtransfer.commands.cli import main


def test_push_pull_round_trip_and_cache_from_repo_id(hub_server, identity_mapper, qwen3_model):
    repo = f"{hub_server.user}/tiny-identity-kv"
    url = identity_mapper.push_to_hub(repo, token=hub_server.write_token)
    assert "/commit/" in url
    pulled = KVMapper.from_pretrained(repo, token=hub_server.write_token)
    for (k1, v1), (k2, v2) in zip(identity_mapper.state_dict().items(), pulled.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)

    card = ModelCard.load(str(_card_path(repo, hub_server)))
    assert card.data.library_name == "hf-kvtransfer"
    assert f'KVMapper.from_pretrained("{repo}")' in card.text

    # A repo id in place of the mapper object: loaded once per process and reused.
    _load_mapper.cache_clear()
    ids = random_ids(1, 16, seed=3)
    ref = qwen3_model.generate(ids, do_sample=False, max_new_tokens=6, min_new_tokens=6)
    for _ in range(2):
        cache = TransferredCache(prefill(qwen3_model, ids), repo, token=hub_server.write_token, model=qwen3_model)
        out = qwen3_model.generate(ids, cache=cache, do_sample=False, max_new_tokens=6, min_new_tokens=6)
        assert torch.equal(out, ref)
    assert _load_mapper.cache_info().misses == 1 and _load_mapper.cache_info().hits == 1


def _card_path(repo, hub_server):
    from hf_kvtransfer.core.hub import resolve_mapper_dir

    return resolve_mapper_dir(repo, token=hub_server.write_token) / "README.md"


def test_cli_push_to_branch_and_info(hub_server, identity_mapper, tmp_path, capsys, monkeypatch):
    identity_mapper.save_pretrained(tmp_path / "m")
    repo = f"{hub_server.user}/tiny-cli-kv"
    monkeypatch.setenv("HF_TOKEN", hub_server.write_token)
    assert main(["push", str(tmp_path / "m"), repo, "--revision", "k1"]) == 0
    assert "/commit/" in capsys.readouterr().out
    pulled = KVMapper.from_pretrained(repo, revision="k1")
    assert torch.equal(pulled.layers[0].key.weight, identity_mapper.layers[0].key.weight)

    assert main(["info", repo, "--revision", "k1"]) == 0
    info = capsys.readouterr().out
    assert "top_k:       1" in info and "fit R^2" in info and "3 layers x 2 KV heads x 16" in info

    # known errors: one line + hint, exit code 1, no traceback
    assert main(["info", f"{hub_server.user}/does-not-exist"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does-not-exist" in err and "Traceback" not in err


def test_cli_push_without_token_fails_before_network(hub_server, identity_mapper, tmp_path, capsys):
    identity_mapper.save_pretrained(tmp_path / "m")
    before = len(hub_server.requests)
    assert main(["push", str(tmp_path / "m"), f"{hub_server.user}/x"]) == 1
    assert "token" in capsys.readouterr().err.lower()
    assert len(hub_server.requests) == before
