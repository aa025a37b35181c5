"""Every research script (`research/*/*.py`) answers `--help` with exit status 0 and shows an example command.

All scripts run in ONE subprocess (one torch import; a script's monkeypatching stays out of this process), each as
`python research/<dir>/<file>.py --help` would run it: `runpy.run_path(..., run_name="__main__")`, its folder first on
`sys.path`, from a temporary folder (so `--help` does not depend on the current directory)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(REPO.glob("research/*/*.py"))

_DRIVER = r"""
import contextlib, io, json, runpy, sys
out_path, paths = sys.argv[1], sys.argv[2:]
report = {}
for path in paths:
    folder = path.rsplit("/", 1)[0]
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [path, "--help"]
    sys.path.insert(0, folder)
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException as error:  # a script that crashes instead of printing its help
        code, err = 1, io.StringIO(err.getvalue() + f"{type(error).__name__}: {error}")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    report[path] = {"code": code, "out": out.getvalue(), "err": err.getvalue()[-2000:]}
with open(out_path, "w") as f:
    json.dump(report, f)
"""


def _has_example(text: str) -> bool:
    """A `python research/...` command, or a line that is an `hf-kvtransfer ...` command (a script that wraps one):
    prose naming a subcommand (`hf-kvtransfer eval` scores ...) is no example."""
    return "python research/" in text or any(line.strip().startswith("hf-kvtransfer ") for line in text.splitlines())


def test_every_research_script_answers_help_with_an_example(tmp_path):
    assert len(SCRIPTS) >= 40, SCRIPTS  # the glob found the scripts
    report_path = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env.setdefault("OMP_NUM_THREADS", "1")
    work = tmp_path / "cwd"
    work.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(report_path), *map(str, SCRIPTS)],
        capture_output=True, text=True, cwd=work, env=env, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert done.returncode == 0 and report_path.exists(), done.stderr[-4000:]
    report = json.loads(report_path.read_text())
    problems = {}
    for path in SCRIPTS:
        entry = report[str(path)]
        name = str(path.relative_to(REPO))
        if entry["code"] != 0:
            problems[name] = f"exit {entry['code']}: {entry['err'][-500:]}"
        elif not _has_example(entry["out"]):
            problems[name] = "no example command (`python research/...` or `hf-kvtransfer ...`) in --help"
    assert not problems, "\n".join(f"{name}: {why}" for name, why in problems.items())
