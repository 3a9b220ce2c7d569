#!/usr/bin/env bash
# Installs (PyPI moto[server], into a venv) and starts on loopback moto's server, the
# open-source AWS server the DynamoDB lease store and the DynamoDB Streams source are also
# tested against (DynamoDB Local is AWS's own, under AWS's terms), unless already running,
# and prints the `export` line for its endpoint. `scripts/test` sources it; by hand:
# `eval "$(bash .ci/moto-server.sh)"`.
#
# The server binds to 127.0.0.1:$MOTO_PORT, and serves one request at a time
# (.ci/moto-serial.py: its threaded mode races on concurrent writes to one table). Clients need credentials (any will do) and
# must not fall back to the EC2 instance-metadata address; see .ci/aws-services.sh.
set -euo pipefail
ci="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MOTO_PORT="${MOTO_PORT:-5001}"
MOTO_VERSION="${MOTO_VERSION:-5.2.6}"
venv="${CHANGEFEED_MOTO_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/changefeed/moto-venv}"
logs="${TMPDIR:-/tmp}/changefeed-ci"
mkdir -p "$logs"

up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

if ! "$venv/bin/moto_server" --help >/dev/null 2>&1; then
  if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
  fi
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check "moto[server]==$MOTO_VERSION" >&2
fi

if ! up "$MOTO_PORT"; then
  # Every descriptor redirected, so a caller's $(...) does not wait for the server.
  nohup "$venv/bin/python" "$ci/moto-serial.py" 127.0.0.1 "$MOTO_PORT" \
    >"$logs/moto.log" 2>&1 </dev/null &
  for _ in $(seq 1 120); do up "$MOTO_PORT" && break; sleep 0.5; done
  if ! up "$MOTO_PORT"; then
    echo "moto did not start on 127.0.0.1:$MOTO_PORT; its log:" >&2
    tail -50 "$logs/moto.log" >&2
    exit 1
  fi
fi

echo "export CHANGEFEED_TEST_MOTO_URL=http://127.0.0.1:$MOTO_PORT"
