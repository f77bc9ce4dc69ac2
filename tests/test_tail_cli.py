"""The tail as a command and as wiring: bad lines reported by number, bytes kept, knobs."""

from __future__ import annotations

import errno
import gzip
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import memra_obs.tail as tail_mod
from memra_obs.cli import main as cli_main
from memra_obs.environment import Settings
from memra_obs.export import QueueSink
from memra_obs.tail import Rebuilder, Tail, TailCollector
from memra_obs.tail.source import GzipSource, PipeSource
from memra_obs.timeline import RoundRecord
from memra_obs.wiring import build_exporters

PHASE = (
    "[glm5-phase] rounds=6 k=4 total=29.37ms | draft=9.49 verify=16.33 accept=1.77 roll=0.83 "
    "maint=0.95 | per-round ms: draft=1.581 verify=2.722 accept=0.295 roll=0.138 maint=0.158 "
    "total=4.895"
)
VERIFY = (
    "[glm5-phase-v] rounds=6 k=4 | per-round ms: vkda=0.893 (scan=0.357) vmla=0.552 "
    "vrest=1.277 (vffn=0.788)"
)


def _env() -> dict[str, str]:
    """The test's environment without the knobs a test asserts the defaults of."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_OBS_", "OTEL_"))}


def _tail(
    *args: str, data: bytes, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "memra_obs.cli", "tail", *args],
        input=data,
        capture_output=True,
        env={**_env(), "MEMRA_OBS_SINKS": "", **(env or {})},
        timeout=60,
    )


def test_bad_lines_are_reported_by_number_and_every_byte_survives():
    """Truncated tagged lines, invalid UTF-8, CR/LF endings and a last line without a
    newline: all pass through byte for byte; the bad ones are named by line number."""
    data = b"".join(
        [
            b"worker starting\n",
            PHASE.encode() + b"\r\n",
            VERIFY.encode() + b"\n",
            PHASE[:60].encode() + b"\n",  # truncated mid-line: line 4
            b"\xff\xfe binary noise \x00\n",
            b"[spec-prof-rounds] row=0 wall_ms=\xe9\xe9 draft_ms=1.0\n",  # line 6: bad UTF-8
            b"[INFO] someone else's tag\n",
            PHASE.encode(),  # no newline at the end
        ]
    )
    p = _tail("-", "--quiet", data=data)
    assert p.returncode == 0
    ours = [x for x in p.stderr.split(b"\n") if x.startswith(b"[memra-obs] tail:")]
    passed = b"\n".join(x for x in p.stderr.split(b"\n") if not x.startswith(b"[memra-obs] tail:"))
    assert passed.rstrip(b"\n") == data
    assert len(ours) == 2
    assert b"stdin:4: malformed phase line: phase line truncated or malformed" in ours[0]
    assert b"stdin:6: malformed prof_rounds line" in ours[1]


def test_start_and_end_lines_say_what_happened():
    """Without --quiet the tail says where it publishes and, at the end, what it saw."""
    p = _tail("-", "--worker", "r3", data=(PHASE + "\n" + VERIFY + "\n").encode())
    assert p.returncode == 0
    text = p.stderr.decode()
    assert "reading stdin as worker 'r3'; publishing nothing (MEMRA_OBS_SINKS)" in text
    assert "end of input: 2 lines (2 legacy, 0 malformed, 0 unplaced), 1 sessions, 6 rounds" in text
    # metrics on, but no address to serve them: said as such, not "publishing nothing"
    env = {"MEMRA_OBS_SINKS": "prometheus", "MEMRA_OBS_METRICS_ADDR": ""}
    p = _tail("-", "--worker", "r3", data=b"", env=env)
    assert "as worker 'r3'; metrics -> the registry only (MEMRA_OBS_METRICS_ADDR empty)\n" in (
        p.stderr.decode()
    )


def test_the_end_line_comes_when_the_input_ends_mid_line():
    """Input whose last line has no newline: the passed-through bytes end with it, then a
    newline and the tail's end line (it waited for a line boundary that never came)."""
    p = _tail("-", data=b"plain line\n" + PHASE.encode())
    assert p.returncode == 0
    assert p.stderr.split(b"[memra-obs] tail: end of input: 2 lines")[0].endswith(
        PHASE.encode() + b"\n"
    )


