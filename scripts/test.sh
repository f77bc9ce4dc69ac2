#!/usr/bin/env bash
# The whole test suite. Installs what it needs: the project with its [dev,otlp] extras in
# ./.venv, when run as root on Debian the `prometheus` package (Prometheus + promtool) for
# the integration tests, and, where Go is present, the peers of tests/peers/
# (scripts/peers.sh). Extra arguments go to pytest (e.g. -k legacy, -x).
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
# The real peers (Jaeger v2, the OpenTelemetry Collector, Prometheus 3) built from the Go
# module proxy at the versions pinned in tests/peers/pins/ (README, "Real peers"): cached outside
# the clone, so only a first run builds (minutes). Without Go, or when the build fails (no
# network), tests/peers/ skips with one reason -- unless MEMRA_OBS_REQUIRE_PEERS=1 (CI).
require_peers="${MEMRA_OBS_REQUIRE_PEERS:-}"
[ "$require_peers" = 0 ] && require_peers=""
if command -v go >/dev/null; then
  if ! bash scripts/peers.sh >&2; then
    if [ -n "$require_peers" ]; then
      echo "[test.sh] MEMRA_OBS_REQUIRE_PEERS is set and the peers did not build" >&2
      exit 1
    fi
    echo "[test.sh] the peers did not build: tests/peers/ will skip" >&2
  fi
else
  echo "[test.sh] go not found: tests/peers/ (Jaeger, Collector, Prometheus 3) will skip" >&2
fi
exec .venv/bin/python -m pytest "$@"
