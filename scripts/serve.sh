#!/usr/bin/env bash
# Quickstart, command 1: install into .venv and serve the embedded default at
# http://127.0.0.1:8000 (SQLite, in-process consolidation, offline model, no API key).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e .
export DEBUG="${DEBUG:-true}"
exec .venv/bin/python manage.py serve_demo "$@"
