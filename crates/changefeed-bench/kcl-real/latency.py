#!/usr/bin/env python3
"""Record latency of the real Java KCL 2.5.8 and of `changefeed run --properties`, both
running the same MultiLangDaemon record processor (latency_processor.py), on one one-shard
stream of kinesis-mock, in polling and in enhanced fan-out mode.

Started by run.sh with `--latency` (which prepares the venv, the servers and the
environment). For each side and mode in turn: a fresh stream and application, one worker; a
writer puts one record every --interval seconds whose data is its wall-clock time; the
processor writes `receive time - put time` per record. The first --warmup records are left
out (the worker's start); the next --records are the sample. Every wait has a deadline; every
process carries CHANGEFEED_KCL_REAL_RUN and is killed at exit (bench.py's cleanup).
"""
import argparse
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench  # noqa: E402  (the processes, streams and cleanup of the side-by-side bench)
from bench import BenchError, log  # noqa: E402


def put_times(stream, interval, stop):
    while not stop.is_set():
        t = time.monotonic()
        try:
            stream.k.put_record(
                StreamName=stream.name,
                Data=f"{time.time() * 1000.0:.1f}".encode(),
                PartitionKey="k",
            )
        except Exception as e:  # counted by the gap it leaves; the sample waits for enough
            log(f"put failed: {e}")
        stop.wait(max(0.0, interval - (time.monotonic() - t)))


def properties(path, args, stream, app, mode):
    with open(path, "w") as f:
        f.write(
            "\n".join(
                [
                    f"executableName = {sys.executable} {os.path.join(HERE, 'latency_processor.py')}",
                    f"streamName = {stream.name}",
                    f"applicationName = {app}",
                    "workerId = w1",
                    "AWSCredentialsProvider = EnvironmentVariableCredentialsProvider",
                    "processingLanguage = python/3",
                    "initialPositionInStream = LATEST",
                    "regionName = us-east-1",
                    f"kinesisEndpoint = {args.kinesis}",
                    f"dynamoDBEndpoint = {args.dynamodb}",
                    "metricsLevel = NONE",
                    "cloudWatchClient.endpointOverride = http://127.0.0.1:9",
                    f"retrievalMode = {mode.upper()}",
                    # Every other setting (idleTimeBetweenReadsInMillis, the fan-out consumer's
                    # name) is left at each side's default.
                    "",
                ]
            )
        )


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(args, side, mode, kinesis):
    app = f"cflat-{side}-{mode}-{bench.RUN_ID}"
    stream = bench.Stream(kinesis, app, 1)
    work = os.path.join(args.work, f"{side}-{mode}")
    os.makedirs(work, exist_ok=True)
    out = os.path.join(work, "latency.txt")
    props = os.path.join(work, "app.properties")
    properties(props, args, stream, app, mode)
    env = dict(os.environ, KCL_LATENCY_OUT=out)
    if side == "kcl":
        argv = ["java", f"-Xmx{args.java_heap}", "-cp", os.path.join(args.jars, "*"),
                "software.amazon.kinesis.multilang.MultiLangDaemon", "--properties-file", props]
    else:
        argv = [args.changefeed, "run", "--properties", props]
    p = bench.spawn(argv, os.path.join(work, "worker.log"), env=env, cwd=work)
    stop = threading.Event()
    writer = threading.Thread(target=put_times, args=(stream, args.interval, stop), daemon=True)
    writer.start()
    try:
        want = args.warmup + args.records
        deadline = time.monotonic() + args.deadline
        lines = []
        while len(lines) < want:
            if p.poll() is not None:
                raise BenchError(f"{side} ({mode}) exited {p.returncode}; log: {bench.tail(p.logfile)}")
            if time.monotonic() > deadline:
                raise BenchError(f"{side} ({mode}): {len(lines)} of {want} records within {args.deadline:.0f} s; log: {bench.tail(p.logfile)}")
            time.sleep(0.1)  # polls the file the processor appends to, within the deadline
            try:
                with open(out) as f:
                    lines = [float(x) for x in f.read().split()]
            except OSError:
                lines = []
        sample = lines[args.warmup:want]
        res = {"p50": percentile(sample, 0.50), "p99": percentile(sample, 0.99), "n": len(sample)}
        log(f"{side} {mode}: p50 {res['p50']:.0f} ms, p99 {res['p99']:.0f} ms over {res['n']} records")
        return res
    finally:
        stop.set()
        bench.stop(p)
        stream.delete()


def main():
    ap = argparse.ArgumentParser(description="Record latency: real KCL 2.5.8 against changefeed run --properties")
    ap.add_argument("--changefeed", required=True)
    ap.add_argument("--jars", required=True)
    ap.add_argument("--dynamodb", required=True)
    ap.add_argument("--kinesis", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--records", type=int, default=200, help="records in each sample")
    ap.add_argument("--warmup", type=int, default=20, help="records left out at each start")
    ap.add_argument("--interval", type=float, default=0.25, help="seconds between puts")
    ap.add_argument("--modes", default="polling,fanout")
    ap.add_argument("--sides", default="kcl,ours")
    ap.add_argument("--deadline", type=float, default=420, help="seconds for each sample, start included")
    ap.add_argument("--java-heap", default="512m")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    kinesis = bench.aws_client("kinesis", args.kinesis)
    results = {}
    for mode in args.modes.split(","):
        for side in args.sides.split(","):
            try:
                results[(side, mode)] = measure(args, side, mode, kinesis)
            except BenchError as e:
                log(f"{side} {mode}: {e}")
    print()
    print("| record latency, put to processor (ms) | p50 | p99 |")
    print("|---|---:|---:|")
    for (side, mode), r in results.items():
        name = "KCL 2.5.8" if side == "kcl" else "changefeed run --properties"
        print(f"| {name}, {mode} | {r['p50']:.0f} | {r['p99']:.0f} |")
    fields = []
    for mode in args.modes.split(","):
        for side in args.sides.split(","):
            r = results.get((side, mode))
            for q in ("p50", "p99"):
                fields.append(f"{side}_{mode}_{q}_ms={'NA' if r is None else f'{r[q]:.0f}'}")
    print("RESULT " + " ".join(fields), flush=True)
    return 0 if len(results) == len(args.modes.split(",")) * len(args.sides.split(",")) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        bench.cleanup()
