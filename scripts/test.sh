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
# TEST_PROCESSES=N (N > 1) runs the suite in N processes (pytest-xdist, a test file per
# process), each with its own test database and Redis db (tests/conftest.py). Serial by default:
# a few timing-sensitive tests (server-wide WAL counts, the fake server's concurrency) can fail
# when processes share this machine's 2 cores.
processes="${TEST_PROCESSES:-1}"
echo "tests: DATABASE_URL=${DATABASE_URL:-<sqlite default>} TEST_REDIS_URL=${TEST_REDIS_URL:-<none>}, $processes process(es)"
if [ "$processes" -gt 1 ]; then
  exec .venv/bin/python -m pytest -n "$processes" --dist loadfile "$@"
fi
exec .venv/bin/python -m pytest "$@"
