"""The commands under a supervisor: a hangup (terminal or ssh session closed) stops them as
SIGTERM does, flushing; a `nohup`'d one survives it; a closed stderr (`| head`, a logger gone)
neither kills the agent nor turns a clean end into status 120 without PYTHONUNBUFFERED; a
second Ctrl-C ends the demo at once as a container's PID 1 too."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from polling import wait_for

CMD = [sys.executable, "-m", "memra_obs.cli"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No PYTHONUNBUFFERED (systemd, a plain shell: stderr is buffered, not a tty)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_", "PYTHONU"))}
    env.update(MEMRA_OBS_METRICS_ADDR="", MEMRA_OBS_SPANS_FILE=str(tmp_path / "s.jsonl"))
    env.update(extra)
    return env


def _wait_for(path: Path, text: str, timeout: float = 20.0) -> None:
    wait_for(
        f"{text!r} in {path}", lambda: text in (path.read_text() if path.exists() else ""), timeout
    )


def _hangup_default() -> None:
    """A hangup's default action in the child: a suite run under `nohup` (SIGHUP ignored, and
    so inherited) made the tail keep running, as nohup asks, and the test wait for ever."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _sessions(path: Path) -> int:
    spans = [
        s
        for line in path.read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for s in ss["spans"]
    ]
    return sum(s["name"] == "spec.session" for s in spans)


def test_a_hangup_stops_the_tail_as_sigterm_does(tmp_path: Path) -> None:
    """`memra-obs tail --follow` in a closed ssh session: its open session and its queue were
    lost (SIGHUP's default action), and a follow restarts at the file's end."""
    log, err, spans = tmp_path / "w.log", tmp_path / "err", tmp_path / "spans.jsonl"
    env = _env(tmp_path, MEMRA_OBS_SINKS="", MEMRA_SPEC_TRACE="2", MEMRA_SPEC_PROF="1")
    with log.open("wb") as f:
        subprocess.run([*CMD, "demo", "--requests", "3", "--speed", "50"], env=env, stderr=f,
                       timeout=60, check=True)  # fmt: skip
    lines = log.read_bytes()
    log.write_bytes(b"")
    env = _env(tmp_path, MEMRA_OBS_SPANS_FILE=str(spans))
    with err.open("wb") as f:
        p = subprocess.Popen([*CMD, "tail", "--follow", str(log), "--worker", "w"], env=env,
                             stderr=f, preexec_fn=_hangup_default)  # fmt: skip
    try:
        _wait_for(err, "following")
        with log.open("ab") as f:
            f.write(lines)
        _wait_for(err, "demo done")  # read; its last session is open (--session-gap 1 s)
        p.send_signal(signal.SIGHUP)
        assert p.wait(30) == 0
    finally:
        p.kill()
    assert "tail: stopped:" in err.read_text()
    assert _sessions(spans) == 3


@pytest.mark.parametrize("ignored", [False, True], ids=["hangup", "nohup"])
def test_a_hangup_stops_the_agent_unless_nohup_ignored_it(tmp_path: Path, ignored: bool) -> None:
    """A hangup killed the agent (status -1, nothing flushed); under `nohup` it keeps running."""
    err = tmp_path / "err"

    def hup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN if ignored else signal.SIG_DFL)

    with err.open("wb") as f:
        p = subprocess.Popen([*CMD, "agent", "--dir", str(tmp_path / "ring")], env=_env(tmp_path),
                             stderr=f, preexec_fn=hup)  # fmt: skip
    try:
        _wait_for(err, "publishing rings")
        p.send_signal(signal.SIGHUP)
        if ignored:
            time.sleep(1.0)
            assert p.poll() is None
            p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        p.kill()
    assert "[memra-obs agent] done:" in err.read_text()


@pytest.mark.parametrize("cmd", [["agent", "--once"], ["demo", "--requests", "2", "--speed", "50"]])
def test_a_closed_stderr_is_a_clean_end_without_pythonunbuffered(
    tmp_path: Path, cmd: list[str]
) -> None:
    """The agent died at start on its first line (status 1, no agent); the demo ended 120
    (Python's exit flush of the lines its writes left buffered) unless PYTHONUNBUFFERED=1."""
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first line
    env = _env(tmp_path, MEMRA_OBS_AGENT=str(tmp_path / "ring"))
    p = subprocess.run([*CMD, *cmd], env=env, stderr=w, stdout=w, timeout=60)
    os.close(w)
    assert p.returncode == 0


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="a PID namespace needs root"
)
def test_a_second_ctrl_c_ends_the_demo_at_once_as_pid_1(tmp_path: Path) -> None:
    """`docker run -it` (the demo is the container's PID 1): the second Ctrl-C re-raised SIGINT
    with its default action, which the kernel ignores for PID 1; the demo waited out its flush
    (10 s, a collector that never answers) and ended 0."""
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(16)  # accepts, never answers
    env = _env(tmp_path, OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
               OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{sink.getsockname()[1]}")  # fmt: skip
    del env["MEMRA_OBS_SPANS_FILE"]
    ns = ["unshare", "--pid", "--fork", "--mount-proc"]
    err = tmp_path / "err"
    with err.open("wb") as f:
        p = subprocess.Popen([*ns, *CMD, "demo"], env=env, stderr=f)
    try:
        _wait_for(err, "demo: simulated worker")
        time.sleep(1.0)  # spans queued for the collector
        out = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True)
        if out.returncode:
            pytest.skip("no PID namespace here (unshare failed)")
        pid1 = int(out.stdout.split()[0])
        assert "\t1" in Path(f"/proc/{pid1}/status").read_text().split("NSpid:")[1].split("\n")[0]
        t = time.monotonic()
        os.kill(pid1, signal.SIGINT)
        time.sleep(0.5)
        os.kill(pid1, signal.SIGINT)
        p.wait(30)
        assert time.monotonic() - t < 5.0
    finally:
        p.kill()
        sink.close()
