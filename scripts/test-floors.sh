#!/usr/bin/env bash
# The dependency floors pyproject.toml declares, installed exactly in ./.venv-floors, under the
# tests of the parts that use them (prometheus_client's Collector and encoders, the OTel API and
# SDK, grpcio's transport): a floor that is not true fails here, not on a user's machine.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PYTHON:-python3}"
[ -x .venv-floors/bin/python ] || "$py" -m venv .venv-floors
floors=(opentelemetry-api==1.27.0 opentelemetry-sdk==1.27.0 opentelemetry-proto==1.27.0
        opentelemetry-exporter-otlp==1.27.0
        prometheus-client==0.23.1 grpcio==1.60.0)  # [dev]'s exporter: google.rpc for the tests
.venv-floors/bin/python -m pip install -q --disable-pip-version-check "${floors[@]}" \
  pytest pytest-timeout hypothesis pyyaml
.venv-floors/bin/python -m pip list --disable-pip-version-check 2>/dev/null \
  | grep -iE '^(opentelemetry-(api|sdk|proto)|prometheus.client|grpcio) ' >&2
PYTHONPATH="$PWD" exec .venv-floors/bin/python -m pytest -p no:cacheprovider \
  tests/test_prom_*.py tests/test_otel_*.py tests/test_observer.py tests/test_metrics_port.py "$@"
