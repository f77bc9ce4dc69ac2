"""``memra-obs report INPUT... [-o report.html]``: read, compute, draw, write one file. Exit
status 0 written; 2 a usage error, an unreadable input, an unwritable output (or one that is
an input), or matplotlib missing (the [report] extra) or unable to start. Nothing here imports
numpy or matplotlib before the command runs."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import stat
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from typing import Any, TextIO

from ..diagnostics import printable

LARGE = 8 << 20  # inputs this large (or of unknown size: a pipe) get a progress bar


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="worker log or span file; - = stdin")
    p.add_argument(
        "-o", "--output", default="report.html", help="HTML file (default report.html; - = stdout)"
    )
    p.add_argument("--progress", action="store_true", help="progress bar even when not a terminal")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no closing line")


class Progress:
    """One line on stderr, rewritten at most every 0.2 s: bytes read, then sections drawn."""

    def __init__(self, on: bool, out: TextIO = sys.stderr) -> None:
        self.on, self.out, self.last, self.shown = on, out, 0.0, False

    def show(self, text: str, force: bool = False) -> None:
        if self.on and (force or time.monotonic() - self.last >= 0.2):
            self.last, self.shown = time.monotonic(), True
            self.out.write(f"\r[memra-obs] report: {text}\x1b[K" if text else "\r\x1b[K")
            self.out.flush()

    def reading(self, name: str) -> Callable[[int, int], None]:
        def update(done: int, total: int) -> None:
            if not total:
                self.show(f"{name} {done / 1e6:.0f} MB")
            elif total >= LARGE:
                bar = "#" * int(30 * done / total)
                self.show(f"{name} |{bar:<30}| {done / 1e6:.0f}/{total / 1e6:.0f} MB")

        return update

    def step(self, name: str) -> None:
        """``name`` ("" when done: the line is cleared)."""
        if self.shown:
            self.show(name and f"drawing {name}", force=True)


def main(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401  (it needs numpy)
    except ImportError:
        print("memra-obs report needs matplotlib: pip install 'memra_obs[report]'", file=sys.stderr)
        return 2
    except OSError as exc:  # no writable config or temp directory (a read-only container)
        return _error(f"matplotlib cannot start: {exc}")
    if len(args.inputs) > 2 or args.inputs.count("-") > 1:
        return _error("one input, or two for A/B (at most one of them -)")
    if not args.output.strip():  # "" was ": Is a directory", " " a file named " "
        return _error(f"-o {args.output!r}: name a file (or /dev/stdout)")
    args.output = "/dev/stdout" if args.output == "-" else args.output  # was a file named "-"
    for path in args.inputs:  # the page would replace the log it was made from (`- < log`)
        with contextlib.suppress(OSError):
            st = os.fstat(0) if path == "-" else os.stat(path)
            if stat.S_ISREG(st.st_mode) and os.path.samestat(st, os.stat(args.output)):
                return _error(f"-o {args.output} is the input {path}")
    from ..environment import MEMRA_OBS_MAX_FAMILIES as FAM
    from ..environment import Settings, utf8
    from .inputs import read
    from .page import render
    from .stats import View, ab_table

    # The one knob a report reads, checked as the tail's (serving and TLS knobs are not its own).
    top = Settings.resolve({FAM: os.environ[FAM]} if FAM in os.environ else {}).max_families
    bar, views = Progress(not args.quiet and (args.progress or sys.stderr.isatty())), []
    for i, path in enumerate(args.inputs):
        name = "stdin" if path == "-" else utf8(os.path.basename(path) or path)  # a UTF-8 page
        label = ("AB"[i] + ": " if len(args.inputs) == 2 else "") + name
        try:
            views.append(View(label, read(path, bar.reading(label), top)))
        except (OSError, EOFError, zlib.error) as exc:  # a gzip'd input cut short or damaged
            bar.step("")
            return _error(f"{path}: {getattr(exc, 'strerror', None) or exc}")
    if len(views) == 2 and (empty := [v.label for v in views if not v.run.rounds]):
        bar.step("")
        return _error(f"no A/B comparison: {' and '.join(empty)} has no rounds")
    bar.step("A/B table" if len(views) == 2 else "figures")
    ab = ab_table(*views) if len(views) == 2 else None
    page = render(views, ab, bar.step)
    bar.step("")
    try:
        _write(args.output, page)
    except OSError as exc:
        return _error(f"{args.output}: {exc.strerror or exc}")
    if not args.quiet:
        what = "; ".join(_summary(v.label, v.run) for v in views)
        if ab is not None:
            what += f"; flagged: {', '.join(r.metric for r in ab if r.flagged) or 'nothing'}"
        mb = len(page.encode()) / 1e6
        _say(f"wrote {args.output} ({mb:.2f} MB): {what}")
    return 0


def _error(message: str) -> int:
    _say(message)
    return 2


def _say(message: str) -> None:
    """One line on stderr; a file name's ESC or newline spelled out (``printable``)."""
    print(f"memra-obs report: {printable(message)}", file=sys.stderr)


