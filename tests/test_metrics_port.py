"""Issue 13: a busy /metrics port (the second worker on a host, default address). A library
observer says one line naming the address and MEMRA_OBS_METRICS_ADDR and keeps working without
/metrics, leaving no thread behind; a CLI command exits 2 with that one line."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from forked import in_child
from prometheus_client import CollectorRegistry, generate_latest

from memra_obs import diagnostics
from memra_obs.environment import ConfigError, Settings
from memra_obs.prom import exporter as prom_exporter
from memra_obs.wiring import build_exporters, build_observer

ROOT = Path(__file__).resolve().parent.parent


def busy_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s, s.getsockname()[1]


@pytest.mark.parametrize("by", ["argument", "environment"])
def test_a_library_observer_says_it_once_and_carries_on(caplog, by):
    """Said once, naming what set the address: ``configure(metrics_addr=...)`` overrides the
    variable, so a message naming the variable sent the user to a setting that changes nothing."""
    s, port = busy_port()
    addr = f"127.0.0.1:{port}"
    env, arg = ({"MEMRA_OBS_METRICS_ADDR": addr}, None) if by == "environment" else ({}, addr)
    try:
        before = threading.active_count()
        with caplog.at_level(logging.WARNING, logger="memra_obs"):
            obs = build_observer(
                level=1, prof=False, env=env, registry=CollectorRegistry(), sinks="prometheus",
                metrics_addr=arg,
            )  # fmt: skip
            try:
                with obs.session("glm5") as sess, sess.burst(4) as b:
                    b.begin_round()
                    for end in (b.end_draft, b.end_verify, b.end_accept, b.end_rollback):
                        end()
                    b.end_round(k=4, j=2)
                assert not any(w.startswith("/metrics on ") for w in obs.where)
            finally:
                obs.shutdown()
        said = [r.getMessage() for r in caplog.records if "cannot serve /metrics" in r.getMessage()]
        assert len(said) == 1
        name = "argument metrics_addr" if by == "argument" else "MEMRA_OBS_METRICS_ADDR"
        assert said[0].startswith(f"{name}={addr}: cannot serve") and "agent" in said[0]
        assert threading.active_count() <= before
    finally:
        s.close()


def test_a_refused_build_leaves_nothing_in_the_registry():
    """A /metrics port the CLI cannot bind (strict) refuses the build, and the exporter made
    before it goes from the registry too: a retry got a "takes its names over" warning."""
    sock, port = busy_port()
    reg = CollectorRegistry()
    st = Settings.resolve({}, sinks="prometheus", metrics_addr=f"127.0.0.1:{port}")
    with sock, pytest.raises(ConfigError):
        build_exporters(st, registry=reg, strict=True)
    assert b"memra_" not in generate_latest(reg)


@pytest.mark.parametrize("fails", ["Observer", "QueueSink"])
def test_an_observer_that_cannot_be_made_leaves_nothing_running(monkeypatch, tmp_path, fails):
    """A thread refused (a container's pids limit: ``RuntimeError: can't start new thread``,
    the export queue's thread first) made ``configure()`` raise with its /metrics server, span
    file writer and export thread left running, its names in the registry: a retry found its
    own port taken, or was told it "takes the names over". What was built is undone."""
    from memra_obs import wiring

    def refused(*a: object, **kw: object) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(wiring, fails, refused)
    before = {t.ident for t in threading.enumerate()}
    reg = CollectorRegistry()
    with pytest.raises(RuntimeError):
        build_observer(level=1, prof=False, env={}, registry=reg, sinks="prometheus,otel",
                       metrics_addr="127.0.0.1:0", spans_file=str(tmp_path / "s.jsonl"),
                       requests_file=str(tmp_path / "r.jsonl"))  # fmt: skip
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert left == [] and b"memra_" not in generate_latest(reg)


def test_a_refused_build_in_agent_mode_leaves_no_live_ring(tmp_path):
    """Agent mode with a knob refused after the ring was made (a requests file it cannot
    write): the ring kept its lock, and the agent took the worker for a live one."""
    import fcntl

    with pytest.raises(ConfigError):
        build_observer(level=1, prof=False, env={}, agent=str(tmp_path / "rings"),
                       sinks="prometheus", requests_file=str(tmp_path / "no" / "r.jsonl"))  # fmt: skip
    (ring,) = (tmp_path / "rings").glob("*.ring")
    with open(ring, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no live writer holds it


def test_the_cli_exits_2_with_one_line():
    s, port = busy_port()
    try:
        env = {**os.environ, "MEMRA_OBS_METRICS_ADDR": f"127.0.0.1:{port}", "PYTHONPATH": str(ROOT)}
        p = subprocess.run(
            [sys.executable, "-m", "memra_obs.cli", "demo", "--requests", "1"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        s.close()
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "MEMRA_OBS_METRICS_ADDR" in lines[0]


def test_a_busy_port_for_the_agent_or_the_tail_is_not_answered_with_agent_mode(tmp_path):
    """``memra-obs agent`` and ``memra-obs tail`` on a busy port were told "several workers on
    one host: agent mode (MEMRA_OBS_AGENT) or one port per rank": the agent is agent mode. They
    are told to set another port (or port 0); a worker keeps its hint (the test above)."""
    s, port = busy_port()
    (tmp_path / "w.err").write_text("")
    env = {**os.environ, "MEMRA_OBS_METRICS_ADDR": f"127.0.0.1:{port}", "PYTHONPATH": str(ROOT)}
    try:
        for cmd in (
            ["agent", "--dir", str(tmp_path / "r"), "--once"],
            ["tail", str(tmp_path / "w.err")],
        ):
            p = subprocess.run([sys.executable, "-m", "memra_obs.cli", *cmd], env=env,
                               capture_output=True, text=True, timeout=60)  # fmt: skip
            assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
            assert "set MEMRA_OBS_METRICS_ADDR to another port, or port 0" in p.stderr
            assert "agent mode" not in p.stderr and "per rank" not in p.stderr
    finally:
        s.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_of_a_serving_observer_says_it_once(monkeypatch):
    """A child forked from a process that serves /metrics (gunicorn --preload, multiprocessing
    'fork') publishes into an exporter nobody serves: it says so once, pointing to agent mode,
    at its first records (a ``subprocess`` child between fork and exec was told so too); a
    parent that serves nothing gives its children nothing to say."""
    said: list[str] = []
    monkeypatch.setattr(prom_exporter, "say_once", lambda key, msg, kind="": said.append(msg))
    for addr in ("127.0.0.1:0", ""):
        obs = build_observer(
            level=0, prof=False, env={}, registry=CollectorRegistry(), sinks="prometheus",
            metrics_addr=addr,
        )  # fmt: skip

        def records(obs=obs) -> bytes:  # (bound: the loop goes on)
            quiet = "\n".join(said)  # a child that records nothing serves no one: nothing said
            with obs.session("glm5") as s, s.burst(4) as b:
                b.begin_round()
                b.end_round(k=4, j=1)
            obs.flush()
            return ("\n".join(said) if not quiet else "said at the fork: " + quiet).encode()

        try:
            got = in_child(records).decode()
        finally:
            obs.shutdown()
        if addr:
            url = next(w for w in obs.where if w.startswith("/metrics on "))
            port = url.rsplit(":", 1)[1].split("/")[0]
            assert got.count("\n") == 0 and "cannot serve /metrics" in got
            assert got.startswith(f"argument metrics_addr=127.0.0.1:{port}: a forked")
            assert "MEMRA_OBS_AGENT" in got and "one port per rank" in got
        else:
            assert got == ""
    assert said == []  # the parent says nothing


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_leaves_the_port_to_its_parent():
    """The child kept the parent's listening socket open: once the parent closed its server (a
    configure(), its end), scrapes hung instead of being refused, and the parent could not
    serve on its port again until every child had exited."""
    import socket
    import time

    from memra_obs.prom import serve_metrics

    srv = serve_metrics(("127.0.0.1", 0), registry=CollectorRegistry())
    port = srv.port
    pid = os.fork()
    if pid == 0:  # a worker that lives on
        time.sleep(5)
        os._exit(0)
    try:
        srv.close()
        with (
            pytest.raises(ConnectionRefusedError),
            socket.create_connection(("127.0.0.1", port), 2),
        ):
            pass
        with serve_metrics(("127.0.0.1", port), registry=CollectorRegistry()) as again:
            assert again.port == port
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_prometheus_multiproc_dir_is_answered_with_agent_mode(caplog, tmp_path):
    """DESIGN §2 names PROMETHEUS_MULTIPROC_DIR: a gunicorn app serving prometheus_client's
    multiprocess /metrics (MultiProcessCollector) never shows memra_obs's collector, silently.
    The in-process observer says so once, naming agent mode; agent mode says nothing."""
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    with caplog.at_level(logging.WARNING, logger="memra_obs"):
        for _ in range(2):
            obs = build_observer(level=0, prof=False, env=env, registry=CollectorRegistry(),
                                 sinks="prometheus", metrics_addr="")  # fmt: skip
            obs.shutdown()
    said = [r.getMessage() for r in caplog.records if "PROMETHEUS_MULTIPROC_DIR" in r.getMessage()]
    assert len(said) == 1 and "MEMRA_OBS_AGENT" in said[0] and "exemplars" in said[0]
    caplog.clear()
    diagnostics.reset()
    with caplog.at_level(logging.WARNING, logger="memra_obs"):
        obs = build_observer(level=0, prof=False, env={**env, "MEMRA_OBS_AGENT": str(tmp_path)},
                             sinks="prometheus")  # fmt: skip
        obs.shutdown()
    assert not [r for r in caplog.records if "PROMETHEUS_MULTIPROC_DIR" in r.getMessage()]


def test_a_port_this_processs_own_server_holds_is_said_to_serve_the_metrics_already(caplog):
    """9464 is also opentelemetry-exporter-prometheus's default, served by the application's
    ``start_http_server`` on prometheus_client's REGISTRY, where memra_obs's metrics land: that
    /metrics shows them, yet the one line said only "carrying on without /metrics" and pointed
    to agent mode. With the default registry it now says what to set."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(0, addr="127.0.0.1")  # the application's /metrics
    port = server.server_address[1]
    diagnostics.reset()
    try:
        with caplog.at_level(logging.WARNING, logger="memra_obs"):
            for registry in (CollectorRegistry(), None):
                st = Settings.resolve({}, sinks="prometheus", metrics_addr=f"127.0.0.1:{port}")
                built = build_exporters(st, registry=registry, strict=False)
                assert built.server is None
                built.prom.unregister()
                diagnostics.reset()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
            assert b"python_info" in r.read()  # the application's server is untouched
    finally:
        server.shutdown()
        server.server_close()
    own, default = [r.getMessage() for r in caplog.records]
    assert "REGISTRY" not in own and "MEMRA_OBS_AGENT" in own
    assert default.startswith(own.removesuffix("; carrying on without /metrics"))
    assert "opentelemetry-exporter-prometheus" in default and "REGISTRY there itself" in default
    assert default.endswith("set argument metrics_addr empty; carrying on without /metrics")
