"""research/family_builder/train_deep.py: a run interrupted and resumed gives the weights of an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "research" / "family_builder" / "train_deep.py"
TOKENIZER = ROOT / "examples" / "family" / "tokenizer"
HELDOUT = ROOT / "examples" / "family" / "heldout.txt"


@pytest.fixture(scope="module")
def train_deep():
    if not (TOKENIZER / "tokenizer.json").is_file() or not HELDOUT.is_file():
        pytest.skip("examples/family (tokenizer, heldout.txt) is missing")
    return load_script(SCRIPT)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """A tiny stand-in for the Python docs: 10 *.rst.txt files cut from the bundled held-out text."""
    root = tmp_path_factory.mktemp("sources")
    text = HELDOUT.read_text(encoding="utf-8")
    chunk = len(text) // 10
    for i in range(10):
        (root / f"doc{i:02d}.rst.txt").write_text(text[i * chunk : (i + 1) * chunk], encoding="utf-8")
    return root


def _run(train_deep, sources: Path, out: Path, *extra: str) -> None:
    # 8 steps: copy phase (short rows) for 4, the previous-token fallback from step 2 (eager attention), then the
    # full mix (every row kind), so a resume crosses both phases and the fallback's switch.
    argv = ["--run-dir", str(out / "run"), "--export-dir", str(out / "export"), "--models", "tiny",
            "--sources-dir", str(sources), "--tokenizer", str(TOKENIZER), "--heldout-every", "5", "--steps", "8",
            "--copy-phase", "0.5", "--prev-token-fallback", "0.5", "--seq-len", "256", "--batch-size", "5",
            "--copy-batch-size", "4", "--probe-every", "0", "--probe-items", "2", "--heldout-windows", "2",
            "--calibration-kb", "8", "--sample-kb", "8", "--log-every", "100", *extra]
    assert train_deep.main(argv) == 0


def _weights(out: Path) -> dict:
    import torch

    return torch.load(out / "run" / "tiny" / "checkpoint.pt", weights_only=False)["model"]


@pytest.mark.slow
def test_interrupted_and_resumed_run_matches_an_uninterrupted_one(train_deep, sources, tmp_path):
    import torch
    from safetensors.torch import load_file

    _run(train_deep, sources, tmp_path / "whole")
    _run(train_deep, sources, tmp_path / "split", "--stop-after", "3")
    assert not (tmp_path / "split" / "run" / "tiny" / "done.json").exists()
    assert not any(torch.equal(a, b) for k, (a, b) in enumerate(zip(_weights(tmp_path / "split").values(),
                                                                      _weights(tmp_path / "whole").values()))
                   if a.dim() >= 2)  # stopped early: different weights
    _run(train_deep, sources, tmp_path / "split")
    whole, split = _weights(tmp_path / "whole"), _weights(tmp_path / "split")
    assert whole.keys() == split.keys()
    for name in whole:
        assert torch.equal(whole[name], split[name]), name
    exported = [load_file(tmp_path / d / "export" / "tiny" / "model.safetensors") for d in ("whole", "split")]
    assert all(torch.equal(exported[0][k], exported[1][k]) for k in exported[0])
    log = (tmp_path / "split" / "run" / "train_log.txt").read_text()
    assert "resumed from" in log and "previous-token loss on layer 0 / head 0 switched on" in log
    # a finished model is skipped on the next call
    _run(train_deep, sources, tmp_path / "split")
    assert "already done" in (tmp_path / "split" / "run" / "train_log.txt").read_text()


def test_a_snapshot_exports_the_checkpoint_of_a_run_still_in_progress(train_deep, sources, tmp_path):
    """`--snapshot DIR`: the latest checkpoint's weights, loadable as a model, and the run left to resume as it was."""
    import torch
    from transformers import AutoModelForCausalLM

    _run(train_deep, sources, tmp_path, "--stop-after", "2")
    ckpt = tmp_path / "run" / "tiny" / "checkpoint.pt"
    before = ckpt.read_bytes()
    _run(train_deep, sources, tmp_path, "--snapshot", str(tmp_path / "snap"))
    assert ckpt.read_bytes() == before and not (tmp_path / "run" / "tiny" / "done.json").exists()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "snap" / "tiny")
    saved = model.state_dict()
    for name, weight in _weights(tmp_path).items():  # the checkpoint's fp32 weights, rounded as the export rounds them
        assert torch.equal(saved[name].to(torch.bfloat16), weight.to(torch.bfloat16)), name
    assert '"step": 2' in (tmp_path / "snap" / "tiny" / "snapshot.json").read_text()


@pytest.mark.parametrize("layer", [0, 2])
def test_the_previous_token_loss_pins_the_layer_asked_for(train_deep, layer):
    """`--prev-token-layer L`: the auxiliary term reaches layer L's attention and no layer after it (a layer after L
    cannot change L's attention pattern), which is what lets it put the copying head deeper."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).float()
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, 64, (2, 17))

    def grads(weight: float) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        train_deep.tf.train_loss(model, ids, ids.clone(), weight, layer)[0].backward()
        return [model.model.layers[i].self_attn.q_proj.weight.grad.clone() for i in range(4)]

    plain, pinned = grads(0.0), grads(10.0)
    moved = [not torch.allclose(a, b, atol=1e-7) for a, b in zip(plain, pinned)]
    assert moved[layer] and not any(moved[layer + 1 :]), moved


def test_a_layer_the_model_does_not_have_is_refused_in_one_line(train_deep, tmp_path):
    """`--prev-token-layer` past the last layer stops before any training, naming the range to choose from."""
    with pytest.raises(SystemExit) as stop:
        train_deep.main(["--models", "tiny", "--prev-token-layer", "2", "--run-dir", str(tmp_path / "run")])
    assert str(stop.value) == "--prev-token-layer 2 is not a layer of ['tiny']: choose 0 to 1"
    assert not (tmp_path / "run" / "tiny").exists()