def test_a_file_without_follow_is_read_once(tmp_path):
    """``memra-obs tail FILE`` reads the file to its end and exits; a missing file is a
    clear error with exit status 2."""
    f = tmp_path / "w.err"
    f.write_text(PHASE + "\n")
    p = _tail(str(f), "--quiet", data=b"")
    assert (p.returncode, p.stderr) == (0, (PHASE + "\n").encode())
    p = _tail(str(tmp_path / "nope.err"), data=b"")
    assert p.returncode == 2 and b"No such file" in p.stderr


@pytest.mark.parametrize("args", [("w.err",), ("--follow", "w.err"), ("-",)])
def test_an_input_that_is_its_own_standard_error_is_refused(tmp_path, args):
    """``tail log 2>>log`` (a unit file's append to the worker's log): the tail read its own
    copy back for ever, the disk filled and /metrics showed sessions that never ran."""
    f = tmp_path / "w.err"
    f.write_text(PHASE + "\n")
    argv = [sys.executable, "-m", "memra_obs.cli", "tail", *args]
    with open(f, "rb") as stdin, open(f, "ab") as err:
        p = subprocess.run(argv, stdin=stdin, stderr=err, cwd=tmp_path, env=_env(), timeout=60)
    assert p.returncode == 2
    assert f.read_bytes().split(b"\n")[1:] == [
        f"memra-obs tail: {args[-1]} is its standard error (its copy of the lines): it would "
        "read them back for ever".encode(), b""]  # fmt: skip


def test_a_gzipped_file_is_read_as_the_report_reads_it(tmp_path):
    """A rotated, compressed log (``w.err.1.gz``) is read decompressed (its bytes went through
    as they were: 0 legacy lines, status 0), with ``--follow`` and on standard input too;
    damaged data is one line, status 2."""
    f = tmp_path / "w.err.1.gz"
    f.write_bytes(gzip.compress((PHASE + "\n" + VERIFY + "\n").encode()))
    want = (0, (PHASE + "\n" + VERIFY + "\n").encode())
    p = _tail(str(f), "--quiet", data=b"")
    assert (p.returncode, p.stderr) == want
    # --follow: read once (a compressed file does not grow); standard input redirected from one
    assert (lambda p: (p.returncode, p.stderr))(
        _tail("--follow", str(f), "--quiet", data=b"")
    ) == want
    with open(f, "rb") as stdin:
        p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "tail", "-", "--quiet"],
                           stdin=stdin, capture_output=True, env={**_env(), "MEMRA_OBS_SINKS": ""},
                           timeout=60)  # fmt: skip
    assert (p.returncode, p.stderr) == want
    f.write_bytes(f.read_bytes()[:20])
    p = _tail(str(f), "--quiet", data=b"")
    assert p.returncode == 2 and p.stderr.startswith(f"memra-obs tail: {f}: damaged gzip".encode())


def test_a_fifo_with_follow_is_read_to_its_writers_end_and_no_fd_is_left(
    tmp_path, capfd, monkeypatch
):
    """``--follow`` on a FIFO reads it as a pipe (it was "Illegal seek", status 2); a tail run
    in-process closes the file it opened (one fd leaked a run)."""
    fifo = tmp_path / "w.fifo"
    os.mkfifo(fifo)
    for args in (("--follow", "--from-start"), ("--follow",)):
        writer = subprocess.Popen(["sh", "-c", f"sleep 0.2; printf '%s\\n' '{PHASE}' > {fifo}"])
        p = _tail(*args, "--quiet", str(fifo), data=b"")
        writer.wait(10)
        assert (p.returncode, p.stderr) == (0, (PHASE + "\n").encode())
    f = tmp_path / "w.err"
    f.write_text(PHASE + "\n")
    monkeypatch.setenv("MEMRA_OBS_SINKS", "")
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        assert cli_main(["tail", str(f), "--quiet"]) == 0
    assert len(os.listdir("/proc/self/fd")) == fds
    capfd.readouterr()


def test_bad_options_and_knobs_fail_loudly():
    """An unknown option or a bad MEMRA_OBS_* value stops the tail at start, naming it."""
    p = _tail("-", "--frobnicate", data=b"")
    assert p.returncode == 2 and b"--frobnicate" in p.stderr
    p = _tail(
        "-", data=b"", env={"MEMRA_OBS_SINKS": "prometheus", "MEMRA_OBS_METRICS_ADDR": "nowhere"}
    )
    assert p.returncode == 2 and b"MEMRA_OBS_METRICS_ADDR" in p.stderr


