"""The worker's side of agent mode: :class:`RingSink` writes records into a shared-memory ring.

Why a ring: a background export thread in the serving process takes the GIL for milliseconds
at a time (span building, metric aggregation) and the loop's p99 pays for it. Here the loop
only packs bytes into an mmap'd file; the host's ``memra-obs agent`` does the rest in another
process. Layout and codec: :mod:`.format`.

Hot path (a round): one ``struct.pack_into`` of the whole slot (its ``seq`` = position + 1,
the record, its number), then one store of ``head`` — the ring's sequence counter, published
last: a reader trusts only what lies below the ``head`` it read before copying and re-reads
``head`` after copying to discard anything the writer may have reached meanwhile (see
:mod:`.reader`), so a torn record is never delivered. No syscall, no lock shared with another
process, never blocks: the ring overwrites its oldest slots and the reader counts what it
lost, by record number. An in-process lock orders writers when the loop runs several
threads (uncontended: one acquire/release per record).

Liveness without a shared PID namespace: the worker holds ``flock`` on its ring for its whole
life (taken once, never touched again); the kernel drops it when the process dies, even by
SIGKILL, and the agent then knows the ring will not grow and may be removed once read.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
import struct
import threading
import time
import weakref
from collections.abc import Mapping

from ..diagnostics import say_once
from ..environment import MEMRA_OBS_AGENT, ConfigError
from ..sinks.base import Sink
from ..timeline import (
    BurstRecord,
    FirstTokenRecord,
    Record,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)
from . import format as F

__all__ = ["DEFAULT_SLOTS", "DEFAULT_TABLE", "RingSink", "ring_directory", "ring_name"]

#: 65,536 slots x 128 B = 8 MiB per worker: ~30 s of rounds at 2,000 rounds/s of headroom
#: if the agent stalls.
DEFAULT_SLOTS = 1 << 16
#: Sessions open at once per worker that a restarted agent can resume.
DEFAULT_TABLE = 1024

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def ring_directory(value: str) -> str:
    """``MEMRA_OBS_AGENT`` as a directory: a path as given, a bare name (no ``/``) as a
    shared-memory name, i.e. ``/dev/shm/<name>``."""
    if "/" not in value and os.path.isdir("/dev/shm"):
        return os.path.join("/dev/shm", value)
    return value


def ring_name(worker: str, pid: int) -> str:
    """``ring-<worker>-<pid>-<nonce>.ring``: unique even when a rank's pid is reused."""
    w = _SAFE.sub("_", worker)[:40] or "worker"
    return f"ring-{w}-{pid}-{secrets.token_hex(4)}.ring"


def _slots_from_env(env: Mapping[str, str]) -> int:
    from ..environment import Settings

    return Settings.resolve(env).ring_slots


