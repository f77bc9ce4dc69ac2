"""The worker's side of agent mode: :class:`RingSink` writes records into this process's ring.

An export thread in the serving process holds the GIL for milliseconds (the loop's p99 pays);
into a ring the loop only writes bytes. ``pwrite``, not a mapping: a store into a mapped file
that someone truncates is a SIGBUS no Python code can guard; a write into a shrunk file only
grows it again. A round is two ``pack_into`` and two ``pwrite`` calls (~2 µs): the slot, then
``head`` (x86-64 keeps the order). Never blocks: the oldest slots are overwritten, counted by
the agent. The worker holds ``flock`` on its ring for life: liveness across PID namespaces."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import platform
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

from ..diagnostics import forked_set, say_once
from ..environment import MEMRA_OBS_AGENT, ConfigError
from ..sinks.base import Sink
from ..timeline import RoundRecord, SessionEndRecord, SessionRecord
from . import format as F

__all__ = ["RingSink", "check_cpu", "ring_directory"]


def check_cpu() -> None:
    """Agent mode's lock-free ring relies on x86-64's store order; refuse it anywhere else."""
    m = platform.machine()
    if m not in ("x86_64", "AMD64"):
        raise ConfigError(f"agent mode ({MEMRA_OBS_AGENT}, memra-obs agent) needs an x86-64 CPU, "
                          f"this one is {m!r}: the ring relies on x86-64 store order; publish "
                          f"in-process instead (unset {MEMRA_OBS_AGENT})")  # fmt: skip


def ring_directory(value: str) -> str:
    """``MEMRA_OBS_AGENT`` as a directory: a bare name (no ``/``) lives in ``/dev/shm``, or where
    there is none (``docker --ipc=none``) in ``$TMPDIR`` or ``/tmp``, for workers and agent alike."""
    if "/" in value:
        return value
    base = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(base, value)


def own_directory(directory: str) -> None:
    """Make ``directory`` (0700) if missing; a link, or one owned by neither this uid nor root
    (a k8s emptyDir mount), is a PermissionError: in /dev/shm another user could make it first."""
    try:
        os.makedirs(directory, 0o700, exist_ok=True)
    except FileExistsError:  # a file or a dangling link there: makedirs said "File exists"
        why = "a link" if os.path.islink(directory) else "not a directory"
        raise NotADirectoryError(errno.ENOTDIR, why, directory) from None
    st, uid = os.lstat(directory), os.geteuid()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, uid):
        why = f"owned by uid {st.st_uid}" if stat.S_ISDIR(st.st_mode) else "a link"
        raise PermissionError(errno.EPERM, f"{why}, not a directory of this uid ({uid}) or root")


def fs_type(path: str) -> str:
    """The filesystem type holding ``path`` ("" when unknown)."""
    real = os.path.realpath(path) + "/"
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = sorted((p for p in map(str.split, f) if len(p) > 2), key=lambda p: len(p[1]))
    except OSError:
        return ""
    kinds = [p[2] for p in mounts if real.startswith(p[1].replace("\\040", " ").rstrip("/") + "/")]
    return kinds[-1] if kinds else ""  # the longest mount point, and the last of equals


_SHUT = -2  #: a RingSink's descriptor once shut down (-1: a forked child got no ring)
_FORKED = -3  #: a forked child's, until its first record


class RingSink(Sink):
    """Every exported record into this process's ring (ProfRows/ProfSummary only feed the
    legacy lines). Never raises: a record the format cannot hold, or a write the file refuses,
    is counted in ``refused`` (and in the ring); ``written`` counts the records published.
    ``dropped_rounds``: the loop's count, copied into the ring at each session end and shutdown."""

    wants_trace_ids = True

    # 65,536 slots x 128 B = 8 MiB: ~30 s at 2,000 rounds/s if the agent stalls; 1,024 sessions
    # open at once that an agent can resume.
    def __init__(self, directory: str, *, worker: str = "", slots: int = 1 << 16,
                 table_entries: int = 1024) -> None:  # fmt: skip
        self.directory, self.worker = directory, worker
        self._pid_worker = worker == str(os.getpid())  # a forked child's ring takes its own
        self._geo = F.Geometry(slots, table_entries)
        self._lock = threading.Lock()
        self._slot, self._head = bytearray(F.SLOT), bytearray(F.HEAD.size)
        self.dropped_rounds: Callable[[], int] = lambda: 0
        self._open()
        _RINGS.add(self)  # one fork hook for all (a hook a sink registered could never go)

    @classmethod
    def create(cls, directory: str, *, worker: str = "", slots: int = 1 << 16) -> RingSink:
        """The ring for this process in ``directory`` (made if missing), or a ConfigError."""
        check_cpu()
        directory = ring_directory(directory)
        try:
            sink = cls(directory, worker=worker, slots=slots)
        except OSError as exc:
            raise ConfigError(f"{MEMRA_OBS_AGENT}={directory!r}: no ring there ({exc})") from exc
        if not os.path.exists(os.path.join(directory, ".agent.lock")):  # a typo, or none yet
            say_once(f"ring-unread:{directory}", f"{MEMRA_OBS_AGENT}={directory}: no agent has "
                     f"read this directory yet; records wait in the ring ({slots} slots, then "
                     f"the oldest are overwritten) until `memra-obs agent --dir {directory}` "
                     "runs (check both names for a typo)")  # fmt: skip
        kind = fs_type(directory)
        if kind and kind not in ("tmpfs", "ramfs", "hugetlbfs"):
            say_once(f"ring-fs:{directory}", f"{MEMRA_OBS_AGENT}={directory} is on {kind}, not in "
                     "memory: the kernel's writeback of the ring can stall the loop; use /dev/shm "
                     "or a k8s emptyDir with medium: Memory")  # fmt: skip
        return sink

    def _open(self) -> None:
        geo, pid = self._geo, os.getpid()
        own_directory(self.directory)
        name = f"ring-{re.sub(r'[^A-Za-z0-9_.-]+', '_', self.worker)[:40] or 'worker'}-{pid}-{secrets.token_hex(4)}.ring"
        tmp, path = os.path.join(self.directory, f".{name}.tmp"), os.path.join(self.directory, name)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, geo.size)  # every page now: no round allocates one
            label = self.worker.encode()[:63].decode(errors="ignore").encode()  # whole characters
            os.pwrite(fd, F.IDENT.pack(F.MAGIC, F.VERSION, F.SLOT, geo.slots, F.MAXSPAN,
                                       geo.table_entries, F.TABLE_ENTRY, geo.data_off, pid,
                                       time.time_ns(), len(label), label), 0)  # fmt: skip
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held for life
            os.rename(tmp, path)  # the agent only ever sees complete headers
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._fd, self.path = fd, path
        self._pos = self.written = self.refused = self.table_full = 0
        self._free = list(range(geo.table_entries - 1, -1, -1))
        self._entry: dict[int, int] = {}
        self._rounds0, self._rounds = self.dropped_rounds(), 0  # from this ring on (a fork's too)

    # -- under the lock ----------------------------------------------------------------
    def _pwrite(self, data: Any, off: int) -> bool:
        """False when the file refused (said once), or the ring is shut (its descriptor's
        number may be another file's by now)."""
        try:
            return self._fd >= 0 and os.pwrite(self._fd, data, off) == len(data)
        except OSError as exc:
            say_once(f"ring-write:{self.path}", f"ring {self.path}: {exc}; records are refused")
            return False

    def _count(self, refused: int = 0, table_full: int = 0) -> None:
        self.refused, self.table_full = self.refused + refused, self.table_full + table_full
        self._pwrite(F.WSTAT.pack(self.refused, self.table_full, 0), F.OFF_WSTAT)

    def _note_rounds(self) -> None:
        """The loop's dropped rounds since this ring began into its header, if they grew."""
        n = self.dropped_rounds() - self._rounds0
        if n > self._rounds and self._pwrite(F.U64.pack(n), F.OFF_ROUNDS):
            self._rounds = n

    def _publish(self, data: Any, n: int) -> bool:
        """``n`` slots at the next position, then ``head``; False (counted) if the file refused."""
        geo, pos = self._geo, self._pos
        off = geo.data_off + (pos & geo.mask) * F.SLOT
        cut = geo.data_off + geo.slots * F.SLOT - off  # bytes left before the ring wraps
        wrap = len(data) > cut
        F.HEAD.pack_into(self._head, 0, pos + n, self.written + 1)
        if not (self._pwrite(data[:cut] if wrap else data, off)
                and (not wrap or self._pwrite(data[cut:], geo.data_off))
                and self._pwrite(self._head, F.OFF_HEAD)):  # fmt: skip
            if self._fd >= 0:
                self._count(refused=1)
            elif self._fd == _SHUT:  # no header to count it in: said, as the queue says its own
                say_once(f"ring-shut:{self.path}", f"ring {self.path}: records of a session still "
                         "open when its observer was shut down (by configure(), shutdown() or the "
                         "exit) are not published; end sessions before replacing it")  # fmt: skip
            return False
        self._pos, self.written = pos + n, self.written + 1
        return True

    def _write(self, kind: int, payload: bytes, entry: int = -1, sid: int = 0) -> bool:
        """A record of one or more slots; its table entry, if any, goes in before ``head``."""
        n = max(1, -(-len(payload) // F.PAYLOAD))
        if n > F.MAXSPAN:
            self._count(refused=1)
            return False
        pos, r, p = self._pos, self.written, F.PAYLOAD
        # Whole slots: an earlier lap's bytes after a session would read as its caller's trace id.
        body = payload.ljust(n * p, b"\0")
        data = b"".join(F.SLOT_HEAD.pack(pos + i + 1, r << 16 | (kind << 8 | n if i == 0 else i))
                        + body[i * p : (i + 1) * p] for i in range(n))  # fmt: skip
        if entry >= 0:  # before head: a reader that sees the record published sees its entry
            off = F.HEADER + entry * F.TABLE_ENTRY
            self._pwrite(F.TABLE_ENTRY_HEAD.pack(0, sid, len(payload)) + payload, off)
            self._pwrite(F.U64.pack(pos + 1), off)
        return self._publish(data, n)

    # -- the sink ----------------------------------------------------------------------
    def on_round(self, rec: RoundRecord) -> None:
        with self._lock:
            if self._fd == _FORKED:
                self._ready()
            pos, r = self._pos, self.written
            try:
                sid, burst, index, t, k, j, ctx, seq_rows, split, _ = rec  # repeat: 1 from a loop
                if split is None:
                    F.ROUND.pack_into(self._slot, 0, pos + 1, r << 16 | 0x201, sid, burst, index,
                                      *t, k, j, ctx, seq_rows)  # fmt: skip
                else:
                    F.ROUND_SPLIT.pack_into(self._slot, 0, pos + 1, r << 16 | 0x301, sid, burst,
                                            index, *t, k, j, ctx, seq_rows, *split)  # fmt: skip
            except Exception:
                self._count(refused=1)
                return
            self._publish(self._slot, 1)

    def _put(self, rec: Any) -> None:
        with self._lock:
            if self._fd == _FORKED:
                self._ready()
            try:
                kind, payload = F.encode(rec)
            except Exception:
                self._count(refused=1)
                return
            self._write(kind, payload)

    on_burst = on_first_token = _put

    def on_session(self, rec: SessionRecord) -> None:
        with self._lock:
            if self._fd == _FORKED:
                self._ready()
            try:
                payload = F.encode(rec, True)[1]
                fits = self._free and len(payload) <= F.TABLE_ENTRY - F.TABLE_HDR
                entry = self._free[-1] if fits else -1
                if entry < 0:
                    payload = F.encode(rec, False)[1]
                    self._count(table_full=1)
            except Exception:
                self._count(refused=1)
                return
            if self._write(F.KIND_SESSION, payload, entry, rec.session) and entry >= 0:
                self._entry[rec.session] = self._free.pop()  # taken once it is published

    def on_session_end(self, rec: SessionEndRecord) -> None:
        self._put(rec)
        with self._lock:
            self._note_rounds()
            entry = self._entry.pop(rec.session, -1)
            if entry >= 0:  # freed after the end's head: gone from the table = end published
                self._pwrite(F.U64.pack(0), F.HEADER + entry * F.TABLE_ENTRY)
                self._free.append(entry)

    def _after_fork(self) -> None:
        """A forked child must not write into its parent's ring: it gets its own at its first
        record (a child that only execs, a helper pool's worker, makes none: 8 MiB each)."""
        self._lock = threading.Lock()
        if self._pid_worker:  # no two rings share a label (the observer's follows too)
            self.worker = str(os.getpid())
        if self._fd >= 0:
            os.close(self._fd)  # the parent's lock stays: it holds its own descriptor
            self._fd = _FORKED

    def _ready(self) -> None:
        """Under the lock, in a forked child: its ring, made now."""
        self._fd = -1
        try:
            self._open()
        except OSError as exc:
            say_once(f"ring-fork:{os.getpid()}", f"ring: forked process {os.getpid()} has no "
                     f"ring in {self.directory} ({exc}); its records are not published")  # fmt: skip

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Mark the ring closed and drop the liveness lock; the file stays for the agent."""
        with self._lock:
            if self._fd >= 0:
                self._note_rounds()
                self._pwrite(F.WSTAT.pack(self.refused, self.table_full, 1), F.OFF_WSTAT)
                os.close(self._fd)
            if self._fd != -1:  # (-1: a forked child's that could not be made)
                self._fd = _SHUT


_RINGS = forked_set(RingSink._after_fork)
