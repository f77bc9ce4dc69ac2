"""Fixtures of the peer tests: the binaries scripts/peers.sh built (Jaeger v2, the
OpenTelemetry Collector, Prometheus 3), each started on free 127.0.0.1 ports and always
ended.

Without them (no Go toolchain, or the build did not run or failed) every peer test skips
with one reason; with ``MEMRA_OBS_REQUIRE_PEERS=1`` (.ci/run sets it) that skip is a failure
instead, so CI cannot pass without the peers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from peerlib import ROOT, Jaeger, Procs

REQUIRE = "MEMRA_OBS_REQUIRE_PEERS"
PEERS_SH = ROOT / "scripts" / "peers.sh"


def _locate() -> tuple[dict[str, str], str | None]:
    """The built binaries (name -> path) and, when any is missing, why."""
    if shutil.which("go") is None:
        return {}, (
            "no Go toolchain on PATH: the peer tests run Jaeger v2, the OpenTelemetry "
            "Collector and Prometheus 3 built from source by scripts/peers.sh (needs Go 1.26)"
        )
    r = subprocess.run(
        ["bash", str(PEERS_SH), "--check"], capture_output=True, text=True, timeout=60
    )
    bins = dict(ln.split("=", 1) for ln in r.stdout.splitlines() if "=" in ln)
    if r.returncode != 0:
        return bins, (
            "the peers are not built (run: bash scripts/peers.sh; scripts/test.sh does): "
            + " ".join(r.stderr.split())
        )
    return bins, None


@pytest.fixture(scope="session")
def peer_bins() -> dict[str, str]:
    """name -> path of each peer binary; skips (fails under MEMRA_OBS_REQUIRE_PEERS=1)
    when they are not there."""
    bins, why = _locate()
    if why is not None:
        if os.environ.get(REQUIRE, "") not in ("", "0"):
            pytest.fail(f"{REQUIRE}=1 and {why}", pytrace=False)
        pytest.skip(why)
    return bins


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    """Every child process of one test, ended at its end whatever happened."""
    ps = Procs(tmp_path)
    try:
        yield ps
    finally:
        ps.close()


@pytest.fixture
def jaeger(peer_bins: dict[str, str], procs: Procs) -> Jaeger:
    """A running Jaeger v2 on free ports (memory storage: empty at each test)."""
    return Jaeger(peer_bins["jaeger"], procs).start()
