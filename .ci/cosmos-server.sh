#!/usr/bin/env bash
# Installs (npm, into .ci/servers/cosmosdb-server/, gitignored) and starts on loopback the Cosmos
# DB-compatible server the changefeed-cosmos tests use, unless one this script started is still
# answering, and prints the `export` line of its endpoint. `.ci/run` evals it; by hand:
# `eval "$(bash .ci/cosmos-server.sh)"`.
#
# The server is @vercel/cosmosdb-server (an in-memory Node implementation of the Cosmos DB REST
# API: databases, containers, documents, SQL queries, ETag preconditions, batches; no
# authorization check, HTTP/1.1). It runs with --no-ssl on 127.0.0.1 on a free port (or
# $COSMOS_PORT), recorded in the state directory so the next call reuses it. With --no-ssl its
# account document still advertises https endpoints: clients must use the URL printed here and
# not follow endpoint discovery.
set -euo pipefail
ci="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dir="$ci/servers/cosmosdb-server"
version="1.0.1"
logs="${TMPDIR:-/tmp}/changefeed-ci"
mkdir -p "$dir" "$logs"
log="$logs/cosmosdb-server.log"

# Whether a Cosmos DB server answers on 127.0.0.1:$1 (its account document names its locations).
answers() {
  node -e '
    const req = require("http").get({ host: "127.0.0.1", port: +process.argv[1], path: "/", timeout: 2000 }, (res) => {
      let body = ""; res.on("data", (c) => body += c);
      res.on("end", () => process.exit(res.statusCode === 200 && body.includes("writableLocations") ? 0 : 1));
    });
    req.on("error", () => process.exit(1)); req.on("timeout", () => { req.destroy(); process.exit(1); });
  ' "$1" 2>/dev/null
}

# A port nothing listens on, from the kernel.
free_port() {
  node -e 'const s = require("net").createServer(); s.listen(0, "127.0.0.1", () => { console.log(s.address().port); s.close(); });'
}

command -v npm >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; }

main="$dir/node_modules/@vercel/cosmosdb-server/lib/cli.js"
if [ ! -f "$main" ]; then
  [ -f "$dir/package.json" ] || echo '{"name":"changefeed-ci-cosmosdb-server","private":true}' > "$dir/package.json"
  (cd "$dir" && npm install --no-audit --no-fund --silent "@vercel/cosmosdb-server@$version") >&2
fi

port="${COSMOS_PORT:-}"
if [ -z "$port" ] && [ -f "$dir/port" ]; then
  port="$(cat "$dir/port")"
fi
if [ -z "$port" ] || ! answers "$port"; then
  if [ -z "${COSMOS_PORT:-}" ]; then
    port="$(free_port)"
  fi
  # Every descriptor redirected, so a caller's $(...) does not wait for the server.
  (cd "$dir" && exec nohup node "$main" --host 127.0.0.1 --port "$port" --no-ssl) \
    >"$log" 2>&1 </dev/null &
  echo "$!" > "$dir/pid"
  for _ in $(seq 1 120); do answers "$port" && break; sleep 0.5; done
  if ! answers "$port"; then
    echo "@vercel/cosmosdb-server did not start on 127.0.0.1:$port; its log ($log):" >&2
    tail -50 "$log" >&2
    exit 1
  fi
  echo "$port" > "$dir/port"
fi

echo "export CHANGEFEED_TEST_COSMOS_URL=http://127.0.0.1:$port"