@pytest.mark.parametrize("half", ["CERT", "KEY"])
def test_half_a_tls_pair_stops_the_tail_and_the_agent_in_one_line(tmp_path, half):
    """The TLS pair check is the one every publisher shares (issue 12: it was missing in the
    agent): a certificate without its key, or the reverse, is exit 2 and one line naming both."""
    pem = tmp_path / "x.pem"
    pem.write_text("not read: the pair is refused first\n")
    env = {"MEMRA_OBS_SINKS": "prometheus", "MEMRA_OBS_METRICS_ADDR": "127.0.0.1:0",
           f"MEMRA_OBS_METRICS_TLS_{half}": str(pem)}  # fmt: skip
    agent = subprocess.run(
        [sys.executable, "-m", "memra_obs.cli", "agent", "--once", "--dir", str(tmp_path)],
        capture_output=True, env={**_env(), **env}, timeout=60,
    )  # fmt: skip
    for p in (_tail("-", data=b"", env=env), agent):
        err = p.stderr.decode().strip().splitlines()
        assert p.returncode == 2 and len(err) == 1, err
        assert "MEMRA_OBS_METRICS_TLS_CERT and MEMRA_OBS_METRICS_TLS_KEY go together" in err[0]


def test_the_family_cap_is_the_knob_max_families():
    """MEMRA_OBS_MAX_FAMILIES bounds the families a tail publishes: a new one past it is
    refused, said once naming the knob, and counted as unplaced; a bad value stops it."""
    data = "".join(PHASE.replace("glm5", f"f{i}") + "\n" for i in range(5)).encode()
    p = _tail("-", data=data, env={"MEMRA_OBS_MAX_FAMILIES": "2"})
    text = p.stderr.decode()
    assert p.returncode == 0 and text.count("MEMRA_OBS_MAX_FAMILIES") == 1
    assert "stdin:3: past MEMRA_OBS_MAX_FAMILIES=2: family 'f2' (and every new one)" in text
    assert "5 lines (5 legacy, 0 malformed, 3 unplaced), 2 sessions, 12 rounds" in text
    p = _tail("-", data=b"", env={"MEMRA_OBS_MAX_FAMILIES": "0"})
    assert p.returncode == 2 and b"MEMRA_OBS_MAX_FAMILIES='0': expected 1..4096" in p.stderr


def test_a_long_file_name_is_cut_to_a_worker_label(tmp_path):
    """The file's name, the default label, is cut to MAX_WORKER bytes: 200 bytes of Latin-1
    (604 as U+FFFD) were refused as "argument worker", a name nobody gave."""
    from memra_obs.environment import MAX_WORKER

    f = tmp_path.as_posix().encode() + b"/" + b"\xe9" * 200 + b".log"
    with open(f, "wb") as out:
        out.write(PHASE.encode() + b"\n")
    p = _tail(os.fsdecode(f), data=b"")
    assert p.returncode == 0, p.stderr
    label = "\ufffd" * (MAX_WORKER // 3)
    assert f"as worker {label!r}; ".encode() in p.stderr


def test_an_empty_worker_label_is_refused_under_its_own_name():
    """``--worker ''`` or ``MEMRA_OBS_WORKER=''`` is refused naming it, as every knob (it was
    replaced by the file's name); a set label is taken, an unset one is the input's name."""
    p = _tail("-", "--worker", "", data=b"")
    assert p.returncode == 2 and b"argument --worker: must not be empty" in p.stderr
    p = _tail("-", data=b"", env={"MEMRA_OBS_WORKER": ""})
    assert p.returncode == 2 and b"MEMRA_OBS_WORKER='': must not be empty" in p.stderr
    for env, label in (({"MEMRA_OBS_WORKER": "r7"}, b"'r7'"), ({}, b"'stdin'")):
        p = _tail("-", data=b"", env=env)
        assert p.returncode == 0 and b"reading stdin as worker " + label in p.stderr
    p = _tail("", data=b"")  # `memra-obs tail "$LOG"`, LOG unset: the file named, not a worker
    assert p.returncode == 2 and b"argument FILE|-: must not be empty" in p.stderr, p.stderr


@pytest.mark.parametrize("sinks", ["", None])
def test_a_closed_standard_input_ends_the_tail_with_one_line(tmp_path, sinks):
    """``memra-obs tail - <&-`` (a supervisor that closed fd 0): exit 2 with the reason, no
    traceback -- with the default sinks too (/metrics's listening socket took fd 0 and the tail
    waited on it as its input, for ever)."""
    env = {**_env(), "MEMRA_OBS_METRICS_ADDR": "127.0.0.1:0",
           "MEMRA_OBS_SPANS_FILE": str(tmp_path / "s.jsonl")}  # fmt: skip
    if sinks is not None:
        env["MEMRA_OBS_SINKS"] = sinks
    p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "tail", "-"], stdin=subprocess.DEVNULL,
                       capture_output=True, env=env, timeout=60,
                       preexec_fn=lambda: os.close(0))  # fmt: skip
    assert p.returncode == 2 and b"Traceback" not in p.stderr, p.stderr
    assert p.stderr == b"memra-obs tail: -: Bad file descriptor\n"


