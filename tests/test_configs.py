"""Shipped architecture facts of real families, and `load_model_config`'s order: local -> Hub -> shipped."""

import json

import pytest
import torch
from huggingface_hub import HfApi
from transformers import AutoConfig, AutoModelForCausalLM

from hf_kvtransfer.commands import model_configs as configs
from hf_kvtransfer.commands.model_configs import known_config_dict, known_model_ids, load_model_config
from hf_kvtransfer.core.rope import build_rotary_embedding, head_dim_of

EXPECTED_IDS = {
    *(f"Qwen/Qwen3-{s}" for s in ("0.6B", "1.7B", "4B", "8B", "14B", "32B")),
    *(f"Qwen/Qwen2.5-{s}" for s in ("0.5B", "1.5B", "3B", "7B", "14B", "32B", "72B")),
    "meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B",
    "mistralai/Mistral-7B-v0.3", "mistralai/Ministral-8B-Instruct-2410",
}  # fmt: skip

# Facts quoted from the published config.json files (written out here, not read from the shipped files).
PUBLISHED = {
    # id: (layers, hidden, heads, kv heads, head_dim, rope_theta, max positions, tied, vocab)
    "Qwen/Qwen3-0.6B": (28, 1024, 16, 8, 128, 1e6, 40960, True, 151936),
    "Qwen/Qwen3-32B": (64, 5120, 64, 8, 128, 1e6, 40960, False, 151936),
    "Qwen/Qwen2.5-0.5B": (24, 896, 14, 2, 64, 1e6, 32768, True, 151936),
    "Qwen/Qwen2.5-7B": (28, 3584, 28, 4, 128, 1e6, 131072, False, 152064),
    "meta-llama/Llama-3.2-1B": (16, 2048, 32, 8, 64, 5e5, 131072, True, 128256),
    "meta-llama/Llama-3.2-3B": (28, 3072, 24, 8, 128, 5e5, 131072, True, 128256),
    "meta-llama/Llama-3.1-70B": (80, 8192, 64, 8, 128, 5e5, 131072, False, 128256),
    "mistralai/Mistral-7B-v0.3": (32, 4096, 32, 8, 128, 1e6, 32768, False, 32768),
}


def test_the_families_asked_for_are_shipped():
    assert EXPECTED_IDS <= set(known_model_ids())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_facts(name):
    config = load_model_config(name, use_hub=False)
    layers, hidden, heads, kv, head_dim, theta, max_pos, tied, vocab = PUBLISHED[name]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (layers, hidden, heads)
    assert (config.num_key_value_heads, head_dim_of(config), config.rope_parameters["rope_theta"]) == (kv, head_dim, theta)
    assert (config.max_position_embeddings, config.tie_word_embeddings, config.vocab_size) == (max_pos, tied, vocab)
    assert config._name_or_path == name


def test_llama3_rope_scaling():
    for name, factor in (("meta-llama/Llama-3.2-1B", 32.0), ("meta-llama/Llama-3.1-8B", 8.0)):
        rope = load_model_config(name, use_hub=False).rope_parameters
        assert rope["rope_type"] == "llama3" and rope["factor"] == factor
        assert rope["original_max_position_embeddings"] == 8192 and rope["low_freq_factor"] == 1.0


def _tiny_with_same_ratios(config):
    """The architecture at toy size: same model_type, RoPE, head ratios (q per KV head), hidden / (heads x head_dim)
    and MLP ratios, 2 layers."""
    data = config.to_dict()
    group = config.num_attention_heads // config.num_key_value_heads
    head_dim = 16
    kv = 2
    q_dim_ratio = config.num_attention_heads * head_dim_of(config) / config.hidden_size
    hidden = int(round(group * kv * head_dim / q_dim_ratio))
    data.update(
        num_hidden_layers=2, num_key_value_heads=kv, num_attention_heads=group * kv, head_dim=head_dim,
        hidden_size=hidden, intermediate_size=int(round(hidden * config.intermediate_size / config.hidden_size)),
        vocab_size=128, max_window_layers=2, layer_types=None, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model_type = data.pop("model_type")
    return AutoConfig.for_model(model_type, **data)


@pytest.mark.parametrize("name", sorted(EXPECTED_IDS))
def test_builds_rotary_and_a_tiny_model_with_its_ratios_runs(name):
    config = load_model_config(name, use_hub=False)
    rotary = build_rotary_embedding(config)  # the real-size rotary module (RoPE type, scaling) builds
    assert rotary.inv_freq.numel() == head_dim_of(config) // 2
    tiny = _tiny_with_same_ratios(config)
    assert tiny.model_type == config.model_type and tiny.rope_parameters == config.rope_parameters
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny).eval()
    with torch.no_grad():
        out = model(torch.randint(3, 128, (1, 12)))
    assert out.logits.shape == (1, 12, 128) and torch.isfinite(out.logits).all()
    assert out.past_key_values.layers[0].keys.shape == (1, 2, 12, 16)


def test_variant_suffix_maps_to_the_base_architecture():
    assert known_config_dict("qwen/qwen2.5-7b-instruct")["num_hidden_layers"] == 28
    assert known_config_dict("Qwen/Qwen3-8B-Base")["hidden_size"] == 4096
    assert known_config_dict("someone/unknown-model") is None


def test_local_directory_and_file_come_first(tmp_path):
    data = {**known_config_dict("Qwen/Qwen3-0.6B"), "num_hidden_layers": 3}
    folder = tmp_path / "Qwen" / "Qwen3-0.6B"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(data))
    assert load_model_config(folder).num_hidden_layers == 3
    assert load_model_config(folder / "config.json").num_hidden_layers == 3
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model_config(str(tmp_path / "missing.json"))


def test_retry_waits_sees_huggingface_hubs_retries(unreachable_hub, retry_waits):
    # What the checks of "no retries" rely on: a retry's back-off is recorded (and not slept).
    from huggingface_hub.utils import http_backoff

    with pytest.raises(Exception):
        http_backoff("GET", f"{unreachable_hub}/api/models/someone/model", max_retries=2, base_wait_time=1)
    assert retry_waits == [1, 2]


def test_unreachable_hub_falls_back_to_the_shipped_config_fast(unreachable_hub, retry_waits):
    config = load_model_config("Qwen/Qwen3-1.7B")
    assert retry_waits == []  # no ~30 s of huggingface_hub retries (counted, not timed: a busy machine is slow)
    assert config.hidden_size == 2048
    with pytest.raises(OSError, match="someone/not-shipped"):
        load_model_config("someone/not-shipped", use_hub=False)


def test_hub_is_asked_before_the_shipped_config(hub_server, monkeypatch):
    repo = f"{hub_server.user}/Qwen3-0.6B"
    api = HfApi(token=hub_server.write_token)
    api.create_repo(repo)
    hub_data = {**known_config_dict("Qwen/Qwen3-0.6B"), "num_hidden_layers": 5}
    api.upload_file(path_or_fileobj=json.dumps(hub_data).encode(), path_in_repo="config.json", repo_id=repo)
    # Pretend the package ships a config for this id (28 layers): the Hub's (5 layers) must win while it answers.
    index = {**configs._known_index(), repo.lower(): "Qwen--Qwen3-0.6B.json"}
    monkeypatch.setattr(configs, "_known_index", lambda: index)
    configs._endpoint_reachable.cache_clear()
    assert load_model_config(repo, token=hub_server.write_token).num_hidden_layers == 5
    hub_server.stop()
    configs._endpoint_reachable.cache_clear()
    assert load_model_config(repo).num_hidden_layers == 28
    configs._endpoint_reachable.cache_clear()
