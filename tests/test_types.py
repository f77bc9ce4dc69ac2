"""mypy over the package, at the level pyproject.toml states ([tool.mypy])."""

from __future__ import annotations

import os
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