def test_a_signal_during_the_final_flush_waits_for_it(tmp_path):
    """SIGTERM after the input is read, while the exporters flush to a collector that never
    answers: the flush goes on (bounded by the export timeout) and the end line comes, status 0
    (the default handlers were back: the signal killed it mid-flush, spans and line lost)."""
    import signal
    import socket

    log = tmp_path / "w.err"
    log.write_text((PHASE + "\n") * 50)
    with socket.socket() as hole:  # accepts (the kernel's backlog) and never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        env = {**_env(), "MEMRA_OBS_SINKS": "otel", "OTEL_EXPORTER_OTLP_TIMEOUT": "4000",
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{hole.getsockname()[1]}"}  # fmt: skip
        p = subprocess.Popen([sys.executable, "-m", "memra_obs.cli", "tail", str(log)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)  # fmt: skip
        assert p.stderr is not None
        assert b"reading" in p.stderr.readline()
        # The tail passes each chunk's lines on to stderr as it reads them: the 50th there, all
        # were read (a fixed sleep assumed it). Parsing them and reading the file's end take ms,
        # then the flush waits up to 4 s on the hole: the signal comes 0.5 s in.
        err_lines: list[bytes] = []
        all_read = threading.Event()

        def drain() -> None:
            passed = 0
            for line in p.stderr:  # type: ignore[union-attr]
                err_lines.append(line)
                passed += line.startswith(b"[glm5-phase] ")
                if passed == 50:
                    all_read.set()

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        assert all_read.wait(30), b"".join(err_lines)
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        p.wait(30)
        reader.join(30)
        err = b"".join(err_lines)
    assert p.returncode == 0, err
    assert b"end of input: 50 lines" in err


def test_follow_options_without_follow_are_refused(tmp_path):
    """``--from-start`` and ``--poll`` only shape ``--follow``: without it the file is read once
    whatever they say, so ``tail --poll 1 log`` (meaning to follow) is a usage error, not a
    silent one-shot read; with ``--follow`` both are taken."""
    log = tmp_path / "log"
    log.write_bytes(b"")
    for opts in (["--from-start"], ["--poll", "1"], ["--from-start", "--poll", "0.5"]):
        p = _tail(str(log), *opts, data=b"")
        assert p.returncode == 2 and b"Traceback" not in p.stderr, p.stderr
        assert f"argument {opts[0]}: only with --follow".encode() in p.stderr, p.stderr
    p = _tail(str(log), "--from-start", data=b"")
    assert b"usage: memra-obs tail" in p.stderr


def test_seconds_past_a_day_or_not_finite_are_refused():
    """``--linger inf`` (or 1e300, or --session-gap / --poll so) is a usage error, not a crash;
    so are 0 and other scripts' digits (float() reads them), for --max-bursts too."""
    for opt in ("--linger", "--session-gap", "--poll", "--max-bursts"):
        top = "" if opt == "--max-bursts" else " up to 86400"
        for v in ("inf", "1e300", "nan", "86401", "0", "\u0669"):
            if opt == "--max-bursts" and v == "86401":
                continue
            p = _tail("-", opt, v, data=b"")
            assert p.returncode == 2 and b"Traceback" not in p.stderr, p.stderr
            said = f"argument {opt}: {v!r} is not a positive {'integer' if top == '' else 'number'}"
            assert f"{said}{top}".encode() in p.stderr, p.stderr


def test_a_directory_or_a_read_error_ends_the_tail_with_one_line(tmp_path, monkeypatch, capfd):
    """A directory is refused at start (with or without --follow); a read error mid-stream
    (EIO) ends the tail after publishing what it read: one line each, status 2."""
    for args in ((str(tmp_path),), ("--follow", str(tmp_path))):
        p = _tail(*args, data=b"")
        assert (p.returncode, p.stderr) == (
            2,
            f"memra-obs tail: {tmp_path}: Is a directory\n".encode(),
        )
    f = tmp_path / "w.err"
    f.write_text(PHASE + "\n")
    chunks: list[Any] = [(PHASE + "\n").encode(), OSError(errno.EIO, os.strerror(errno.EIO))]

    def read(self: PipeSource, timeout_s: float) -> bytes:
        if isinstance(x := chunks.pop(0), OSError):
            raise x
        return x

    made: list[Rebuilder] = []

    class Kept(Rebuilder):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(PipeSource, "read", read)
    monkeypatch.setattr(tail_mod, "Rebuilder", Kept)
    monkeypatch.setenv("MEMRA_OBS_SINKS", "")
    capfd.readouterr()
    assert cli_main(["tail", str(f), "--quiet"]) == 2
    err = capfd.readouterr().err
    assert err == f"{PHASE}\nmemra-obs tail: {f}: Input/output error\n"
    assert (made[0].sessions, made[0].rounds_from_means) == (1, 6)  # published before exiting


def test_wiring_publishes_worker_labelled_metrics_and_its_own_counters():
    """The tail's wiring (build_exporters, worker-labelled) plus the tail's own counters in
    the same registry; promtool finds nothing to report on the exposition."""
    reg = CollectorRegistry()
    st = Settings.resolve({}, sinks="prometheus", metrics_addr="", worker="r7")
    w = build_exporters(st, worker="r7", worker_label=True, registry=reg, env={})
    try:
        tail = Tail(
            Rebuilder("r7"),
            lambda b: [ex.export(b) for ex in w.all],
            out=None,
            notes=lambda s: None,
        )
        collector = TailCollector()
        collector.add("r7", tail.stats)
        reg.register(collector)
        tail.feed(
            (PHASE + "\n" + VERIFY + "\n[glm5-phase] rounds=1 k=4 total=\n").encode(),
            time.perf_counter_ns(),
        )
        tail.close(time.perf_counter_ns())

        def v(name: str, **labels: str) -> float | None:
            return reg.get_sample_value(name, {"worker": "r7", **labels})

        assert v("memra_spec_rounds_total", family="glm5") == 6
        assert v("memra_spec_phase_seconds_count", family="glm5", phase="verify") == 6
        assert v("memra_obs_tail_lines_total", kind="phase") == 2
        assert v("memra_obs_tail_malformed_lines_total", kind="phase") == 1
        assert v("memra_obs_tail_rounds_total", source="burst_mean") == 6
        assert v("memra_obs_tail_sessions_total") == 1
        promtool = shutil.which("promtool")
        if promtool:
            p = subprocess.run(
                [promtool, "check", "metrics"],
                input=generate_latest(reg),
                capture_output=True,
                timeout=30,
            )
            assert p.returncode == 0 and not p.stdout.strip() and not p.stderr.strip(), p.stderr
    finally:
        for ex in w.all:
            ex.shutdown(1.0)
        w.close()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_lines_the_output_refuses_are_counted_and_still_published(tmp_path):
    """``memra-obs tail -f log 2>/dev/full``: the lines it could not pass through were given up
    silently (``memra_obs_tail_bytes_total`` read as passed through). They are counted as
    ``memra_obs_export_errors_total{signal="lines"}``, and published all the same."""
    import socket
    import urllib.request

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    log = tmp_path / "w.log"
    log.write_text((PHASE + "\n" + VERIFY + "\n") * 3)
    env = {**_env(), "MEMRA_OBS_SINKS": "prometheus", "MEMRA_OBS_METRICS_ADDR": f"127.0.0.1:{port}"}
    with open("/dev/full", "wb") as full:
        p = subprocess.Popen([sys.executable, "-m", "memra_obs.cli", "tail", "-f", "--from-start",
                              str(log)], stdout=full, stderr=full, env=env)  # fmt: skip
    try:
        want = 'memra_obs_export_errors_total{signal="lines"} 6.0'
        body = ""
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    body = r.read().decode()
            except OSError:
                body = ""
            rounds = [ln for ln in body.splitlines() if ln.startswith("memra_spec_rounds_total{")]
            if want in body and rounds:
                break
            time.sleep(0.1)
        assert want in body, [ln for ln in body.splitlines() if "errors_total" in ln]
        assert len(rounds) == 1 and 'family="glm5"' in rounds[0]  # (the last burst may linger)
        assert float(rounds[0].split()[-1]) >= 12
    finally:
        p.terminate()
        p.wait(30)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_refused_line_counts_once_however_it_was_written():
    """A line the output refused counts once: written in pieces (a partial line waits 0.1 s,
    then goes), over-long, or followed by the tail's own note (its newline not counted)."""
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        for feeds, want in (
            ([b"abc", b"def\n"], 1),
            ([b"a\nb\nc\n"], 3),
            ([b"x" * (3 << 20), b"\n"], 1),
            ([b"abc\n", b"d"], 1),  # (an input's last line without its newline: not counted)
        ):
            tail = Tail(Rebuilder("w"), lambda b: None, out=fd)
            for i, chunk in enumerate(feeds):
                tail.feed(chunk, i * 1_000_000_000)
                tail.tick(i * 1_000_000_000 + 500_000_000)
            tail.close(10**10)
            tail.note("a note of the tail's own")
            assert tail.lost_lines == want, feeds
    finally:
        os.close(fd)


def test_a_file_name_that_is_not_utf8_makes_a_label_every_scrape_can_encode():
    """The tail's worker label defaults to the file's name, and argv and the environment keep
    undecodable bytes as surrogates: every /metrics was a 500 (UnicodeEncodeError). Settled
    once: the bytes become U+FFFD, from the argument, MEMRA_OBS_WORKER or RANK alike."""
    from memra_obs.prom import encode

    raw = os.fsdecode(b"w\xff.log")
    for env in ({"MEMRA_OBS_WORKER": raw}, {"RANK": raw}):
        assert Settings.resolve(env).worker == "w\ufffd.log"
    reg = CollectorRegistry()
    st = Settings.resolve({}, sinks="prometheus", metrics_addr="", worker=raw)
    w = build_exporters(st, worker=st.worker, worker_label=True, registry=reg, env={})
    try:
        tail = Tail(Rebuilder(st.worker), lambda b: [ex.export(b) for ex in w.all], out=None)
        tail.feed((PHASE + "\n").encode(), time.perf_counter_ns())
        tail.close(time.perf_counter_ns())
        body = encode(reg, "text/plain")[0].decode()
    finally:
        w.close()
    assert 'memra_spec_rounds_total{family="glm5",worker="w\ufffd.log"} 6.0' in body


class _Slow:
    """An exporter that waits on a gate (a stalled network) and can be made to raise."""

    def __init__(self, gate: Any = None, fail: bool = False) -> None:
        self.gate = gate
        self.fail = fail
        self.records: list[Any] = []

    def export(self, batch: Any) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise RuntimeError("boom")
        self.records.extend(batch)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        pass


def test_the_tail_queue_waits_for_room_and_loses_nothing():
    """A stalled exporter holds the tail's reading back (put_many blocks on a full queue)
    instead of dropping: every record gets out once the exporter moves again."""
    import threading

    gate = threading.Event()
    ex = _Slow(gate)
    q = QueueSink([ex], capacity=16, pause_s=0, stretch_ms=0)
    done = threading.Event()

    def reader() -> None:
        for _ in range(20):
            q.put_many([object()] * 4)  # type: ignore[list-item]
        done.set()

    t = threading.Thread(target=reader)
    t.start()
    assert not done.wait(0.3), "the reader should be held back while the exporter stalls"
    gate.set()
    t.join(10)
    q.shutdown(5.0)
    assert (len(ex.records), q.dropped) == (80, 0)


def test_a_failing_exporter_is_reported_once_and_the_others_go_on(caplog):
    """One exporter raising does not stop the records reaching the next one."""
    bad, good = _Slow(fail=True), _Slow()
    q = QueueSink([bad, good], pause_s=0, stretch_ms=0)
    tail = Tail(Rebuilder("w"), q.put_many, out=None)
    for _ in range(3):
        tail.feed((PHASE + "\n").encode(), time.perf_counter_ns())
    tail.close(time.perf_counter_ns())
    q.shutdown(5.0)
    assert sum(r.repeat for r in good.records if type(r) is RoundRecord) == 18
    said = [r.getMessage() for r in caplog.records if "boom" in r.getMessage()]
    assert q.worker.errors >= 1 and len(said) == 1


@pytest.mark.parametrize("sinks", ["otel", "otel,prometheus"])
def test_spans_file_gets_the_worker_span_tree(tmp_path, sinks):
    """With spans on, a tail writes the same span tree a worker does (session, burst,
    rounds and their phases) to MEMRA_OBS_SPANS_FILE."""
    import json

    spans = tmp_path / "spans.jsonl"
    p = _tail(
        "-",
        "--quiet",
        data=(PHASE + "\n" + VERIFY + "\n").encode(),
        env={
            "MEMRA_OBS_SINKS": sinks,
            "MEMRA_OBS_SPANS_FILE": str(spans),
            "MEMRA_OBS_METRICS_ADDR": "",
        },
    )
    assert p.returncode == 0, p.stderr
    names: dict[str, int] = {}
    for line in spans.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    names[s["name"]] = names.get(s["name"], 0) + 1
    assert names == {
        "spec.session": 1,
        "spec.burst": 1,
        "spec.round": 6,
        "spec.draft": 6,
        "spec.verify": 6,
        "spec.accept": 6,
        "spec.rollback": 6,
        "spec.maint": 6,
    }


@pytest.mark.parametrize(
    "sampler", [{"OTEL_TRACES_SAMPLER": "always_off"}, {"OTEL_TRACES_SAMPLER": "always_on"},
                {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}],
)  # fmt: skip
def test_the_tail_samples_sessions_by_otel_traces_sampler(tmp_path, sampler):
    """The tail's sessions are roots: OTEL_TRACES_SAMPLER decides which get spans (and so
    exemplars); the metrics count every round all the same."""
    spans = tmp_path / "spans.jsonl"
    env = {"MEMRA_OBS_SINKS": "otel", "MEMRA_OBS_SPANS_FILE": str(spans), **sampler}
    p = _tail("-", "--quiet", data=(PHASE + "\n" + VERIFY + "\n").encode(), env=env)
    assert p.returncode == 0 and b"[memra-obs]" not in p.stderr, p.stderr
    text = spans.read_text() if spans.exists() else ""
    assert ('"spec.session"' in text) is (sampler["OTEL_TRACES_SAMPLER"] == "always_on")


@pytest.mark.parametrize("sinks", ["prometheus", "otel,prometheus"])
def test_exemplars_name_only_traces_that_are_sent(tmp_path, sinks):
    """Wired as the tail (build_exporters): metrics alone keep no exemplar (it would name a
    trace no backend receives; README, "Exemplars": they come with spans); with spans on,
    every round's exemplar names its session's trace."""
    from memra_obs.prom import encode

    reg = CollectorRegistry()
    spans = tmp_path / "spans.jsonl"
    st = Settings.resolve({}, sinks=sinks, metrics_addr="", spans_file=str(spans))
    w = build_exporters(st, worker="w", worker_label=True, registry=reg, env={})
    try:
        tail = Tail(Rebuilder("w"), lambda b: [ex.export(b) for ex in w.all], out=None)
        tail.feed((PHASE + "\n" + VERIFY + "\n").encode(), time.perf_counter_ns())
        tail.close(time.perf_counter_ns())
        body = encode(reg, "application/openmetrics-text; version=1.0.0")[0].decode()
    finally:
        if w.spans is not None:
            w.spans.shutdown(5.0)
        w.close()
    assert 'memra_spec_rounds_total{family="glm5",worker="w"} 6.0' in body
    assert ('# {span_id="' in body) is ("otel" in sinks)
    assert ("trace_id=" in body) is ("otel" in sinks)


def test_a_finished_log_tailed_to_a_span_file_keeps_every_session(tmp_path, monkeypatch, capfd):
    """The README's ``memra-obs tail rank0.err`` with spans to a file: a local output (file,
    console) holds the tail back as its record queue does, never drops (a demo's 27,945-line
    log kept 338 of its 366 sessions' spans: the sender thread starved behind the encoder)."""
    import json

    from memra_obs.demo import DemoConfig, run_demo
    from memra_obs.otel import exporter, transport
    from memra_obs.testing import capture

    with capture(level=2, prof=True) as cap:
        run_demo(DemoConfig(requests=24, seed=3, speed=100), cap.observer)
    log, spans = tmp_path / "rank0.err", tmp_path / "run42.jsonl"
    log.write_text("\n".join(cap.lines) + "\n")
    send = transport.FileSender.send
    monkeypatch.setattr(exporter, "_QUEUE_BYTES", 1 << 20)  # a few requests: a slow disk's
    monkeypatch.setattr(transport.FileSender, "send", lambda s, p, t=0.0: time.sleep(0.05) or send(s, p))  # fmt: skip
    monkeypatch.setenv("MEMRA_OBS_SINKS", "otel")
    monkeypatch.setenv("MEMRA_OBS_SPANS_FILE", str(spans))
    assert cli_main(["tail", str(log)]) == 0
    err = capfd.readouterr().err
    sessions = [
        s
        for line in spans.read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for s in ss["spans"]
        if s["name"] == "spec.session"
    ]
    assert "dropped (counted in dropped_spans)" not in err
    assert len(sessions) == 24 and "24 sessions" in err


def test_an_input_select_refuses_is_read_blocking_not_polled(monkeypatch):
    """A descriptor select() cannot take (a special file; fd >= FD_SETSIZE) is read blocking,
    even when it arrived non-blocking: the read waits for the data, never spins on b""."""
    r, w = os.pipe()
    os.set_blocking(r, False)

    def refuse(*a: Any) -> Any:
        raise ValueError("filedescriptor out of range in select()")

    monkeypatch.setattr(select, "select", refuse)
    src = PipeSource(r, "pipe", own=True)
    late = threading.Timer(0.05, lambda: (os.write(w, b"x\n"), os.close(w)))
    late.start()
    try:
        assert (src.read(0.1), src.read(0.1)) == (b"x\n", None)
    finally:
        late.join()
        src.close()


def test_a_read_that_would_block_is_nothing_yet_and_close_closes_once(monkeypatch, tmp_path):
    """A ready input another reader drained (EAGAIN) is "nothing yet", never its end; a
    source closes the descriptor it owns, a gzip'd file's too, once however often asked."""
    r, w = os.pipe()
    src = PipeSource(r, "pipe", own=True)
    os.set_blocking(r, False)  # another process sharing the pipe made it non-blocking
    monkeypatch.setattr(select, "select", lambda rd, *a: (rd, [], []))
    assert src.read(0.1) == b""
    monkeypatch.undo()
    (f := tmp_path / "w.err.gz").write_bytes(gzip.compress(b"x\n"))
    gz = GzipSource(os.open(f, os.O_RDONLY), str(f))
    assert (gz.read(0.1), gz.read(0.1)) == (b"x\n", None)
    for s in (src, gz):
        s.close()
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(s.fd)
        s.close()  # the number may be another file's by now: left alone
    os.close(w)


def test_a_gzip_stream_with_a_bad_block_is_a_read_error(tmp_path):
    """Damaged compressed data inside a gzip'd log (not only a cut one) is EIO, as the tail
    says it: "damaged gzip data", never a traceback."""
    data = bytearray(gzip.compress(b"x\n" * 100))
    data[10] = 0x07  # the first deflate block: final, of the reserved type 3
    (f := tmp_path / "w.err.gz").write_bytes(bytes(data))
    gz = GzipSource(os.open(f, os.O_RDONLY), str(f))
    with pytest.raises(OSError, match="damaged gzip data") as exc:
        gz.read(0.1)
    assert exc.value.errno == errno.EIO
    gz.close()
    data = bytearray(gzip.compress(b"x\n"))
    data[-8] ^= 1  # its CRC: BadGzipFile, an OSError without an errno of its own
    f.write_bytes(bytes(data))
    gz = GzipSource(os.open(f, os.O_RDONLY), str(f))
    assert gz.read(0.1) == b"x\n"  # checked at its end
    with pytest.raises(OSError, match="damaged gzip data") as exc:
        gz.read(0.1)
    assert exc.value.errno == errno.EIO
    gz.close()
