"""Sharded mapper checkpoints (transformers' layout): save, load, Hub round trip, and the errors that name the file."""

import json

import pytest
import torch
from huggingface_hub import HfApi, hf_hub_download
from safetensors.torch import load_file, save_file

from hf_kvtransfer import KVMapper, MapperConfig
from hf_kvtransfer.core.checkpoint import (
    INDEX_NAME,
    checkpoint_info,
    load_weights,
    parse_size,
    save_weights,
    weight_files,
)
from hf_kvtransfer.core.hub import resolve_mapper_dir
from transformers import Qwen3Config


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5 kb") == 1500
    assert parse_size(1234) == 1234
    for bad in ("5 parsecs", "", "-1GB", 0, True, "GB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    # 4000 + 400 + 4000 + 2000 + 10 bytes (float32 / bf16), in this order.
    return {
        "a.weight": torch.randn(10, 100, generator=g),
        "a.bias": torch.randn(100, generator=g),
        "b.weight": torch.randn(1000, generator=g),
        "c.weight": torch.randn(1000, generator=g).to(torch.bfloat16),
        "c.bias": torch.randn(5, generator=g).to(torch.bfloat16),
    }


def test_save_sharded_writes_transformers_index(tmp_path):
    state = _state()
    files = save_weights(state, tmp_path, max_shard_size=5000)
    # Greedy in order: [a.weight, a.bias] = 4400, [b.weight] = 4000, [c.weight, c.bias] = 2010.
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert files == [*shards, INDEX_NAME]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 4000 + 400 + 4000 + 2000 + 10
    assert index["weight_map"] == {
        "a.weight": shards[0], "a.bias": shards[0], "b.weight": shards[1], "c.weight": shards[2], "c.bias": shards[2],
    }  # fmt: skip
    for shard in shards:  # each shard read on its own with plain safetensors holds exactly the original tensors
        content = load_file(str(tmp_path / shard))
        assert set(content) == {k for k, f in index["weight_map"].items() if f == shard}
        assert all(torch.equal(content[k], state[k]) for k in content)
    loaded = load_weights(tmp_path)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)

    # Saving again small enough for one file replaces the shards (no stale index left to shadow it).
    assert save_weights(state, tmp_path, max_shard_size="1MB") == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert all(torch.equal(load_weights(tmp_path)[k], state[k]) for k in state)


def test_a_tensor_larger_than_the_shard_size_gets_its_own_shard(tmp_path):
    files = save_weights(_state(), tmp_path, max_shard_size=1000)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert len(files) == 5 + 1 and len(set(index["weight_map"].values())) == 5


