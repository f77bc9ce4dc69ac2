"""``memra-obs report INPUT... [-o report.html]``: read, compute, draw, write one file.

Exit status: 0 written; 2 a usage error, an input that cannot be read, or matplotlib
missing (the report is an optional extra: ``pip install 'memra_obs[report]'``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["add_options", "main"]

#: Inputs at least this large (or of unknown size: a pipe) get a progress bar on a terminal.
LARGE = 8 << 20


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="worker log or span file; - = stdin")
    p.add_argument("-o", "--output", default="report.html", help="HTML file (default report.html)")
    p.add_argument("--progress", action="store_true", help="progress bar even when not a terminal")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no closing line")


class Progress:
    """One line on stderr, rewritten at most every 0.2 s: bytes read, then figures drawn."""

    def __init__(self, on: bool, out: TextIO = sys.stderr) -> None:
        self.on, self.out, self.last, self.shown = on, out, 0.0, False

    def _show(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if self.on and (force or now - self.last >= 0.2):
            self.last, self.shown = now, True
            self.out.write(f"\r[memra-obs] report: {text}\x1b[K")
            self.out.flush()

    def reading(self, name: str) -> Callable[[int, int], None]:
        def update(done: int, total: int) -> None:
            if total and total < LARGE:
                return
            if total:
                bar = "#" * int(30 * done / total)
                self._show(f"{name} |{bar:<30}| {done / 1e6:.0f}/{total / 1e6:.0f} MB")
            else:
                self._show(f"{name} {done / 1e6:.0f} MB")

        return update

    def step(self, name: str) -> None:
        if self.shown:
            self._show(f"drawing {name}", force=True)

    def done(self) -> None:
        if self.shown:
            self.out.write("\r\x1b[K")
            self.out.flush()


def main(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
        import numpy  # noqa: F401
    except ImportError:
        print("memra-obs report needs matplotlib: pip install 'memra_obs[report]'", file=sys.stderr)
        return 2
    if len(args.inputs) > 2 or args.inputs.count("-") > 1:
        print(
            "memra-obs report: one input, or two for A/B (at most one of them -)", file=sys.stderr
        )
        return 2
    from .inputs import read
    from .page import render
    from .stats import Rounds, View, ab_table

    bar = Progress(not args.quiet and (args.progress or sys.stderr.isatty()))
    views = []
    for i, path in enumerate(args.inputs):
        name = "stdin" if path == "-" else os.path.basename(path) or path
        label = ("AB"[i] + ": " if len(args.inputs) == 2 else "") + name
        try:
            run = read(path, bar.reading(label))
        except OSError as exc:
            bar.done()
            print(f"memra-obs report: {path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        views.append(View(label, run, Rounds(run.rounds)))
    bar.step("A/B table" if len(views) == 2 else "figures")
    ab = ab_table(*views) if len(views) == 2 else None
    html = render(views, ab, bar.step)
    tmp = f"{args.output}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(html)
    os.replace(tmp, args.output)
    bar.done()
    if not args.quiet:
        what = "; ".join(
            f"{v.label}: {len(v.run.sessions)} sessions, {len(v.run.rounds)} rounds, "
            f"{len(v.run.refused)} lines refused"
            for v in views
        )
        flagged = [r.metric for r in ab or () if r.flagged]
        if ab is not None:
            what += f"; flagged: {', '.join(flagged) or 'nothing'}"
        size = os.path.getsize(args.output)
        print(
            f"memra-obs report: wrote {args.output} ({size / 1e6:.2f} MB): {what}", file=sys.stderr
        )
    return 0
