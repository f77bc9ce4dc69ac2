"""The optional C helpers (setup.py) are built wherever a C compiler and Python's headers are
(CI has both): without them every result is the same, but ``memra-obs tail`` runs ~1.9x
slower, so an install that silently lacks them is a failure here."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

from memra_obs.prom import model
from memra_obs.tail import core


def test_the_c_helpers_are_built_where_a_compiler_is():
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not (shutil.which("cc") or shutil.which("gcc")) or not headers.exists():
        pytest.skip("no C compiler or no Python headers here: the pure-Python paths are used")
    assert core.C_SCAN is not None, "memra_obs.tail._scan was not built: pip install -e . again"
    assert model.C_COUNT is not None, "memra_obs.prom._hist was not built: pip install -e ."
