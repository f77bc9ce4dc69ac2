"""Write, or check, the committed dashboard JSON from the code beside this file.

    python grafana/generate.py           rewrite grafana/dashboards/*.json
    python grafana/generate.py --check   exit 1 naming each committed file that is stale

The JSON is committed so Grafana's file provisioning (grafana/provisioning/dashboards) and
people without the SDK can use it; the code is the source. Needs grafana-foundation-sdk
pinned to a Grafana 11 build (Python >= 3.11).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "dashboards"
sys.path.insert(0, str(HERE))

import dash_spec  # noqa: E402  (needs HERE on sys.path: grafana/ is not a package)
from grafana_foundation_sdk.cog.encoder import JSONEncoder  # noqa: E402

# file name -> builder; one entry per dashboard.
DASHBOARDS = {"memra-spec.json": dash_spec.build}


def render() -> dict[str, str]:
    """Every dashboard's JSON text, exactly as it is committed."""
    return {
        name: json.dumps(build().build(), cls=JSONEncoder, indent=2, ensure_ascii=False) + "\n"
        for name, build in DASHBOARDS.items()
    }


def stale(rendered: dict[str, str]) -> list[str]:
    """Names of committed files that differ from (or are missing for) `rendered`."""
    return [
        n
        for n, text in rendered.items()
        if not (OUT / n).is_file() or (OUT / n).read_text() != text
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if a file is stale")
    args = ap.parse_args(argv)
    rendered = render()
    if args.check:
        bad = stale(rendered)
        for n in bad:
            print(f"stale: {OUT / n} (run python grafana/generate.py)", file=sys.stderr)
        return 1 if bad else 0
    OUT.mkdir(exist_ok=True)
    for n, text in rendered.items():
        (OUT / n).write_text(text)
        print(f"wrote {OUT / n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
