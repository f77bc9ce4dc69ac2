#!/usr/bin/env bash
# Regenerates docs/report.png, the README's picture of `memra-obs report`: two seeded demo runs
# (the second at 1/1.1 the speed: 1.1x the simulated time), their A/B page, and the top of it as headless
# Chromium renders it (Debian: apt-get install chromium). Needs the [report] extra in .venv.
EXTRAS="dev,otlp" source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for run in "base 1 4" "new 2 3.6364"; do
  set -- $run
  (cd "$tmp" && MEMRA_OBS_METRICS_ADDR= MEMRA_OBS_SPANS_FILE="$1.jsonl" \
    "$root/.venv/bin/memra-obs" demo --requests 12 --seed "$2" --speed "$3" 2> "$1.log")
done
(cd "$tmp" && "$root/.venv/bin/memra-obs" report base.log new.log -o report.html)
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$tmp/profile" --hide-scrollbars --window-size=1280,1900 \
  --screenshot="$root/docs/report.png" "file://$tmp/report.html" 2>/dev/null
echo "docs/report.png: $(stat -c %s "$root/docs/report.png") bytes"
