"""The house as docs/ARCHITECTURE.md draws it: imports point one way, rooms stay small."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "memra_obs"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _table() -> dict[str, set[str] | None]:
    """part -> the parts it may import (None: anything), from the doc's import table."""
    rules: dict[str, set[str] | None] = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| `([^`]+)` \| [^|]+ \| (.+) \|$", line)
        if m is None:
            continue
        allowed = m.group(2)
        rules[m.group(1)] = (
            None if allowed == "anything" else set(re.findall(r"`([^`]+)`", allowed))
        )
    return rules


RULES = _table()


def _part(rel: str) -> str:
    """The table's part holding module ``rel`` (``agent/ring.py``, or its package ``agent/``)."""
    if rel in RULES:
        return rel
    folder = rel.split("/")[0] + "/"
    if "/" in rel and folder in RULES:
        return folder
    raise AssertionError(f"memra_obs/{rel} is in no row of docs/ARCHITECTURE.md")


def _module_file(dotted: str) -> str:
    """``memra_obs.agent.ring`` -> ``agent/ring.py`` (a package: its ``__init__.py``)."""
    parts = dotted.split(".")[1:]
    path = PKG.joinpath(*parts)
    if path.is_dir():
        return "/".join([*parts, "__init__.py"])
    return "/".join(parts) + ".py"


def _imports(path: Path, text: str | None = None) -> list[tuple[int, str]]:
    """(line, module) for every import of the package in ``path`` (or ``text`` as if there), at
    any depth, except those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text() if text is None else text)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            skip.update(id(n) for b in node.body for n in ast.walk(b))  # its else: runs
    rel = path.relative_to(ROOT).with_suffix("")
    package = list(rel.parts if path.name == "__init__.py" else rel.parts[:-1])
    if path.name == "__init__.py":
        package = package[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("memra_obs")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if not target.startswith("memra_obs"):
                continue
            if node.module is None or target == "memra_obs":  # from . import flags
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    is_mod = PKG.joinpath(*sub.split(".")[1:]).with_suffix(".py").exists()
                    out.append((node.lineno, sub if is_mod else target))
            else:
                out.append((node.lineno, target))
    return out


MODULES = sorted(PKG.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_follow_the_table(path: Path) -> None:
    """Every import of the package in this module goes to a part its row allows."""
    rel = str(path.relative_to(PKG))
    part = _part(rel)
    allowed = RULES[part]
    if allowed is None:
        return
    bad = []
    for line, target in _imports(path):
        tpart = _part(_module_file(target)) if target != "memra_obs" else "__init__.py"
        if tpart != part and tpart not in allowed:
            bad.append(f"{rel}:{line} imports {target} ({tpart}); its row allows {sorted(allowed)}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_rooms_stay_small(path: Path) -> None:
    """No module over 500 lines, no function over 60."""
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES, f"{path.name}: over {MAX_MODULE_LINES} lines"
    long = [
        f"{n.name} ({n.end_lineno - n.lineno + 1} lines)"  # type: ignore[operator]
        for n in ast.walk(ast.parse(text))
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES  # type: ignore[operator]
    ]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_function_level_imports_and_type_checkings_else_are_seen() -> None:
    """The checker itself: an import in a function or under ``if TYPE_CHECKING:``'s ``else:``
    runs, so it counts; only the ``if`` body (types, never run) is skipped."""
    text = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import wiring\n"
        "else:\n    from . import export\ndef f():\n    from .prom import model\n"
    )
    found = _imports(PKG / "records.py", text)
    assert found == [(5, "memra_obs.export"), (7, "memra_obs.prom")]


def test_the_table_names_only_parts_that_exist() -> None:
    """A row for a module that is gone would let the table drift from the code."""
    for part in RULES:
        assert (PKG / part).exists(), f"docs/ARCHITECTURE.md names {part}, which does not exist"


def _private_copies() -> list[str]:
    """Modules the doc's "Private copies" section names (its list lines, backticked paths)."""
    text = DOC.read_text().split("## Private copies", 1)[1].split("\n## ", 1)[0]
    items = [ln for ln in text.splitlines() if ln.startswith("- ")]
    return [m for ln in items for m in re.findall(r"`([a-z_/]+\.py)`", ln.split(":")[0])]


def test_private_copies_name_their_goal() -> None:
    """DESIGN §9: a module that does what a library does says which measured goal needs it."""
    mods = _private_copies()
    assert len(mods) == 5, mods
    for rel in mods:
        doc = ast.get_docstring(ast.parse((PKG / rel).read_text())) or ""
        assert "Goal (DESIGN §9)" in doc, f"memra_obs/{rel} names no goal in its docstring"


def test_rows_go_from_the_bottom_of_the_house_up() -> None:
    """The doc reads the table top down as the house's floors: a row imports only rows above it
    (requests.py once sat below session.py and otel/, which import it)."""
    order = list(RULES)
    bad = [
        f"{part} imports {a}, a row below it"
        for part, allowed in RULES.items()
        for a in allowed or ()
        if order.index(a) > order.index(part)
    ]
    assert not bad, "\n".join(bad)
