"""FitConfig: one grammar, one default and clear errors for every fit option, shared by Python, CLI and solve."""

import argparse
import dataclasses

import pytest
import torch

from conftest import random_ids
from hf_kvtransfer import FitConfig, fit_mapper
from hf_kvtransfer.commands.cli import build_parser, fit_config_from_args
from hf_kvtransfer.fitting.config import heldout_count, parse_rank_spec, parse_ridge_lambda, parse_top_k, resolve_config


def test_top_k_has_one_grammar():
    assert parse_top_k(8) == [8]
    assert parse_top_k("1,2,all") == [1, 2, None]
    assert parse_top_k([1, "all", "auto"]) == [1, None, "auto"]
    assert parse_top_k(None) == [None]
    assert FitConfig(top_k="1, 2,all").top_k == (1, 2, "all")
    assert FitConfig(top_k=[4, "4"]).top_k == (4,)
    assert FitConfig(top_k="auto").top_k_values == ["auto"]
    for bad in ("x", "0", -1, "1,,two", True):
        with pytest.raises(ValueError, match="top_k"):
            FitConfig(top_k=bad)


def test_one_default_everywhere():
    # Python, the fit and solve commands: k = 8, lambda = 0.01, the last 10% held out.
    config = FitConfig()
    assert (config.top_k, config.ridge_lambda, config.heldout_fraction, config.stride) == ((8,), (0.01,), 0.1, 4)
    for command in (["fit", "--source", "s", "--target", "t", "--output", "o"], ["solve", "--stats-dir", "s", "--output", "o"]):
        args = build_parser().parse_args(command)
        assert fit_config_from_args(args).replace(stats_dir=None) == config, command


def test_cli_options_are_generated_from_the_fields():
    args = build_parser().parse_args([
        "fit", "--source", "s", "--target", "t", "--output", "o", "--top-k", "1,all", "--ridge-lambda", "0.1,auto",
        "--no-refit", "--rank", "energy=0.9", "--mapper-dtype", "bfloat16", "--heldout-fraction", "0.2",
        "--no-two-stage", "--probe-tokens", "99", "--mlp-plain", "--mlp-layers", "3", "--stride", "2",
    ])  # fmt: skip
    config = fit_config_from_args(args)
    assert config.top_k == (1, "all") and config.ridge_lambda == (0.1, "auto") and config.refit is False
    assert (config.rank, config.mapper_dtype, config.heldout_fraction, config.two_stage) == ("energy=0.9", "bfloat16", 0.2, False)
    assert (config.probe_tokens, config.mlp_residual, config.mlp_num_hidden_layers, config.stride) == (99, False, 3, 2)
    # every field a person sets on the command line has an option (and nothing else is listed by hand)
    fit = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "fit")[1]
    dests = {a.dest for a in fit._actions if not isinstance(a, argparse._HelpAction)}
    fields = {f.name for f in dataclasses.fields(FitConfig) if f.metadata.get("cli") != ""}
    assert fields <= dests
    assert dests - fields == {"source", "target", "output", "dtype", "device_map", "source_revision",
                              "target_revision", "trust_remote_code", "push_to_hub", "overwrite",
                              "debug", "verbose"}  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ridge_lambda": -1}, "ridge_lambda must be >= 0"),
        ({"ridge_lambda": "abc"}, "ridge_lambda must be numbers"),
        ({"heldout_fraction": 1.0}, r"heldout_fraction must be in \[0, 1\)"),
        ({"stride": 0}, "stride must be an integer >= 1"),
        ({"seq_len": 1}, "seq_len must be an integer >= 2"),
        ({"mapper_type": "tree"}, "mapper_type must be one of"),
        ({"mapper_dtype": "int8"}, "mapper_dtype must be one of"),
        ({"rank": "energy=0.99@bf16"}, "give an integer rank, energy=F or budget=F"),
        ({"rank": "lots"}, "rank spec must be"),
        ({"rank": "16", "mapper_type": "mlp", "top_k": 2}, "a reduced rank applies to ridge mappers"),
        ({"mapper_type": "mlp", "top_k": "1,2"}, "one top_k"),
        ({"mapper_type": "mlp", "ridge_lambda": "auto"}, "one top_k"),
        ({"mapper_type": "mlp", "heldout_fraction": 0}, "set heldout_fraction above 0"),
        ({"two_stage": True, "top_k": "all"}, "needs the full statistics"),
        ({"mlp_patience": 0}, "mlp_patience must be >= 1"),
    ],
)
def test_invalid_values_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FitConfig(**kwargs)


