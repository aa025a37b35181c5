"""Two processes (torchrun, gloo on CPU) give the same statistics and mapper as one process."""

import os
import subprocess
import sys

import torch

from conftest import HANG_GUARD_S
from fit_fixtures import save_pair, write_corpus
from hf_kvtransfer import KVMapper, KVStatistics
from hf_kvtransfer.commands.cli import main


def test_two_ranks_equal_one(tmp_path):
    source, target = save_pair(tmp_path / "models")
    corpus = write_corpus(tmp_path / "corpus.txt", num_paragraphs=120)

    def args(output, stats):
        return [
            "fit", "--source", str(source), "--target", str(target), "--dataset", str(corpus), "--output", str(output),
            "--num-sequences", "13", "--seq-len", "32", "--batch-size", "3", "--top-k", "2",
            "--heldout-fraction", "0.3", "--stats-dir", str(stats),
        ]  # fmt: skip

    assert main(args(tmp_path / "one", tmp_path / "stats-one")) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "hf_kvtransfer.commands.cli", *args(tmp_path / "two", tmp_path / "stats-two")],
        capture_output=True, text=True, env=env, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("wrote ") == 1  # rank 0 writes, rank 1 does not
    assert "2 processes" in proc.stderr
    for part in ("train", "heldout"):
        one, two = KVStatistics.load(tmp_path / "stats-one" / part), KVStatistics.load(tmp_path / "stats-two" / part)
        # disjoint shards: the token count is that of one pass, not twice it
        assert one.count == two.count > 0
        for name in one.tensors:
            torch.testing.assert_close(two.tensors[name], one.tensors[name], rtol=1e-10, atol=1e-9)
    m1, m2 = KVMapper.from_pretrained(tmp_path / "one"), KVMapper.from_pretrained(tmp_path / "two")
    assert m1.config.selected_layers == m2.config.selected_layers
    assert m1.config.calibration == m2.config.calibration
    for name, tensor in m1.state_dict().items():
        torch.testing.assert_close(m2.state_dict()[name], tensor, rtol=1e-5, atol=1e-6)


DIRECTIONS_SCRIPT = """
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from hf_kvtransfer.fitting.calibration_pass import calibration_pass
from hf_kvtransfer.fitting.residual_stats import ResidualStatistics

source_dir, target_dir, out = sys.argv[1:4]
if "RANK" in __import__("os").environ:
    dist.init_process_group("gloo")
source, target = (AutoModelForCausalLM.from_pretrained(d) for d in (source_dir, target_dir))
ids = torch.randint(4, 60, (13, 32), generator=torch.Generator().manual_seed(0))
stats = ResidualStatistics.for_models(source, target, layers=[0, 1], lags=(0, 1), stride=1, source_features=False,
                                      directions=4)
calibration_pass(source, target, ids, consumers=[stats], progress=False, batch_size=3, num_heldout=3)
if not dist.is_initialized() or dist.get_rank() == 0:
    torch.save(stats.checkpoint_state(), out)
"""


def test_two_ranks_fix_the_residual_directions_one_does(tmp_path):
    """The residual sums through fewer directions: the directions come from the calibration sequences one
    process's first batch holds, whatever the number of ranks, so two ranks sum what one does."""
    source, target = save_pair(tmp_path / "models")
    script = tmp_path / "directions.py"
    script.write_text(DIRECTIONS_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    runs = {"one": [sys.executable, str(script)],
            "two": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]}
    for name, command in runs.items():
        proc = subprocess.run([*command, str(source), str(target), str(tmp_path / f"{name}.pt")], capture_output=True,
                              text=True, env=env, timeout=HANG_GUARD_S)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    (one, one_meta), (two, two_meta) = (torch.load(tmp_path / f"{n}.pt") for n in runs)
    assert one_meta == two_meta and set(one) == set(two) and "1.basis" in one
    for name, tensor in one.items():
        torch.testing.assert_close(two[name], tensor, rtol=1e-9, atol=1e-9)
