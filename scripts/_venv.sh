# Sourced by scripts/demo.sh and scripts/test.sh: make ./.venv exist with the project
# installed (editable) with the extras named in $EXTRAS, reinstalling only when
# pyproject.toml changed. Needs python3 >= 3.10 with venv (Debian: python3-venv).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=".venv/.memra-obs-installed-${EXTRAS:-core}"
# Reinstall when the build inputs change.
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  spec="."
  [ -n "${EXTRAS:-}" ] && spec=".[${EXTRAS}]"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e "$spec"
  echo "$want" > "$stamp"
fi
