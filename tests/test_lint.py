"""The tree stays ruff-clean (lint and format), as CI checks it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["memra_obs", "tests", "bench", "grafana", "deploy"]


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (pip install -e .[dev])")
    return [exe]


def test_ruff_check_is_clean():
    """No lint findings anywhere in the tree."""
    r = subprocess.run([*_ruff(), "check", *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_is_clean():
    """Every file is as the formatter leaves it."""
    r = subprocess.run(
        [*_ruff(), "format", "--check", *PATHS], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_test_the_readme_names_exists():
    """The README's promises name the tests that hold them: a renamed or deleted test must not
    leave a promise pointing at nothing."""
    import re

    refs = set(re.findall(r"(tests/[\w/]+\.py)::(\w+)", (ROOT / "README.md").read_text()))
    assert len(refs) > 50
    missing = [
        f"{path}::{name}"
        for path, name in sorted(refs)
        if not (ROOT / path).is_file()
        or not re.search(rf"^\s*(?:async )?def {name}\(", (ROOT / path).read_text(), re.M)
    ]
    assert not missing, missing
