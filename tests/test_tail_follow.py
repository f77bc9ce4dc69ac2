"""Following a log file while it is written and rotated (rename+create, copytruncate)."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from polling import wait_for

from memra_obs.tail import Rebuilder, Tail, pump
from memra_obs.tail.source import FollowSource
from memra_obs.testing import capture
from memra_obs.timeline import RoundRecord

DEADLINE_S = 20.0


def _env() -> dict[str, str]:
    """The test's environment without the knobs a test asserts the defaults of."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_OBS_", "OTEL_"))}


def worker_lines(n_sessions: int, rounds: int = 14) -> list[str]:
    """A profiled level-2 worker's stderr for ``n_sessions`` sessions (real clock, no device)."""
    with capture(level=2, prof=True, memory=lambda: [(0, 2048)]) as cap:
        obs = cap.observer
        for _ in range(n_sessions):
            with obs.session("glm5") as s:
                s.lap("cache_alloc")
                s.lap("prime")
                done = 0
                while done < rounds:
                    b = s.burst(4)
                    for _ in range(min(6, rounds - done)):
                        b.begin_round()
                        b.end_draft()
                        b.end_verify()
                        b.end_accept()
                        b.end_rollback()
                        b.end_round(k=4, j=2, ctx=10 + done)
                        done += 1
                    b.end()
        return cap.lines


