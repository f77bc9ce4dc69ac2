"""mypy over the package, at the level pyproject.toml states ([tool.mypy])."""

from __future__ import annotations

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
