#!/usr/bin/env bash
# The main job: a simulated spec-decode worker on the embedded defaults —
# /metrics on http://127.0.0.1:9464/metrics, spans to ./memra-obs-spans.jsonl (OTLP-JSON),
# the legacy [glm5-phase] lines on stderr. Runs until Ctrl-C; extra arguments go to
# `memra-obs demo` (e.g. --duration 30, --requests 10, --gpu).
EXTRAS="" source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec .venv/bin/memra-obs demo "$@"
