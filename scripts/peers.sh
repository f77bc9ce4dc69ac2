#!/usr/bin/env bash
# Build the real peers of the test suite from the Go module proxy, at the versions pinned in
# tests/peers/pins/ (see README, "Real peers"), and print where the binaries are:
#
#   bash scripts/peers.sh            build what is missing (idempotent), print NAME=PATH lines
#   bash scripts/peers.sh --check    build nothing: print NAME=PATH of what is built; exit 1
#                                    (one line per missing binary on stderr) if anything is not
#
#   jaeger      Jaeger v2 (github.com/jaegertracing/jaeger/cmd/jaeger)   tests/peers/pins/jaeger/go.mod
#   otelcol     an OpenTelemetry Collector made by the collector builder  tests/peers/pins/otelcol/builder.yaml
#   prometheus  Prometheus 3 (github.com/prometheus/prometheus/cmd/prometheus)  tests/peers/pins/prometheus/go.mod
#
# Everything lives under one cache root outside the clone, ${MEMRA_OBS_PEERS_CACHE:-
# $HOME/.cache/memra-obs/peers}: Go's module and build caches, and the binaries, named by
# their pinned version and a key of every build input (pin files, flags, Go version), so a
# second run costs a few seconds and a changed pin builds a new binary beside the old one.
# Needs `go` (1.26) and the Go module proxy; nothing else. On failure: one line saying what
# failed on stderr, exit status 1.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pins="$root/tests/peers/pins"
cache="${MEMRA_OBS_PEERS_CACHE:-$HOME/.cache/memra-obs/peers}"
mode="build"
case "${1:-}" in
  "") ;;
  --check) mode="check" ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

fail() { echo "[peers.sh] FAILED: $*" >&2; exit 1; }

command -v go >/dev/null || fail "go not found on PATH (the peers are built with Go >= 1.26)"
goversion="$(go env GOVERSION)"

export GOMODCACHE="$cache/go/mod" GOCACHE="$cache/go/build" GOPATH="$cache/go/path"
# The machine's own Go, never a downloaded toolchain; go.sum is the pin, never rewritten.
export GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0
# A go.work above the clone must not take part (a user's GOPROXY/GOPRIVATE still applies).
export GOWORK=off

# The version a go.mod pins for module $2 (its require line).
pinned() { awk -v m="$2" '$1 == m { print $2; exit }' "$1"; }

# A short key of the build inputs: the flags ($1), the files (the rest), the Go version.
key() {
  local flags="$1"
  shift
  { cat "$@"; printf '%s\n' "$goversion" "$flags"; } | sha256sum | cut -c1-12
}

jaeger_mod=github.com/jaegertracing/jaeger
prom_mod=github.com/prometheus/prometheus
ocb_mod=go.opentelemetry.io/collector/cmd/builder
jaeger_v="$(pinned "$pins/jaeger/go.mod" "$jaeger_mod")"
prom_v="$(pinned "$pins/prometheus/go.mod" "$prom_mod")"
ocb_v="$(pinned "$pins/otelcol/go.mod" "$ocb_mod")"
[ -n "$jaeger_v" ] && [ -n "$prom_v" ] && [ -n "$ocb_v" ] || fail "a pin is missing in $pins/*/go.mod"

# Jaeger v2. Its module path has no /v2: module version v1.76.0 is the v2.13.0 release.
jaeger_release="v2.13.0"
jaeger_ldflags="-s -w -X $jaeger_mod/internal/version.latestVersion=$jaeger_release"
jaeger_bin="$cache/bin/jaeger-$jaeger_v-$(key "$jaeger_ldflags" "$pins/jaeger/go.mod" "$pins/jaeger/go.sum")"

# Prometheus 3: module version v0.3MM.P is release 3.MM.P. Built with service discovery
# limited to static/file/http (remove_all_sd) and without the embedded UI assets (no
# builtinassets tag): the HTTP API is what the tests use.
minor="${prom_v#v0.}"
prom_release="3.$((10#${minor:1:2})).${minor#*.}"
prom_tags="netgo,remove_all_sd"
pv="github.com/prometheus/common/version"
prom_ldflags="-s -w -X $pv.Version=$prom_release -X $pv.Branch=memra-obs-peers -X $pv.Revision=$prom_v"
prom_bin="$cache/bin/prometheus-$prom_v-$(key "$prom_tags $prom_ldflags" "$pins/prometheus/go.mod" "$pins/prometheus/go.sum")"