class RingSink(Sink):
    """Publishes every exported record type into this process's ring (see module doc).

    Legacy lines and NVTX stay in the worker (other sinks); ProfRows/ProfSummary feed only
    the legacy lines and are not written. :meth:`flush` returns at once: what is in the ring
    is already visible to the agent and outlives this process.
    """

    wants_trace_ids = True

    def __init__(
        self,
        directory: str,
        *,
        worker: str = "",
        slots: int = DEFAULT_SLOTS,
        table_entries: int = DEFAULT_TABLE,
    ) -> None:
        self.directory = directory
        self.worker = worker
        self._geo = F.Geometry(slots, table_entries)
        self._lock = threading.Lock()
        self.path = ""
        self._open()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _reopen_in_child(ref))

    @classmethod
    def create(
        cls,
        directory: str,
        *,
        worker: str = "",
        slots: int | None = None,
        table_entries: int = DEFAULT_TABLE,
        env: Mapping[str, str] | None = None,
    ) -> RingSink:
        """The ring for this process in ``directory`` (made if missing). ``slots`` defaults to
        ``MEMRA_OBS_RING_SLOTS``. A directory that cannot hold it is a start-up error."""
        n = slots if slots is not None else _slots_from_env(os.environ if env is None else env)
        directory = ring_directory(directory)
        try:
            sink = cls(directory, worker=worker, slots=n, table_entries=table_entries)
        except OSError as exc:
            raise ConfigError(
                f"{MEMRA_OBS_AGENT}={directory!r}: cannot create the ring ({exc})"
            ) from exc
        _warn_if_on_disk(directory)
        return sink

    # -- file ----------------------------------------------------------------------------

    def _open(self) -> None:
        geo = self._geo
        os.makedirs(self.directory, exist_ok=True)
        pid = os.getpid()
        name = ring_name(self.worker, pid)
        tmp = os.path.join(self.directory, "." + name + ".tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            os.ftruncate(fd, geo.size)
            mm = mmap.mmap(fd, geo.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            label = self.worker.encode("utf-8")[:63]
            F.IDENT.pack_into(
                mm, 0, F.MAGIC, F.VERSION, F.SLOT, geo.slots, F.MAXSPAN, geo.table_entries,
                F.TABLE_ENTRY, geo.data_off, pid, time.time_ns(), len(label), label,
            )  # fmt: skip
            _prefault(mm, geo.data_off, geo.size)
            # Held for life; the kernel releases it when this process is gone.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            final = os.path.join(self.directory, name)
            os.rename(tmp, final)  # the agent only ever sees complete headers
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._fd = fd
        self._mm: mmap.mmap | None = mm
        self.path = final
        self._pos = 0
        self._rec = 0
        self._mask = geo.mask
        self._data = geo.data_off
        self._free = list(range(geo.table_entries - 1, -1, -1))
        self._entry: dict[int, int] = {}
        self.refused = 0
        self.table_full = 0
        self._pid = pid

    def _count(self, refused: int = 0, table_full: int = 0) -> None:
        self.refused += refused
        self.table_full += table_full
        if self._mm is not None:
            F.WSTAT.pack_into(self._mm, F.OFF_WSTAT, self.refused, self.table_full, 0)

    # -- hot path ------------------------------------------------------------------------

    def on_round(self, rec: RoundRecord) -> None:
        sid, burst, index, t, k, j, ctx, seq_rows, split, _ = rec  # repeat: 1 from a loop
        with self._lock:
            mm = self._mm
            if mm is None:
                return
            pos = self._pos
            r = self._rec
            off = self._data + ((pos & self._mask) << F.SLOT_SHIFT)
            try:
                if split is None:
                    F.ROUND.pack_into(mm, off, pos + 1, (r << 16) | 0x201, sid, burst, index, *t,
                                      k, j, ctx, seq_rows)  # fmt: skip
                else:
                    F.ROUND_SPLIT.pack_into(mm, off, pos + 1, (r << 16) | 0x301, sid, burst,
                                            index, *t, k, j, ctx, seq_rows, *split)  # fmt: skip
            except (struct.error, TypeError):
                self._count(refused=1)  # the slot is past head: rewritten by the next record
                return
            self._pos = pos + 1
            self._rec = r + 1
            F.HEAD.pack_into(mm, F.OFF_HEAD, pos + 1, r + 1)

    def on_burst(self, rec: BurstRecord) -> None:
        self._put(rec)

    def on_first_token(self, rec: FirstTokenRecord) -> None:
        self._put(rec)

    def on_session(self, rec: SessionRecord) -> None:
        with self._lock:
            free = self._free
            slot = free.pop() if free else -1
        try:
            payload = F.encode_session(rec, slot >= 0)
        except (struct.error, TypeError, UnicodeEncodeError):
            self._count(refused=1)
            self._release(slot)
            return
        if slot < 0:
            self._count(table_full=1)
        elif len(payload) > F.TABLE_ENTRY - F.TABLE_HDR:
            self._release(slot)
            slot = -1
            payload = F.encode_session(rec, False)
            self._count(table_full=1)
        self._write(F.KIND_SESSION, payload, table=(slot, rec.session))

    def on_session_end(self, rec: SessionEndRecord) -> None:
        self._put(rec)
        with self._lock:
            slot = self._entry.pop(rec.session, -1)
            mm = self._mm
            if slot >= 0 and mm is not None:
                # Freed after the end record's head store: a reader that finds the entry
                # gone knows the end record sits below the head it reads next.
                F.U64.pack_into(mm, self._geo.table_off + slot * F.TABLE_ENTRY, 0)
                self._free.append(slot)

    def _release(self, slot: int) -> None:
        if slot >= 0:
            with self._lock:
                self._free.append(slot)

    def _put(self, rec: Record) -> None:
        try:
            kind, payload = F.encode(rec)
        except (struct.error, TypeError, UnicodeEncodeError):
            self._count(refused=1)
            return
        self._write(kind, payload)

    def _write(self, kind: int, payload: bytes, table: tuple[int, int] = (-1, 0)) -> None:
        """A record of one or more slots: every slot (seq, meta, payload), then the table
        entry, then head."""
        n = max(1, -(-len(payload) // F.PAYLOAD))
        if n > F.MAXSPAN:
            self._count(refused=1)
            self._release(table[0])
            return
        with self._lock:
            mm = self._mm
            if mm is None:
                return
            pos, r, mask, data = self._pos, self._rec, self._mask, self._data
            for i in range(n):
                off = data + (((pos + i) & mask) << F.SLOT_SHIFT)
                meta = (r << 16) | ((kind << 8) | n if i == 0 else i)
                F.SLOT_HEAD.pack_into(mm, off, pos + i + 1, meta)
                chunk = payload[i * F.PAYLOAD : (i + 1) * F.PAYLOAD]
                mm[off + F.SLOT_HDR : off + F.SLOT_HDR + len(chunk)] = chunk
            slot, sid = table
            if slot >= 0:
                # Before head: a reader that sees this record published also sees its entry.
                eoff = self._geo.table_off + slot * F.TABLE_ENTRY
                F.TABLE_ENTRY_HEAD.pack_into(mm, eoff, 0, sid, len(payload))
                mm[eoff + F.TABLE_HDR : eoff + F.TABLE_HDR + len(payload)] = payload
                F.U64.pack_into(mm, eoff, pos + 1)
                self._entry[sid] = slot
            self._pos = pos + n
            self._rec = r + 1
            F.HEAD.pack_into(mm, F.OFF_HEAD, pos + n, r + 1)

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def written(self) -> int:
        """Records published so far."""
        return self._rec

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Mark the ring closed and drop the liveness lock; the file stays for the agent."""
        with self._lock:
            mm, self._mm = self._mm, None
            if mm is None:
                return
            F.WSTAT.pack_into(mm, F.OFF_WSTAT, self.refused, self.table_full, 1)
            mm.close()
            os.close(self._fd)


def _prefault(mm: mmap.mmap, start: int, end: int) -> None:
    """Touch every page now (start-up), so no round ever takes a page fault for it."""
    zeros = bytes(1 << 20)
    for off in range(start, end, len(zeros)):
        n = min(len(zeros), end - off)
        mm[off : off + n] = zeros[:n]


_MEMORY_FS = frozenset(("tmpfs", "ramfs", "hugetlbfs"))


def fs_type(path: str) -> str:
    """The filesystem type holding ``path`` (from /proc/self/mounts; "" when unknown)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        return ""
    return kind


def _warn_if_on_disk(directory: str) -> None:
    kind = fs_type(directory)
    if kind and kind not in _MEMORY_FS:
        say_once(
            f"ring-fs:{directory}",
            f"{MEMRA_OBS_AGENT}={directory} is on {kind}, not in memory: the kernel's writeback "
            "of the ring costs the loop page faults; use /dev/shm or a k8s emptyDir with "
            "medium: Memory",
        )


def _reopen_in_child(ref: weakref.ReferenceType[RingSink]) -> None:
    """A forked child must not write into its parent's ring: give it its own."""
    sink = ref()
    if sink is None or sink._mm is None:
        return
    sink._lock = threading.Lock()
    try:
        sink._mm.close()
    except Exception:
        pass
    os.close(sink._fd)  # the parent's lock stays: it holds its own descriptor
    sink._mm = None
    try:
        sink._open()
    except OSError:
        sink._mm = None
