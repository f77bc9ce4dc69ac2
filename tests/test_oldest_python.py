"""The oldest Python the package claims (``requires-python = ">=3.10"``) runs it: a 3.10
interpreter imports the core and runs the demo and the tail. 3.10 is where the regex
syntax of 3.11 (possessive quantifiers) broke every entry point at import. Skipped where no
3.10 interpreter is found (PATH, pyenv); its third-party imports come from this suite's venv
(the core's dependencies are pure Python)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python310() -> str | None:
    pyenv = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10")))
    for py in [*filter(None, [shutil.which("python3.10")]), *pyenv]:  # a pyenv shim may refuse
        check = "import sys; assert sys.version_info[:2] == (3, 10)"
        if subprocess.run([py, "-c", check], capture_output=True).returncode == 0:
            return py
    return None


def test_python_3_10_imports_the_core_and_runs_the_demo_and_the_tail(tmp_path: Path) -> None:
    py = _python310()
    if py is None:
        pytest.skip("no Python 3.10 interpreter on PATH or under ~/.pyenv")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{sysconfig.get_paths()['purelib']}"}
    env |= {"MEMRA_OBS_METRICS_ADDR": "127.0.0.1:0", "MEMRA_OBS_SPANS_FILE": str(tmp_path / "s.jsonl")}  # fmt: skip
    core = "import memra_obs, memra_obs.cli, memra_obs.legacy.parse, memra_obs.tail, memra_obs.agent.main"
    subprocess.run([py, "-c", core], env=env, check=True, timeout=60)
    log = tmp_path / "demo.err"
    demo = [py, "-m", "memra_obs", "demo", "--requests", "3", "--speed", "20", "--seed", "1"]
    with log.open("wb") as err:
        subprocess.run(
            demo, env=env, stderr=err, stdout=subprocess.DEVNULL, check=True, timeout=120
        )
    tail = subprocess.run([py, "-m", "memra_obs", "tail", str(log)], env=env, capture_output=True, check=True, timeout=120)  # fmt: skip
    end = tail.stderr.decode().splitlines()[-1]
    assert "3 sessions" in end and " 0 malformed" in end, end
