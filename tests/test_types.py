"""mypy over the package, at the level pyproject.toml states ([tool.mypy])."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_is_clean() -> None:
    """No type errors anywhere in memra_obs/ (every function body checked)."""
    p = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]


def test_users_type_checkers_read_the_annotations(tmp_path: Path) -> None:
    """PEP 561: installed (here: on PYTHONPATH, as mypy treats site-packages), the package
    carries py.typed, so a user's mypy checks calls against its signatures."""
    assert 'memra_obs = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()  # in the wheel
    shutil.copytree(ROOT / "memra_obs", tmp_path / "lib" / "memra_obs")
    (tmp_path / "user.py").write_text("import memra_obs\n\nx: str = memra_obs.configure\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    env.pop("MYPYPATH", None)
    p = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-error-summary",
                        "--cache-dir", str(tmp_path / "cache"), "user.py"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert "user.py:3: error: Incompatible types in assignment" in p.stdout, p.stdout
    assert "import-untyped" not in p.stdout


_USER_LOOP = """\
import time
from typing import Any

import memra_obs
from memra_obs.observer import Burst, NoOpBurst, NoOpObserver, NoOpSession, Observer, Session
from memra_obs.testing import RecordingSink, capture
from memra_obs.timeline import RoundRecord


def rounds(b: Burst | NoOpBurst, k: int) -> None:
    b.begin_round()
    b.end_draft()
    t0 = time.perf_counter()
    memra_obs.VERIFY_SPLIT.add(kda=(time.perf_counter() - t0) * 1e9)
    b.end_verify()
    b.end_accept()
    b.end_rollback()
    b.end_round(k=k, j=1, ctx=8)


def prime(s: Session | NoOpSession) -> float:
    return s.lap("prime")


def serve(obs: Observer | NoOpObserver) -> dict[str, Any]:
    with obs.session("glm5") as s:
        prime(s)
        with s.burst(4) as b:
            rounds(b, 4)
        return s.spec_decode()


with capture() as cap:
    serve(cap.observer)
serve(memra_obs.get_observer())
not_any: str = RecordingSink().of(RoundRecord)[0]
"""


def test_a_users_loop_and_the_readme_snippets_type_check_strict(tmp_path: Path) -> None:
    """A user's ``mypy --strict`` over a loop whose helpers take what ``session()`` and
    ``burst()`` return (public names: ``NoOpSession``, ``NoOpBurst``), adding float ns to
    ``VERIFY_SPLIT`` (as the README promises it takes), and over the README's ``python`` blocks
    (the names they leave to the reader aside): the one error is the one planted."""
    shutil.copytree(ROOT / "memra_obs", tmp_path / "lib" / "memra_obs")
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    for i, block in enumerate(blocks):
        (tmp_path / f"readme_{i}.py").write_text(block)
    (tmp_path / "user.py").write_text(_USER_LOOP)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    env.pop("MYPYPATH", None)
    files = ["user.py", *(f"readme_{i}.py" for i in range(len(blocks)))]
    p = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-error-summary",
                        "--cache-dir", str(tmp_path / "cache"), *files], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    errors = [x for x in p.stdout.splitlines() if ": error:" in x and "[name-defined]" not in x]
    planted = len(_USER_LOOP.splitlines())  # not_any: a RoundRecord, not Any
    assert len(blocks) >= 5 and [e.split(": error:")[0] for e in errors] == [
        f"user.py:{planted}"
    ], p.stdout