def _summary(label: str, run: Any) -> str:
    out = f"{label}: {len(run.sessions)} sessions, {len(run.rounds)} rounds, "
    out += f"{len(run.refused)} lines refused, {len(run.unplaced)} not placed"
    if run.kind == "log" and run.lines and not (run.kinds or run.refused):  # (it read "trace-only")
        out += f" (no tagged line among its {run.lines} lines)"
    return out


def _descriptor(path: str) -> int | None:
    """This process's descriptor that ``path`` names (``/dev/stdout``, ``/dev/fd/N``,
    ``/proc/self/fd/N``, or a link leading to one): written through it, at its offset (an
    ``open()`` by name would truncate what the shell's ``>>`` had and write over it)."""
    for _ in range(40):  # the kernel's own limit on a chain of links
        a = os.path.abspath(path)
        if re.fullmatch(rf"/dev/(stdout|stderr|fd/\d+)|/proc/(self|{os.getpid()})/fd/\d+", a):
            return {"/dev/stdout": 1, "/dev/stderr": 2}.get(a) or int(a.rsplit("/", 1)[1])
        if not os.path.islink(path):
            return None
        path = os.path.join(os.path.dirname(path), os.readlink(path))
    return None


def _planted(path: str) -> str | None:
    """The first link on ``path``'s way that another user made in a sticky world-writable
    directory (/tmp): the kernel's ``fs.protected_symlinks`` follows none, and neither do we
    (``realpath`` and a rename would have replaced what it points at: a victim's file)."""
    # As written, and as realpath reads it ("x/.." where no x is: nothing, not ENOENT).
    todo, links = [os.path.join(os.getcwd(), path), os.path.abspath(path)], 0
    while todo and links <= 40:  # the kernel's own limit on links in one lookup
        parts = todo.pop().split("/")
        for p in ("/".join(parts[:i]) for i in range(2, len(parts) + 1)):
            with contextlib.suppress(OSError):
                if stat.S_ISLNK((st := os.lstat(p)).st_mode):
                    d = os.stat(os.path.dirname(p) or "/")
                    if d.st_mode & 0o1002 == 0o1002 and st.st_uid not in (os.geteuid(), d.st_uid):
                        return p
                    todo.append(os.path.join(os.path.dirname(p), os.readlink(p)))
                    links += 1
    return None


def _write(path: str, page: str) -> None:
    """A file is replaced whole, never left half written: renamed onto the name as given (a
    rename follows no link there, so one planted after the checks replaces only itself); a link
    (the user's own: :func:`_planted`), a pipe or ``/dev/stdout`` is written through, so the
    kernel's ``fs.protected_symlinks`` checks it, and a link is never replaced by a file."""
    if planted := _planted(path):
        why = f"{planted} is another user's link in a sticky directory"
        raise PermissionError(errno.EACCES, why)
    fd = _descriptor(path)
    try:
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        st = None
    if fd is not None or (st is not None and not stat.S_ISREG(st.st_mode)):
        if sys.stdout is not None:  # None: started with it closed (`>&-`)
            sys.stdout.flush()
        with open(path if fd is None else fd, "w", encoding="utf-8", closefd=fd is None) as f:
            f.write(page)
        return
    # O_EXCL under a random name: a link planted at a guessable one would take the page. The
    # name as given, resolved by the kernel ("sub/.." after a linked sub is not abspath's ".").
    tfd, tmp = tempfile.mkstemp(
        dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}."
    )
    try:
        with open(tfd, "w", encoding="utf-8") as f:
            if st is not None and st.st_uid == os.geteuid():  # the report it replaces: its mode
                mode = st.st_mode & 0o777  # (not another user's 0666 left at the name)
            else:
                mask = os.umask(0o022)  # the umask: only setting one reads it
                os.umask(mask)
                mode = 0o666 & ~mask
            os.fchmod(f.fileno(), mode)
            f.write(page)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
