"""research/content_at_speed/real_width.py: the mappers it writes for timing at a real width have the configuration
the fit chose on the deep pair (read here from that fit's saved config), and the target generates through them."""

import json
from pathlib import Path

import pytest
import torch
from conftest import load_script
from transformers import AutoModelForCausalLM

from hf_kvtransfer import KVMapper, TransferredCache, prefill

ROOT = Path(__file__).resolve().parents[1]
DEEP_DEFAULT = ROOT / "research/family_builder/results/deep_pair/mapper_config_window_source_to_target.json"
TINY_TARGET = dict(num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)  # fmt: skip
TINY_SOURCE = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    module = load_script(ROOT / "research/content_at_speed/real_width.py")
    out = tmp_path_factory.mktemp("wide")
    folders = module.build(out, TINY_TARGET, TINY_SOURCE, ranks=("full", "share", "7"), rows=4)
    return out, folders


def test_mappers_have_the_deep_defaults_configuration(built):
    out, folders = built
    deep = json.loads(DEEP_DEFAULT.read_text())
    residual = deep["map_inputs"]["residual"]
    share = residual["rank"] / (len(residual["lags"]) * deep["target_config"]["hidden_size"])
    features = len(residual["lags"]) * TINY_TARGET["hidden_size"]
    assert [f.name for f in folders] == ["mapper_full", f"mapper_rank_{round(share * features)}", "mapper_rank_7"]
    for folder, rank in zip(folders, (None, round(share * features), 7)):
        config = json.loads((folder / "config.json").read_text())
        assert config["num_exact_layers"] == deep["num_exact_layers"]
        assert config["exact_window"] == deep["exact_window"]
        assert config["num_recompute_tokens"] == deep["num_recompute_tokens"]
        assert set(config["map_inputs"]) == set(deep["map_inputs"])
        got = config["map_inputs"]["residual"]
        assert (got["layer"], got["lags"], got["readers"], got["rank"]) == (
            residual["layer"], residual["lags"], residual["readers"], rank)  # fmt: skip
        mapped = config["selected_layers"][residual["layer"] + 1 :]
        assert mapped == [[]] * (TINY_TARGET["num_hidden_layers"] - residual["layer"] - 1)  # no source K/V read


def test_the_target_generates_through_them(built):
    out, folders = built
    source, target = (AutoModelForCausalLM.from_pretrained(out / name, dtype=torch.float32).eval() for name in ("source", "target"))
    assert (out / "heldout.txt").is_file()  # what time_split.py reads
    ids = torch.randint(100, (1, 300), generator=torch.Generator().manual_seed(0))
    for folder in folders:
        mapper = KVMapper.from_pretrained(folder)
        cache = TransferredCache(prefill(source, ids), mapper, model=target)
        out_ids = target.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
        assert out_ids.shape == (1, 303) and cache.num_exact_layers == mapper.num_exact_layers