def test_broken_shards_are_named(tmp_path):
    state = _state()
    save_weights(state, tmp_path, max_shard_size=5000)
    second = tmp_path / "model-00002-of-00003.safetensors"
    data = second.read_bytes()
    second.write_bytes(data[: len(data) // 2])  # truncated download
    with pytest.raises(ValueError, match="model-00002-of-00003.safetensors is truncated"):
        load_weights(tmp_path)
    second.unlink()
    with pytest.raises(FileNotFoundError, match="shard model-00002-of-00003.safetensors .* is missing"):
        load_weights(tmp_path)
    # A shard from another save (its tensors are not the ones the index assigns to it).
    save_file({"z": torch.zeros(3)}, str(second))
    with pytest.raises(ValueError, match="model-00002-of-00003.safetensors does not hold the tensors"):
        load_weights(tmp_path)
    save_file({"b.weight": torch.zeros(7)}, str(second))
    expected = {k: v.shape for k, v in state.items()}
    with pytest.raises(ValueError, match=r"model-00002-of-00003.safetensors: b.weight has shape \[7\], config implies \[1000\]"):
        load_weights(tmp_path, expected=expected)
    save_file({"b.weight": torch.zeros(1000)}, str(second))
    with pytest.raises(ValueError, match=r"missing tensors \['extra'\]"):
        load_weights(tmp_path, expected={**expected, "extra": (1,)})
    with pytest.raises(ValueError, match=r"unexpected tensors \['c.bias \(in model-00003-of-00003.safetensors\)'\]"):
        load_weights(tmp_path, expected={k: s for k, s in expected.items() if k != "c.bias"})


def _mapper(seed=0):
    config = Qwen3Config(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_attention_heads=4,
                         hidden_size=64, intermediate_size=128, vocab_size=96, max_position_embeddings=256)  # fmt: skip
    mapper = KVMapper(MapperConfig(config.to_dict(), config.to_dict(), [[0, 1], [1, 2], [0, 2]], top_k=2))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mapper.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return mapper  # 3 layers x 2 kinds x (64 x 32 + 32) floats = 50,688 bytes


def _assert_same(a: KVMapper, b: KVMapper):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_mapper_save_pretrained_sharded_round_trip(tmp_path):
    mapper = _mapper()
    mapper.save_pretrained(tmp_path / "m", max_shard_size="20KB")
    files = [f.name for f in weight_files(tmp_path / "m")]
    assert len(files) == 3 and not (tmp_path / "m" / "model.safetensors").exists()
    loaded = KVMapper.from_pretrained(tmp_path / "m")
    _assert_same(mapper, loaded)
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    info = checkpoint_info(tmp_path / "m")
    assert info["total_size"] == sum((tmp_path / "m" / f).stat().st_size for f in files)
    card = (tmp_path / "m" / "README.md").read_text()
    assert f"{info['total_size']:,} bytes" in card and "3 safetensors shards" in card


def test_push_sharded_then_pull_through_the_hub(hub_server, tmp_path):
    repo = f"{hub_server.user}/sharded-kv"
    token = hub_server.write_token
    mapper = _mapper(seed=1)
    mapper.push_to_hub(repo, token=token, max_shard_size="20KB")
    api = HfApi(token=token)

    def files():
        return sorted(f for f in api.list_repo_files(repo) if f != ".gitattributes")

    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert files() == sorted(["README.md", "config.json", INDEX_NAME, *shards])
    assert len(api.list_repo_commits(repo)) == 2  # repo creation + one commit with every shard
    index = json.loads(open(hf_hub_download(repo, INDEX_NAME, token=token)).read())
    assert set(index["weight_map"]) == set(mapper.state_dict()) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in mapper.state_dict().values())
    _assert_same(mapper, KVMapper.from_pretrained(repo, token=token))
    # Pushing the same repo as one file deletes the shards in that commit.
    other = _mapper(seed=2)
    other.push_to_hub(repo, token=token)
    assert files() == ["README.md", "config.json", "model.safetensors"]
    pulled = resolve_mapper_dir(repo, token=token)
    assert not (pulled / INDEX_NAME).exists()
    _assert_same(other, KVMapper.from_pretrained(repo, token=token))


def test_cli_push_sharded_and_info(hub_server, tmp_path, capsys, monkeypatch):
    from hf_kvtransfer.commands.cli import main

    mapper = _mapper(seed=3)
    mapper.save_pretrained(tmp_path / "m")  # one file locally; the push re-saves it sharded
    repo = f"{hub_server.user}/cli-sharded-kv"
    monkeypatch.setenv("HF_TOKEN", hub_server.write_token)
    assert main(["push", str(tmp_path / "m"), repo, "--max-shard-size", "20KB"]) == 0
    pulled = resolve_mapper_dir(repo)
    assert len(weight_files(pulled)) == 3 and (pulled / INDEX_NAME).is_file()
    _assert_same(mapper, KVMapper.from_pretrained(repo))
    capsys.readouterr()
    assert main(["info", repo]) == 0
    on_disk = sum(f.stat().st_size for f in weight_files(pulled)) / 2**20
    assert f"({on_disk:.1f} MiB on disk" in capsys.readouterr().out
