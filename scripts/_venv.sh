# Sourced by scripts/demo.sh and scripts/test.sh: make ./.venv exist with the project
# installed (editable) with the extras named in $EXTRAS, reinstalling only when
# pyproject.toml changed. Needs python3 >= 3.10 with venv (Debian: python3-venv).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
new_enough='import sys; sys.exit(sys.version_info < (3, 10))'
# A .venv an older python3 made can never install the project: make it again.
if [ -x .venv/bin/python ] && ! .venv/bin/python -c "$new_enough" 2>/dev/null; then
  echo "[venv] .venv has $(.venv/bin/python -V 2>&1); the project needs Python >= 3.10: remaking it" >&2
  rm -rf .venv
fi
# A venv whose making failed half way (Debian without python3-venv: a python, no pip) is unmade.
if [ -x .venv/bin/python ] && ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  echo "[venv] .venv has no pip (its making failed): remaking it" >&2
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  if ! "$py" -c "$new_enough" 2>/dev/null; then
    echo "[venv] $py is $("$py" -V 2>&1 || true); the project needs Python >= 3.10 (PYTHON=python3.12 bash $0)" >&2
    exit 1
  fi
  "$py" -m venv .venv || { rm -rf .venv; echo "[venv] $py -m venv failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
fi
stamp=".venv/.memra-obs-installed-${EXTRAS:-core}"
# Reinstall when the build inputs change.
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  spec="."
  [ -n "${EXTRAS:-}" ] && spec=".[${EXTRAS}]"
  # setuptools' note on every editable install of a flat layout ("be careful with folders in
  # your working directory with the same name as your package", 10 lines) was a fresh clone's
  # first output; pip's own warnings and every other one still show.
  PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Editable installation" \
    .venv/bin/python -m pip install -q --disable-pip-version-check -e "$spec"
  echo "$want" > "$stamp"
fi
