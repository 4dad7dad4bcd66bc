#!/usr/bin/env bash
# Quickstart, command 2: install into .venv (with the test extras) and run the whole suite.
# Uses PostgreSQL and Redis on 127.0.0.1 when they answer (DATABASE_URL / TEST_REDIS_URL override);
# without them the tests that need them skip loudly, except under CI=true where they fail.
#
# The suite runs in TEST_PROCESSES pytest processes (default 3; 1 = one process, output as it
# goes), each with its own test database and Redis db: pytest-split gives each process a third
# of the tests by the durations recorded in .test_durations (refresh them with
# `TEST_PROCESSES=1 bash scripts/test.sh --store-durations`). Most of a test's time is spent
# waiting on workers, servers and deadlines, so three processes keep two cores busy.
# Arguments go to every pytest process.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# Installed once per version of pyproject.toml (a stamp in .venv): a second run starts at once.
stamp=.venv/.chatmem-test-install
wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[test,langgraph]'
  echo "$wanted" > "$stamp"
fi

port_open() { .venv/bin/python -c "import socket,sys; socket.create_connection(('127.0.0.1', $1), 1)" 2>/dev/null; }
if [ -z "${DATABASE_URL:-}" ] && port_open 5432; then
  export DATABASE_URL="postgres://postgres@127.0.0.1:5432/chatmem"
fi
if [ -z "${TEST_REDIS_URL:-}" ] && port_open 6379; then
  export TEST_REDIS_URL="redis://127.0.0.1:6379/15"
fi
processes="${TEST_PROCESSES:-3}"
echo "tests: DATABASE_URL=${DATABASE_URL:-<sqlite default>} TEST_REDIS_URL=${TEST_REDIS_URL:-<none>}, $processes process(es)"
if [ "$processes" -le 1 ]; then
  exec .venv/bin/python -m pytest "$@"
fi

# Process g: the database name and the Redis db number of the given URLs, each made its own
# (PostgreSQL: "<name>_g<g>"; Redis: the db below the given one by g - 1).
database_for() {
  local url=${DATABASE_URL:-}
  case "$url" in postgres*://*/*) echo "${url%%\?*}_g$1" ;; *) echo "$url" ;; esac
}
redis_for() {
  local url=${TEST_REDIS_URL:-}
  [ -n "$url" ] || return 0
  local db=${url##*/}
  [[ "$db" =~ ^[0-9]+$ ]] || db=0
  echo "${url%/*}/$(( (db - $1 + 1 + 16) % 16 ))"
}
logs=$(mktemp -d)
started=$(date +%s)
pids=()
for group in $(seq 1 "$processes"); do
  DATABASE_URL=$(database_for "$group") TEST_REDIS_URL=$(redis_for "$group") \
    .venv/bin/python -m pytest -p no:cacheprovider --splits "$processes" --group "$group" \
    --splitting-algorithm least_duration --durations-path .test_durations "$@" \
    > "$logs/$group.log" 2>&1 &
  pids+=($!)
done
status=0
for index in "${!pids[@]}"; do
  group=$((index + 1))
  if wait "${pids[$index]}"; then result=passed; else result=FAILED; status=1; fi
  echo "== tests, part $group of $processes: $result ($(( $(date +%s) - started )) s)"
done
for group in $(seq 1 "$processes"); do
  echo "== tests, part $group of $processes"
  cat "$logs/$group.log"
done
rm -rf "$logs"
exit "$status"