# The collector: the builder compiles it with -trimpath -ldflags="-s -w" itself.
ocb_key="$(key "ocb" "$pins/otelcol/go.mod" "$pins/otelcol/go.sum" "$pins/otelcol/builder.yaml")"
otelcol_v="$(awk '$1 == "version:" { print $2; exit }' "$pins/otelcol/builder.yaml")"
otelcol_bin="$cache/bin/otelcol-$otelcol_v-$ocb_key"

print_paths() {
  echo "jaeger=$jaeger_bin"
  echo "otelcol=$otelcol_bin"
  echo "prometheus=$prom_bin"
}

if [ "$mode" = "check" ]; then
  missing=0
  for b in "$jaeger_bin" "$otelcol_bin" "$prom_bin"; do
    if [ ! -x "$b" ]; then
      echo "[peers.sh] not built: $b (run: bash scripts/peers.sh)" >&2
      missing=1
    fi
  done
  print_paths
  exit "$missing"
fi

mkdir -p "$cache/bin" "$cache/tmp"
# One build at a time per cache (several clones may share it).
exec 9>"$cache/.lock"
flock 9

# go build into a temporary name, then rename: an interrupted build leaves no binary. Go's
# output (hundreds of "downloading" lines on a cold cache) goes to a log, shown on failure.
build() {  # name out dir go-build-args...
  local name="$1" out="$2" dir="$3"
  shift 3
  if [ -x "$out" ]; then
    echo "[peers.sh] $name: cached $out" >&2
    return 0
  fi
  echo "[peers.sh] $name: building $(basename "$out") (first build: minutes)" >&2
  local t0=$SECONDS log="$cache/tmp/$name.log"
  if ! (cd "$dir" && go build -o "$out.tmp" "$@") >"$log" 2>&1; then
    tail -40 "$log" >&2
    fail "$name: go build in $dir failed (log: $log)"
  fi
  mv -f "$out.tmp" "$out"
  rm -f "$log"
  echo "[peers.sh] $name: built in $((SECONDS - t0))s" >&2
}

build jaeger "$jaeger_bin" "$pins/jaeger" -trimpath -ldflags="$jaeger_ldflags" "$jaeger_mod/cmd/jaeger"

build prometheus "$prom_bin" "$pins/prometheus" -trimpath -tags "$prom_tags" \
  -ldflags="$prom_ldflags" "$prom_mod/cmd/prometheus"

if [ -x "$otelcol_bin" ]; then
  echo "[peers.sh] otelcol: cached $otelcol_bin" >&2
else
  ocb_bin="$cache/bin/ocb-$ocb_v-$(key "ocb" "$pins/otelcol/go.mod" "$pins/otelcol/go.sum")"
  build ocb "$ocb_bin" "$pins/otelcol" -trimpath -ldflags="-s -w" "$ocb_mod"
  work="$cache/tmp/otelcol-$ocb_key"
  rm -rf "$work"
  mkdir -p "$work"
  echo "[peers.sh] otelcol: generating and building with ocb $ocb_v (first build: minutes)" >&2
  t0=$SECONDS
  # The builder writes go.mod/go.sum of the generated module (it needs -mod=mod there).
  (cd "$work" && GOFLAGS="-buildvcs=false" "$ocb_bin" --config="$pins/otelcol/builder.yaml") \
    >"$work.log" 2>&1 || { tail -40 "$work.log" >&2; fail "otelcol: the collector builder failed (log: $work.log)"; }
  name="$(awk '$1 == "name:" { print $2; exit }' "$pins/otelcol/builder.yaml")"
  mv -f "$work/src/$name" "$otelcol_bin"
  rm -rf "$work" "$work.log"
  echo "[peers.sh] otelcol: built in $((SECONDS - t0))s" >&2
fi

print_paths
