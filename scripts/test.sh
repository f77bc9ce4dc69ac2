#!/usr/bin/env bash
# The whole test suite. Installs what it needs: the project with its [dev,otlp] extras in
# ./.venv and, when run as root on Debian, the `prometheus` package (Prometheus + promtool)
# for the integration tests. Extra arguments go to pytest (e.g. -k legacy, -x).
EXTRAS="dev,otlp" source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[test.sh] installing Debian's prometheus package for the integration tests" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq prometheus >/dev/null
  else
    echo "[test.sh] prometheus/promtool not found and not root: integration tests will be skipped" >&2
  fi
fi
exec .venv/bin/python -m pytest "$@"
