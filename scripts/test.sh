#!/usr/bin/env bash
# Quickstart, command 2: install into .venv (with the test extras) and run the whole suite.
# Uses PostgreSQL and Redis on 127.0.0.1 when they answer (DATABASE_URL / TEST_REDIS_URL override);
# without them the tests that need them skip loudly, except under CI=true where they fail.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[test,langgraph]'

port_open() { .venv/bin/python -c "import socket,sys; socket.create_connection(('127.0.0.1', $1), 1)" 2>/dev/null; }
if [ -z "${DATABASE_URL:-}" ] && port_open 5432; then
  export DATABASE_URL="postgres://postgres@127.0.0.1:5432/chatmem"
fi
if [ -z "${TEST_REDIS_URL:-}" ] && port_open 6379; then
  export TEST_REDIS_URL="redis://127.0.0.1:6379/15"
fi
# Most of a test's time is spent waiting on workers, servers and deadlines, not on the CPU: the
# suite runs in twice as many processes as the machine has cores (TEST_PROCESSES to change it),
# each with its own test database and Redis db (tests/conftest.py), a test file per process.
processes="${TEST_PROCESSES:-$(( 2 * $(nproc) ))}"
echo "tests: DATABASE_URL=${DATABASE_URL:-<sqlite default>} TEST_REDIS_URL=${TEST_REDIS_URL:-<none>}, $processes processes"
exec .venv/bin/python -m pytest -n "$processes" --dist loadfile "$@"