class _Out:
    """A thread-safe byte sink standing in for stderr."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.lock = threading.Lock()

    def write(self, b: bytes) -> int:
        with self.lock:
            self.data += b
        return len(b)

    def flush(self) -> None:
        pass


def test_follow_survives_rename_and_copytruncate(tmp_path: Path):
    """A file written in pieces, rotated by rename+create and then by copytruncate: every
    byte comes through in order, every round is rebuilt, both rotations are counted."""
    path = tmp_path / "worker.err"
    path.write_bytes(b"")
    lines = worker_lines(6)
    per = len(lines) // 3
    parts = [lines[:per], lines[per : 2 * per], lines[2 * per :]]
    records: list[Any] = []
    out = _Out()
    # A linger far past any stall of the writes below or of the reader (at 50 ms, one on a busy
    # host could settle a burst before its rows came: orphans): the next line or close() at the
    # end settles each burst here.
    tail = Tail(
        Rebuilder("w", linger_ns=5_000_000_000), records.extend, out=out, notes=lambda s: None
    )
    src = FollowSource(str(path), from_start=True, poll_s=0.01)
    stop = threading.Event()

    def run() -> None:
        pump(tail, src, stop=stop.is_set, read_s=0.02)
        src.close()

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    written = bytearray()

    def write(chunk_lines: list[str]) -> None:
        blob = ("\n".join(chunk_lines) + "\n").encode()
        with open(path, "ab") as f:  # in uneven pieces, partial lines included
            for i in range(0, len(blob), 777):
                f.write(blob[i : i + 777])
                f.flush()
        written.extend(blob)
        wait_for(f"{len(written)} bytes read", lambda: tail.stats.bytes >= len(written), DEADLINE_S)

    try:
        write(parts[0])
        os.rename(path, tmp_path / "worker.err.1")  # logrotate's create mode
        path.write_bytes(b"")
        write(parts[1])
        wait_for("the rename rotation", lambda: tail.stats.rotations["rename"] == 1, DEADLINE_S)
        shutil.copyfile(path, tmp_path / "worker.err.2")  # copytruncate
        os.truncate(path, 0)
        wait_for("the truncate rotation", lambda: tail.stats.rotations["truncate"] == 1, DEADLINE_S)
        write(parts[2])
    finally:
        stop.set()
        reader.join(DEADLINE_S)
    assert not reader.is_alive()
    assert bytes(out.data) == bytes(written)
    assert tail.stats.total_malformed == 0 and tail.stats.total_orphans == 0
    assert sum(1 for r in records if type(r) is RoundRecord) == 6 * 14


def test_follow_waits_for_a_file_not_there_yet_and_reads_it_from_its_start(tmp_path: Path):
    """``memra-obs tail -f`` started before the worker made its log: said once, then the file
    is read whole when it comes (not from its end: all of it is new); renamed away and not
    created again yet, the tail waits for the next one the same way."""
    path, notes = tmp_path / "worker.err", []
    src = FollowSource(str(path), poll_s=0.01, on_wait=notes.append)
    assert notes == [f"{path} does not exist yet; waiting for it"] and src.read(0.05) == b""
    path.write_bytes(b"one\n")
    assert src.read(1.0) == b"one\n"
    os.rename(path, tmp_path / "worker.err.1")
    assert src.read(0.05) == b""
    path.write_bytes(b"two\n")
    assert src.read(1.0) == b"two\n" and len(notes) == 1
    src.close()


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _sample(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            lbl, _, value = line[len(name) + 1 :].rpartition("} ")
            if ",".join(sorted(lbl.split(","))) == want:
                return float(value)
    return None


@pytest.mark.integration
def test_cli_follows_a_rotating_file_and_serves_metrics(tmp_path: Path):
    """``memra-obs tail --follow FILE``: /metrics on a free loopback port counts the rounds
    and the rotations; the lines reach its stderr; SIGTERM ends it cleanly."""
    path = tmp_path / "rank0.err"
    path.write_bytes(b"")
    env = {**_env(), "MEMRA_OBS_SINKS": "prometheus", "MEMRA_OBS_METRICS_ADDR": "127.0.0.1:0"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "memra_obs.cli",
            "tail",
            "--follow",
            str(path),
            "--poll",
            "0.02",
            "--linger",
            "0.05",
        ],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    err = _Out()
    pump = threading.Thread(
        target=lambda: [err.write(c) for c in iter(lambda: proc.stderr.read1(65536), b"")],
        daemon=True,
    )  # type: ignore[union-attr]
    pump.start()
    try:
        wait_for("the start line", lambda: b"/metrics on " in err.data, DEADLINE_S)
        url = re.search(rb"/metrics on (\S+)", bytes(err.data)).group(1).decode()  # type: ignore[union-attr]
        lines = worker_lines(3)
        blob1 = ("\n".join(lines[:40]) + "\n").encode()
        blob2 = ("\n".join(lines[40:]) + "\n").encode()
        with open(path, "ab") as f:
            f.write(blob1)
        wait_for("the first lines passed through", lambda: blob1 in err.data, DEADLINE_S)
        os.rename(path, tmp_path / "rank0.err.1")
        with open(path, "ab") as f:
            f.write(blob2)
        wait_for("the lines after rotation", lambda: blob2 in err.data, DEADLINE_S)

        def rounds() -> float | None:
            return _sample(
                _scrape(url), "memra_spec_rounds_total", worker="rank0.err", family="glm5"
            )

        wait_for("42 rounds on /metrics", lambda: rounds() == 3 * 14, DEADLINE_S)
        text = _scrape(url)
        assert (
            _sample(text, "memra_obs_tail_rotations_total", worker="rank0.err", style="rename") == 1
        )
        assert (
            _sample(text, "memra_obs_tail_lines_total", worker="rank0.err", kind="phase") == 3 * 3
        )
        assert _sample(text, "memra_obs_dropped_total", signal="records") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(DEADLINE_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    pump.join(DEADLINE_S)
    assert rc == 0
    passed = b"".join(
        x + b"\n"
        for x in bytes(err.data).split(b"\n")
        if x and not x.startswith(b"[memra-obs] tail:")
    )
    assert passed == blob1 + blob2


def test_follow_ends_a_partial_line_at_rotation_and_waits_out_what_is_no_file(tmp_path: Path):
    """A partial last line at a rotation ends with a newline in the output too (the next file's
    first line was glued to it: `grep '^\\[glm5-phase\\]'` missed it); a directory or a FIFO
    put at the path is waited out, said once (a directory ended the tail, a FIFO blocked it,
    deaf to SIGTERM, until a writer came), and the file after it is read."""
    path = tmp_path / "worker.err"
    path.write_bytes(b"")
    out, notes = _Out(), []
    tail = Tail(Rebuilder("w"), lambda batch: None, out=out, notes=notes.append)
    src = FollowSource(str(path), from_start=True, poll_s=0.01, on_wait=notes.append)
    stop = threading.Event()
    reader = threading.Thread(target=lambda: pump(tail, src, stop=stop.is_set, read_s=0.02))
    reader.start()
    try:
        first = b"one\n[spec-prof-rounds] row=3 wall_ms=0.6"
        path.write_bytes(first)
        wait_for("the partial line read", lambda: tail.stats.bytes == len(first), DEADLINE_S)
        os.truncate(path, 0)
        wait_for("the truncate rotation", lambda: tail.stats.rotations["truncate"] == 1, DEADLINE_S)
        with open(path, "ab") as f:
            f.write(b"two\n")
        wait_for("the next line", lambda: tail.stats.bytes == len(first) + 4, DEADLINE_S)
        put = {"dir": os.mkdir, "fifo": os.mkfifo, "sock": _bound, "loop": _loop}
        for odd, said in (("dir", "not a regular file"), ("fifo", "not a regular file"),
                          ("sock", "No such device or address; waiting until it can be read"),
                          ("loop", None)):  # fmt: skip
            os.rename(path, tmp_path / f"worker.err.{odd}")
            put[odd](path)  # sock: a file it cannot open (waited out unsaid); loop: nor stat
            if said is not None:
                wait_for(
                    f"the {odd} said",
                    lambda said=said: sum(said in n for n in notes) == 1,
                    DEADLINE_S,
                )
            time.sleep(0.1)  # (the loop: os.stat's ELOOP ended the tail)
            assert said is None or sum(said in n for n in notes) == 1  # said once
            assert reader.is_alive()
            (os.rmdir if odd == "dir" else os.unlink)(path)
            notes.clear()
            path.write_bytes(f"after {odd}\n".encode())
            wait_for(
                f"after {odd}",
                lambda odd=odd: out.data.endswith(f"after {odd}\n".encode()),
                DEADLINE_S,
            )
    finally:
        stop.set()
        reader.join(DEADLINE_S)
        src.close()
    assert not reader.is_alive()
    assert (
        bytes(out.data)
        == b"one\n[spec-prof-rounds] row=3 wall_ms=0.6\ntwo\nafter dir\nafter fifo\nafter sock\nafter loop\n"
    )


def _bound(path: Path) -> None:
    """A UNIX socket at ``path``: stat-able, never open-able (ENXIO)."""
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))


def _loop(path: Path) -> None:
    os.symlink(path.name, path)


def test_a_file_at_its_end_is_checked_once_a_poll(tmp_path: Path, monkeypatch):
    """``--poll S``: a file at its end is read (and stat'ed) once every S seconds however often
    the pump asks (it was twice a call: 20 times a second at any ``--poll``); what comes after
    a check is read at the next."""
    path = tmp_path / "w.err"
    path.write_bytes(b"")
    src = FollowSource(str(path), poll_s=0.5)
    reads, real = [], os.read
    monkeypatch.setattr(os, "read", lambda fd, n: reads.append(fd) or real(fd, n))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.2:
        assert src.read(0.1) == b""
    assert 2 <= len(reads) <= 4, len(reads)  # at 0, 0.5, 1.0 s
    path.write_bytes(b"x\n")
    t0, got = time.monotonic(), b""
    while not got:
        got = src.read(0.1)
    assert got == b"x\n" and time.monotonic() - t0 < 0.5 + 0.2
    src.close()


def cri_parts(lines: list[str], seed: int = 3) -> bytes:
    """``lines`` as /var/log/pods holds them when the runtime read each in pieces (CRI-O's
    conmon writes a ``P`` part at each read that ends mid-line): up to three ``P`` parts and the
    ``F`` rest, stdout lines between the parts, and one line whose last part is the whole line
    (the read ended just before its newline: an empty ``F`` follows)."""
    rng, out = random.Random(seed), []
    for i, line in enumerate(lines):
        ts = f"2026-12-04T23:30:{i % 60:02d}.{i:09d}Z"
        cuts = sorted(rng.sample(range(1, len(line)), min(3, len(line) - 1)))
        if i == 5:
            cuts = [len(line)]
        for a, b in zip([0, *cuts[:-1]], cuts, strict=True):
            out.append(f"{ts} stderr P {line[a:b]}")
            out.append(f"{ts} stdout F INFO serving")  # the other stream, between the parts
        out.append(f"{ts} stderr F {line[cuts[-1] :]}")
    return ("\n".join(out) + "\n").encode()


def docker_parts(lines: list[str], cut: int = 16384) -> bytes:
    """``lines`` behind a progress bar's ``\\r`` updates (no newline while it runs), as Docker's
    json-file holds them: the daemon cuts a line at 16 KiB into records whose ``log`` lacks the
    newline, here inside each legacy line; a stdout record between the parts."""
    import json

    bar = "".join(
        f"\r{i % 100:3d}%|{'#' * (i % 40):40s}| {i}/999 [00:01<00:09]" for i in range(999)
    )
    out = []
    for i, x in enumerate(lines):
        head = bar[: cut - 1 - (37 * i) % len(x)] + x + "\n"  # the cut falls inside x
        for at in range(0, len(head), cut):
            rec = {"log": head[at : at + cut], "stream": "stderr", "time": "2026-12-04T23:30:04Z"}
            out += [json.dumps(rec, separators=(",", ":")), '{"log":"INFO\\n","stream":"stdout"}']
    return ("\n".join(out) + "\n").encode()


def test_a_docker_log_whose_lines_came_in_16k_parts_gives_every_round():
    """A legacy line glued behind a progress bar's updates lands in a line over 16 KiB, which
    Docker's json-file stores in parts (a ``log`` without its newline): each part alone was
    another program's line, the rounds of every line a cut fell in lost, said nowhere. The
    parts are joined per stream, as ``docker logs`` prints them."""
    lines = worker_lines(3)
    want: list[Any] = []
    plain = Tail(Rebuilder("w"), want.extend, out=None, notes=lambda s: None)
    plain.feed(("\n".join(lines) + "\n").encode(), time.perf_counter_ns())
    plain.close(time.perf_counter_ns())
    blob, got = docker_parts(lines), []
    tail = Tail(Rebuilder("w"), got.extend, out=None, notes=lambda s: None)
    for i in range(0, len(blob), 4096):
        tail.feed(blob[i : i + 4096], time.perf_counter_ns())
    tail.close(time.perf_counter_ns())
    rounds = [[(r.k, r.j, r.ctx) for r in x if type(r) is RoundRecord] for x in (want, got)]
    assert len(rounds[0]) == 3 * 14 and rounds[1] == rounds[0]
    assert tail.stats.total_malformed == tail.stats.total_orphans == 0
    assert {k: v for k, v in tail.stats.lines.items() if k != "other"} == {
        k: v for k, v in plain.stats.lines.items() if k != "other"
    }


def test_a_pods_log_whose_lines_came_in_cri_parts_gives_every_round():
    """A CRI log (/var/log/pods) whose lines the runtime wrote in ``P`` parts is read as the
    worker wrote it: each line joined from its parts, per stream, before it is parsed (each part
    was another program's line: every round of a split line was lost, unsaid), and a part that
    held the whole line is read once. The bytes pass through as they were stored."""
    lines = worker_lines(3)
    want: list[Any] = []
    plain = Tail(Rebuilder("w"), want.extend, out=None, notes=lambda s: None)
    plain.feed(("\n".join(lines) + "\n").encode(), time.perf_counter_ns())
    plain.close(time.perf_counter_ns())
    blob, got, out = cri_parts(lines), [], _Out()
    tail = Tail(Rebuilder("w"), got.extend, out=out, notes=lambda s: None)
    for i in range(0, len(blob), 4096):  # lines and parts split across reads too
        tail.feed(blob[i : i + 4096], time.perf_counter_ns())
    tail.close(time.perf_counter_ns())

    def rounds(records: list[Any]) -> list[tuple[int, int, int, int]]:
        return [(r.k, r.j, r.ctx, r.repeat) for r in records if type(r) is RoundRecord]

    assert len(rounds(want)) == 3 * 14 and rounds(got) == rounds(want)
    assert tail.stats.total_malformed == tail.stats.total_orphans == 0
    assert {k: v for k, v in tail.stats.lines.items() if k != "other"} == {
        k: v for k, v in plain.stats.lines.items() if k != "other"
    }
    assert bytes(out.data) == blob


def test_a_followed_file_is_read_from_its_end_unless_from_start(tmp_path):
    """As log shippers do: what the file holds is skipped, what comes after is read; with
    ``from_start`` what it holds comes first."""
    (path := tmp_path / "w.err").write_bytes(b"old\n")
    src, whole = FollowSource(str(path), poll_s=0.01), FollowSource(str(path), from_start=True)
    assert (src.read(0.02), whole.read(0.02)) == (b"", b"old\n")
    with open(path, "ab") as f:
        f.write(b"new\n")
    assert (src.read(0.02), whole.read(0.02)) == (b"new\n", b"new\n")
    src.close()
    whole.close()


def test_a_path_that_cannot_be_opened_at_start_is_an_error_not_a_wait(tmp_path):
    """Unopenable at start (here a link to itself: ELOOP) is the caller's error to say; only
    a path that does not exist yet is waited for."""
    (loop := tmp_path / "w.err").symlink_to(tmp_path / "w.err")
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        FollowSource(str(loop))


def test_a_followed_file_opened_as_fd_0_is_read_once(tmp_path):
    """Started with standard input closed, the file's descriptor is 0: still the open file,
    read on from where it was (its end), not opened again and read from its start."""
    (path := tmp_path / "w.err").write_bytes(b"old\n")
    saved = os.dup(0)
    os.close(0)
    try:
        src = FollowSource(str(path), poll_s=0.01)
        assert (src._fd, src.read(0.02)) == (0, b"")
        src.close()
    finally:
        os.dup2(saved, 0)
        os.close(saved)


def test_a_read_returns_in_its_time_whatever_the_poll_interval(tmp_path):
    """A long ``--poll`` spaces the file's checks, never the read's return (the tail's timers
    and a stop signal wait for it)."""
    (path := tmp_path / "w.err").write_bytes(b"")
    src = FollowSource(str(path), poll_s=30.0)
    t0 = time.monotonic()
    assert src.read(0.05) == b"" and time.monotonic() - t0 < 5
    src.close()


def test_a_renamed_away_file_is_closed_once_drained(tmp_path):
    """rename + create: the old file's descriptor goes (a log rotated hourly for a year
    would hold 8,760 of them, and the deleted files' space)."""
    (path := tmp_path / "w.err").write_bytes(b"a\n")
    src = FollowSource(str(path), from_start=True, poll_s=0.01)
    assert src.read(0.02) == b"a\n"
    held = len(os.listdir("/proc/self/fd"))
    path.rename(tmp_path / "w.err.1")
    path.write_bytes(b"b\n")
    assert src.read(0.02) == b"b\n" and len(os.listdir("/proc/self/fd")) == held
    src.close()
    src.close()  # once: the number may be another file's by now


def test_a_live_pipe_is_laid_out_live_and_a_file_read_once_is_a_backlog(tmp_path: Path):
    """pump() tells the rebuilder when lines arrive at the writer's pace: a pipe's short reads
    (interleaved loops then keep to the clock), never a regular file read once (a backlog)."""
    from memra_obs.tail.source import PipeSource

    seen: list[bool] = []

    class Spy(Rebuilder):
        def feed(self, rec: Any, t: int) -> str | None:
            seen.append(self.live)
            return super().feed(rec, t)

    blob = ("\n".join(worker_lines(2)) + "\n").encode()
    r, w = os.pipe()

    def write() -> None:  # the writer's pace: three short reads, the first alone not live
        cut = [i + 1 for i, c in enumerate(blob) if c == 10]  # whole lines a part
        for part in (blob[: cut[1]], blob[cut[1] : cut[3]], blob[cut[3] :]):
            os.write(w, part)
            time.sleep(0.05)
        os.close(w)

    writer = threading.Thread(target=write)
    writer.start()
    pump(Tail(Spy("w"), lambda b: None, out=None, notes=lambda s: None), PipeSource(r, "-", own=True),
         stop=lambda: False, read_s=0.02)  # fmt: skip
    writer.join()
    assert seen and not seen[0] and seen[-1]
    seen.clear()
    path = tmp_path / "w.log"
    path.write_bytes(blob)
    fd = os.open(path, os.O_RDONLY)
    pump(Tail(Spy("w"), lambda b: None, out=None, notes=lambda s: None), PipeSource(fd, "w", own=True),
         stop=lambda: False)  # fmt: skip
    assert seen and not any(seen)