def test_heldout_fraction_means_the_last_sequences():
    assert heldout_count(10, 0.0) == 0 and heldout_count(10, 0.25) == 2 and heldout_count(3, 0.01) == 1
    with pytest.raises(ValueError, match="leaves no sequence to fit on"):
        heldout_count(1, 0.5)


def test_rank_specs_and_lambdas():
    assert parse_rank_spec("16") == {"rank": 16}
    assert parse_rank_spec("budget=0.5@bf16") == {"size_budget": 0.5, "dtype": torch.bfloat16}
    assert parse_rank_spec("full") == {}
    assert FitConfig(rank=16).rank_kwargs == {"rank": 16}
    assert parse_ridge_lambda("0.01,auto,0.01") == [0.01, "auto"]
    assert FitConfig(ridge_lambda="auto").probe_lambdas == [1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0]
    assert FitConfig(ridge_lambda="0.5,auto").probe_lambdas == [0.5]


def test_keyword_overrides_map_onto_the_config():
    base = FitConfig(top_k=4, stride=2)
    config, rest = resolve_config(base, {"ridge_lambda": 1.0, "epochs": 3, "statistics_dir": "s", "source_model_id": "x"})
    assert (config.top_k, config.stride, config.ridge_lambda, config.mlp_epochs, config.stats_dir) == ((4,), 2, (1.0,), 3, "s")
    assert rest == {"source_model_id": "x"} and base.ridge_lambda == (0.01,)  # the base is never changed
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.top_k = 2


def test_fit_mapper_takes_a_config_plus_overrides(linear_models):
    source, target, true_source_of = linear_models
    ids = random_ids(8, 32, seed=1)
    via_config = fit_mapper(source, target, ids, FitConfig(top_k=1, heldout_fraction=0, progress=False))
    via_keywords = fit_mapper(source, target, ids, top_k=1, heldout_fraction=0, progress=False)
    assert via_config.config.selected_layers == via_keywords.config.selected_layers
    for name, tensor in via_config.state_dict().items():
        assert torch.equal(via_keywords.state_dict()[name], tensor)
    with pytest.raises(TypeError, match="unknown keyword argument"):
        fit_mapper(source, target, ids, top_k=1, tok_k=2)


def test_one_statistics_budget_rule():
    """Both kinds of the fit's sums take `max_statistics_memory` together when given; else the K/V sums half the free memory and
    the residual sums the fixed default (`fitting/budget.py`), which `FitConfig` validates the same way."""
    from hf_kvtransfer.fitting.budget import RESIDUAL_STATISTICS_BYTES, statistics_budget

    free = statistics_budget(None, free_bytes=10 * 2**30)
    assert (free.kv_bytes, free.residual_bytes, free.given) == (5 * 2**30, RESIDUAL_STATISTICS_BYTES, False)
    assert "half the free memory" in free.describe("kv") and "5 GiB" in free.describe("kv")
    given = statistics_budget(2.5, free_bytes=10 * 2**30)
    assert (given.kv_bytes, given.residual_bytes, given.given) == (int(2.5 * 2**30),) * 2 + (True,)
    assert given.describe("residual") == "the budget of 2.5 GiB (--max-statistics-memory)"
    # One total where both kinds live on the CPU: the residual sums get what the K/V sums leave; on a GPU the K/V sums
    # take the GPU's memory and the residual sums keep the whole budget; the defaults are two budgets.
    shared = given.after_kv(2**30, "cpu")
    assert (shared.kv_bytes, shared.residual_bytes) == (int(2.5 * 2**30), int(1.5 * 2**30))
    assert shared.describe("residual") == ("the budget of 1.5 GiB (what the K/V sums' 1 GiB leave of "
                                           "--max-statistics-memory 2.5 GiB)")  # fmt: skip
    assert given.after_kv(3 * 2**30, "cpu").residual_bytes == 0
    assert given.after_kv(2**30, "cuda:0") == given and free.after_kv(2**30, "cpu") == free
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="max_statistics_memory must be > 0 GiB"):
            statistics_budget(bad)
        with pytest.raises(ValueError, match="max_statistics_memory must be > 0 GiB"):
            FitConfig(max_statistics_memory=bad)
