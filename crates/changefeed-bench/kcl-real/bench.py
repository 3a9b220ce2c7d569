#!/usr/bin/env python3
"""The real Java KCL 2.5.8 (MultiLangDaemon) side by side with `changefeed run`.

Started by run.sh, which prepares the venv, the servers and the environment; see the comment
at its top. One stream of --shards shards on kinesis-mock, a writer putting one record per
shard every --write-interval seconds, then for each side in turn (KCL first):

  1. start --initial workers, wait until every shard is owned and the fleet is balanced;
  2. start one more worker: time until it owns its fair share floor(shards / workers)
     (share_s), and until the whole fleet is balanced (balanced_s);
  3. count DynamoDB requests through the counting proxy for --flow-window seconds with the
     writer running, then for --idle-window seconds with the writer paused (idle);
  4. SIGKILL the worker owning the most shards (its whole process group: the JVM and its
     Python record processors; the `changefeed run` process and its handler): time until
     every shard it owned is owned by another worker (failover_s).

Ownership is polled every --poll seconds straight from DynamoDB Local (not through the proxy):
KCL's lease table with a consistent Scan (`leaseOwner` per `leaseKey`), ours with
`changefeed status --json`. Every wait has a deadline; every process started carries the
environment variable CHANGEFEED_KCL_REAL_RUN and is killed at exit.
"""
import argparse
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import boto3
from botocore.config import Config

HERE = os.path.dirname(os.path.abspath(__file__))
RUN_ID = os.environ.setdefault("CHANGEFEED_KCL_REAL_RUN", f"kclreal-{os.getpid()}-{int(time.time())}")
T0 = time.monotonic()


class BenchError(Exception):
    pass


def log(msg):
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- processes

_started = []  # Popen objects, each the leader of its own process group


def spawn(argv, logfile, env=None, cwd=None):
    out = open(logfile, "ab")
    p = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    out.close()
    p.logfile = logfile
    _started.append(p)
    return p


def _marked_pids():
    """Pids of every live process carrying this run's marker, but not this one."""
    marker = f"CHANGEFEED_KCL_REAL_RUN={RUN_ID}".encode()
    me = os.getpid()
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    pids.append(int(d))
        except OSError:
            pass
    return pids


def kill_group(p, sig=signal.SIGKILL):
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def stop(p, grace=5.0):
    """SIGTERM the process group, SIGKILL it after `grace` seconds."""
    if p.poll() is None:
        kill_group(p, signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    kill_group(p, signal.SIGKILL)
    try:
        p.wait(5)
    except subprocess.TimeoutExpired:
        pass


def cleanup():
    global _stopping
    _stopping = True
    for p in _started:
        kill_group(p, signal.SIGKILL)
    # Children that left their group (a handler in its own group, an orphaned record processor).
    for pid in _marked_pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in _started:
        try:
            p.wait(2)
        except subprocess.TimeoutExpired:
            pass


_stopping = False


def _on_signal(signum, _frame):
    global _stopping
    if _stopping:  # a second signal (the terminal's and run.sh's) must not cut the clean-up short
        return
    _stopping = True
    log(f"signal {signum}: stopping every process started, deleting the stream and tables")
    sys.exit(128 + signum)


def tail(path, n=15):
    try:
        with open(path, "rb") as f:
            lines = f.read().decode(errors="replace").splitlines()
        return "\n".join("    " + l[:300] for l in lines[-n:])
    except OSError as e:
        return f"    (cannot read {path}: {e})"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, deadline_s, what, proc=None):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise BenchError(f"{what} exited with {proc.returncode}; its log {proc.logfile}:\n{tail(proc.logfile)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise BenchError(f"{what} did not listen on 127.0.0.1:{port} within {deadline_s} s")


# ---------------------------------------------------------------- AWS clients

def aws_client(service, url):
    return boto3.client(
        service,
        endpoint_url=url,
        region_name="us-east-1",
        config=Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5, read_timeout=20),
    )


class Stream:
    def __init__(self, kinesis, name, shards):
        self.k = kinesis
        self.name = name
        self.k.create_stream(StreamName=name, ShardCount=shards)
        end = time.monotonic() + 60
        while True:
            s = self.k.describe_stream_summary(StreamName=name)["StreamDescriptionSummary"]
            if s["StreamStatus"] == "ACTIVE":
                break
            if time.monotonic() > end:
                raise BenchError(f"stream {name} not ACTIVE within 60 s (status {s['StreamStatus']})")
            time.sleep(0.2)
        self.shards = self.k.list_shards(StreamName=name)["Shards"]
        if len(self.shards) != shards:
            raise BenchError(f"stream {name} has {len(self.shards)} shards, expected {shards}")

    def delete(self):
        try:
            self.k.delete_stream(StreamName=self.name, EnforceConsumerDeletion=True)
        except Exception as e:  # best effort
            log(f"deleting stream {self.name}: {e}")


class Writer(threading.Thread):
    """One record per shard every `interval` seconds (ExplicitHashKey = the shard's start)."""

    def __init__(self, stream, interval):
        super().__init__(daemon=True)
        self.stream = stream
        self.interval = interval
        self.running = threading.Event()
        self.running.set()
        self.stopped = threading.Event()
        self.written = 0
        self.errors = 0
        self.last_error = None

    def run(self):
        n = 0
        while not self.stopped.is_set():
            t = time.monotonic()
            if self.running.is_set():
                recs = [
                    {
                        "Data": json.dumps({"n": n, "shard": s["ShardId"], "t": time.time()}).encode(),
                        "PartitionKey": f"k{i}",
                        "ExplicitHashKey": s["HashKeyRange"]["StartingHashKey"],
                    }
                    for i, s in enumerate(self.stream.shards)
                ]
                try:
                    r = self.stream.k.put_records(StreamName=self.stream.name, Records=recs)
                    self.written += len(recs) - r.get("FailedRecordCount", 0)
                except Exception as e:
                    self.errors += 1
                    self.last_error = str(e)
                n += 1
            self.stopped.wait(max(0.0, self.interval - (time.monotonic() - t)))


# ---------------------------------------------------------------- proxy

class Proxy:
    def __init__(self, upstream, logfile):
        self.port = free_port()
        self.p = spawn(
            [sys.executable, os.path.join(HERE, "ddb_proxy.py"), "--listen", f"127.0.0.1:{self.port}", "--upstream", upstream],
            logfile,
        )
        wait_port(self.port, 15, "the counting proxy", self.p)
        self.url = f"http://127.0.0.1:{self.port}"

    def counts(self):
        with urllib.request.urlopen(f"{self.url}/__counts", timeout=10) as r:
            return json.load(r)


# The price of a write request unit in read request units (DynamoDB on-demand: $1.25 against
# $0.25 a million).
WRITE_WEIGHT = 5.0


def diff_counts(before, after, per_min):
    """Requests per minute by operation (and kind) between two snapshots of the proxy."""
    out = {}
    for op, c in after.items():
        b = before.get(op, {})
        d = {k: (c.get(k, 0) - b.get(k, 0)) * per_min for k in ("n", "failed", "conditional", "rcu", "wcu")}
        bk = b.get("kinds", {})
        d["kinds"] = {k: (v - bk.get(k, 0)) * per_min for k, v in c.get("kinds", {}).items() if v - bk.get(k, 0)}
        if d["n"]:
            out[op] = d
    return out


# ---------------------------------------------------------------- the two sides

class Side:
    name = "?"

    def __init__(self, args, stream, ddb_direct, proxy, work):
        self.args = args
        self.stream = stream
        self.ddb = ddb_direct
        self.proxy = proxy
        self.work = work
        self.workers = {}  # name -> Popen
        self.next_index = 1

    # ownership: {shard: owner or None}
    def owners(self):
        raise NotImplementedError

    def start_worker(self, name):
        raise NotImplementedError

    def delete_table(self):
        raise NotImplementedError

    def add_worker(self):
        name = f"{self.name}-{self.next_index}"
        self.next_index += 1
        self.workers[name] = self.start_worker(name)
        log(f"{self.name}: started {name} (pid {self.workers[name].pid})")
        return name

    def check_alive(self):
        for n, p in self.workers.items():
            if p.poll() is not None:
                raise BenchError(
                    f"{self.name}: worker {n} exited unexpectedly with {p.returncode}; its log {p.logfile}:\n{tail(p.logfile)}"
                )

    def poll_until(self, what, cond, deadline_s):
        """Poll ownership until cond(owners) is true; seconds from now until then."""
        start = time.monotonic()
        end = start + deadline_s
        last = None
        last_err = None
        failing_since = None
        while True:
            self.check_alive()
            try:
                last = self.owners()
                last_err = None
                failing_since = None
                if cond(last):
                    return time.monotonic() - start, last
            except BenchError:
                raise
            except Exception as e:  # a poll that failed: retry, for a while
                last_err = e
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > self.args.poll_error_limit:
                    raise BenchError(
                        f"{self.name}: ownership polls failing for {self.args.poll_error_limit:.0f} s while waiting for "
                        f"{what}: {e} (DynamoDB Local at {self.args.dynamodb} down, or restarted and the table lost?)"
                    )
            if time.monotonic() > end:
                logs = "\n".join(f"  {n}: {p.logfile}" for n, p in self.workers.items())
                raise BenchError(
                    f"{self.name}: {what} not reached within {deadline_s} s; "
                    f"ownership at the last poll: {summarize(last)}"
                    + (f"; last poll error: {last_err}" if last_err else "")
                    + f"\nworker logs:\n{logs}"
                )
            time.sleep(self.args.poll)

    def stop_all(self):
        for p in self.workers.values():
            stop(p)
        self.workers.clear()


def summarize(owners):
    if owners is None:
        return "(no successful poll)"
    per = {}
    for o in owners.values():
        per[o or "(none)"] = per.get(o or "(none)", 0) + 1
    return ", ".join(f"{k}={v}" for k, v in sorted(per.items()))


def counts_by_owner(owners, live):
    c = {w: 0 for w in live}
    for o in owners.values():
        if o in c:
            c[o] += 1
    return c


def balanced(owners, live, shards):
    if len(owners) != shards or any(o not in live for o in owners.values()):
        return False
    c = counts_by_owner(owners, live).values()
    return max(c) - min(c) <= 1


class Kcl(Side):
    name = "kcl"

    def __init__(self, *a):
        super().__init__(*a)
        self.app = f"cfkcl-kcl-{RUN_ID}"
        self.logback = os.path.join(self.work, "logback.xml")
        with open(self.logback, "w") as f:
            f.write(
                """<configuration>
  <appender name="OUT" class="ch.qos.logback.core.ConsoleAppender">
    <encoder><pattern>%d [%thread] %-5level %logger{36} - %msg %n</pattern></encoder>
  </appender>
  <!-- one line per message to a record processor otherwise -->
  <logger name="software.amazon.kinesis.multilang.MessageWriter" level="WARN"/>
  <logger name="software.amazon.kinesis.multilang.LineReaderTask" level="WARN"/>
  <logger name="software.amazon.kinesis.multilang.MultiLangProtocol" level="WARN"/>
  <root level="INFO"><appender-ref ref="OUT"/></root>
</configuration>
"""
            )

    def start_worker(self, name):
        props = os.path.join(self.work, f"{name}.properties")
        with open(props, "w") as f:
            f.write(
                "\n".join(
                    [
                        f"executableName = {sys.executable} {os.path.join(HERE, 'record_processor.py')}",
                        f"streamName = {self.stream.name}",
                        f"applicationName = {self.app}",
                        f"workerId = {name}",
                        # v1 SDK provider (2.5.8's multilang decodes these): AWS_ACCESS_KEY_ID /
                        # AWS_SECRET_ACCESS_KEY only, never the instance-metadata address.
                        "AWSCredentialsProvider = EnvironmentVariableCredentialsProvider",
                        "processingLanguage = python/3",
                        "initialPositionInStream = TRIM_HORIZON",
                        "regionName = us-east-1",
                        f"kinesisEndpoint = {self.args.kinesis}",
                        f"dynamoDBEndpoint = {self.proxy.url}",
                        # No CloudWatch: metrics off, and its client pointed at a closed local port.
                        "metricsLevel = NONE",
                        "cloudWatchClient.endpointOverride = http://127.0.0.1:9",
                        # Polling GetRecords, not enhanced fan-out (SubscribeToShard).
                        "retrievalMode = POLLING",
                        # Every lease timing (failoverTimeMillis, taker and renewer intervals,
                        # maxLeasesToStealAtOneTime) is left at the KCL's default.
                        "",
                    ]
                )
            )
        argv = [
            "java",
            f"-Xmx{self.args.java_heap}",
            "-cp",
            os.path.join(self.args.jars, "*"),
            "software.amazon.kinesis.multilang.MultiLangDaemon",
            "--properties-file",
            props,
            "--log-configuration",
            self.logback,
        ]
        return spawn(argv, os.path.join(self.work, f"{name}.log"), cwd=self.work)

    def owners(self):
        items = []
        kw = {"TableName": self.app, "ConsistentRead": True}
        while True:
            r = self.ddb.scan(**kw)
            items += r["Items"]
            if "LastEvaluatedKey" not in r:
                break
            kw["ExclusiveStartKey"] = r["LastEvaluatedKey"]
        return {it["leaseKey"]["S"]: it.get("leaseOwner", {}).get("S") for it in items}

    def timings_line(self):
        """The lease timings the KCL itself logged at start (its defaults)."""
        for p in self.workers.values():
            try:
                with open(p.logfile, errors="replace") as f:
                    for line in f:
                        if "LeaseCoordinator will renew leases every" in line:
                            return line.split(" - ", 1)[-1].strip()
            except OSError:
                pass
        return "(not found in the worker logs)"

    def delete_table(self):
        try:
            self.ddb.delete_table(TableName=self.app)
        except Exception as e:
            log(f"deleting table {self.app}: {e}")


class Ours(Side):
    name = "ours"

    def __init__(self, *a):
        super().__init__(*a)
        self.table = f"cfkcl-ours-{RUN_ID}"
        q = "region=us-east-1"
        self.store = f"dynamodb://{self.table}?endpoint={self.proxy.url}&{q}"
        self.store_direct = f"dynamodb://{self.table}?endpoint={self.args.dynamodb}&{q}"
        self.source = f"kinesis://{self.stream.name}?endpoint={self.args.kinesis}&{q}"

    def start_worker(self, name):
        argv = [
            self.args.changefeed,
            "run",
            "--store",
            self.store,
            "--source",
            self.source,
            "--handler",
            "cat >/dev/null",
            "--host",
            name,
        ] + self.args.ours_args.split()
        return spawn(argv, os.path.join(self.work, f"{name}.log"), cwd=self.work)

    def owners(self):
        r = subprocess.run(
            [self.args.changefeed, "status", "--json", "--store", self.store_direct],
            capture_output=True,
            timeout=20,
        )
        if r.returncode != 0:
            raise RuntimeError(f"changefeed status exited {r.returncode}: {r.stderr.decode(errors='replace').strip()[:300]}")
        doc = json.loads(r.stdout)
        out = {}
        for lease in doc["leases"]:
            out[lease["partition"]] = lease["owner"] if lease.get("state") == "owned" else None
        return out

    def delete_table(self):
        try:
            self.ddb.delete_table(TableName=self.table)
        except Exception as e:
            log(f"deleting table {self.table}: {e}")


# ---------------------------------------------------------------- one side's run

def run_side(side, args, writer):
    S = args.shards
    res = {"side": side.name}
    try:
        for _ in range(args.initial):
            side.add_worker()
        live = set(side.workers)
        t, owners = side.poll_until(
            f"initial fleet of {args.initial} owning all {S} shards, balanced",
            lambda o: balanced(o, live, S),
            args.deadline_start,
        )
        res["initial_balanced_s"] = t
        log(f"{side.name}: {args.initial} workers balanced after {t:.1f} s: {summarize(owners)}")
        if side.name == "kcl":
            res["kcl_timings"] = side.timings_line()
            log(f"kcl: {res['kcl_timings']}")

        # (a) a worker joins
        n = args.initial + 1
        share = S // n
        joiner = side.add_worker()
        live = set(side.workers)
        start = time.monotonic()
        t_share, owners = side.poll_until(
            f"{joiner} owning its fair share ({share} of {S})",
            lambda o: sum(1 for v in o.values() if v == joiner) >= share,
            args.deadline_join,
        )
        res["share_s"] = time.monotonic() - start
        log(f"{side.name}: {joiner} owns {share} shards after {res['share_s']:.1f} s: {summarize(owners)}")
        remaining = max(1.0, args.deadline_join - (time.monotonic() - start))
        side.poll_until(f"fleet of {n} balanced", lambda o: balanced(o, live, S), remaining)
        res["balanced_s"] = time.monotonic() - start
        log(f"{side.name}: fleet of {n} balanced after {res['balanced_s']:.1f} s")

        # (c) DynamoDB requests per minute, flowing then idle
        time.sleep(args.settle)
        windows = []
        if args.flow_window > 0:
            windows.append(("flowing", args.flow_window))
        windows.append(("idle", args.idle_window))
        for label, secs in windows:
            if label == "idle":
                writer.running.clear()
                time.sleep(args.drain)  # batches in flight, their checkpoints
            side.check_alive()
            o_before = side.owners()
            c_before = side.proxy.counts()
            w_before = writer.written
            time.sleep(secs)
            c_after = side.proxy.counts()
            o_after = side.owners()
            side.check_alive()
            d = diff_counts(c_before, c_after, 60.0 / secs)
            res[f"ddb_{label}"] = d
            res[f"ddb_{label}_total"] = sum(c["n"] for c in d.values())
            res[f"ddb_{label}_rcu"] = sum(c["rcu"] for c in d.values())
            res[f"ddb_{label}_wcu"] = sum(c["wcu"] for c in d.values())
            # On-demand DynamoDB bills a write request unit at five times a read unit.
            res[f"ddb_{label}_units"] = res[f"ddb_{label}_rcu"] + WRITE_WEIGHT * res[f"ddb_{label}_wcu"]
            res[f"ddb_{label}_stable"] = o_before == o_after
            res[f"records_{label}"] = writer.written - w_before
            log(
                f"{side.name}: {label} window {secs:.0f} s: {res[f'ddb_{label}_total']:.1f} DynamoDB requests/min, "
                f"{res[f'ddb_{label}_rcu']:.1f} read + {res[f'ddb_{label}_wcu']:.1f} write units/min"
                + ("" if o_before == o_after else " (ownership changed during the window)")
            )
            if label == "idle":
                writer.running.set()

        # (b) SIGKILL the worker owning the most shards
        owners = side.owners()
        per = counts_by_owner(owners, set(side.workers))
        victim = max(sorted(per), key=lambda w: per[w])
        lost = {s for s, o in owners.items() if o == victim}
        p = side.workers.pop(victim)
        kill_group(p, signal.SIGKILL)
        start = time.monotonic()
        p.wait(10)
        log(f"{side.name}: SIGKILLed {victim} (owned {len(lost)} shards)")
        live = set(side.workers)
        side.poll_until(
            f"the {len(lost)} shards of the killed {victim} owned by live workers",
            lambda o: all(o.get(s) in live for s in lost),
            args.deadline_failover,
        )
        res["failover_s"] = time.monotonic() - start
        res["failover_shards"] = len(lost)
        log(f"{side.name}: {victim}'s {len(lost)} shards owned again after {res['failover_s']:.1f} s")
        res["ok"] = True
        return res
    finally:
        side.stop_all()
        side.delete_table()


# ---------------------------------------------------------------- report

def fmt_s(v):
    return "—" if v is None else f"{v:.1f} s"


def report(args, results, writer):
    kcl = results.get("kcl", {})
    ours = results.get("ours", {})
    n = args.initial + 1
    print()
    print(f"Real KCL 2.5.8 (MultiLangDaemon + Python record processor) vs `changefeed run`, each at its defaults")
    print(f"{args.shards} shards on kinesis-mock, leases on DynamoDB Local, {args.initial} -> {n} workers; "
          f"writer: {args.shards} records every {args.write_interval:g} s ({writer.written} written, {writer.errors} failed puts)")
    if kcl.get("kcl_timings"):
        print(f"KCL logged: {kcl['kcl_timings']}")
    print()
    rows = [
        ("initial fleet balanced (from start)", "initial_balanced_s"),
        (f"new worker owns its share ({args.shards // n} of {args.shards})", "share_s"),
        (f"fleet of {n} balanced after the join", "balanced_s"),
        ("SIGKILLed worker's shards owned again", "failover_s"),
    ]
    w = 44
    print(f"| {'':{w}} | {'KCL 2.5.8':>16} | {'changefeed':>16} |")
    print(f"|{'-' * (w + 2)}|{'-' * 17}:|{'-' * 17}:|")
    for label, key in rows:
        print(f"| {label:{w}} | {fmt_s(kcl.get(key)):>16} | {fmt_s(ours.get(key)):>16} |")
    for label in ("idle", "flowing"):
        if f"ddb_{label}" not in kcl and f"ddb_{label}" not in ours:
            continue
        ops = sorted(set(kcl.get(f"ddb_{label}", {})) | set(ours.get(f"ddb_{label}", {})))
        for op in ops:
            def cell(r, kind=None):
                c = r.get(f"ddb_{label}", {}).get(op)
                if c is None:
                    return "0" if f"ddb_{label}" in r else "—"
                if kind is not None:
                    return f"{c['kinds'].get(kind, 0):.1f}"
                s = f"{c['n']:.1f}"
                if c.get("conditional"):
                    s += f" ({c['conditional']:.1f} refused)"
                return s
            print(f"| {f'DynamoDB {op}/min, {label}':{w}} | {cell(kcl):>16} | {cell(ours):>16} |")
            kinds = sorted(
                set(kcl.get(f"ddb_{label}", {}).get(op, {}).get("kinds", {}))
                | set(ours.get(f"ddb_{label}", {}).get(op, {}).get("kinds", {}))
            )
            if len(kinds) > 1 or (kinds and kinds != ["other"]):
                for k in kinds:
                    print(f"| {f'  {op}: {k}':{w}} | {cell(kcl, k):>16} | {cell(ours, k):>16} |")
        def tot(r):
            v = r.get(f"ddb_{label}_total")
            if v is None:
                return "—"
            return f"{v:.1f}" + ("" if r.get(f"ddb_{label}_stable", True) else "*")
        print(f"| {f'DynamoDB requests/min, {label}, all':{w}} | {tot(kcl):>16} | {tot(ours):>16} |")
        def unit(r, key):
            x = r.get(f"ddb_{label}_{key}")
            return "—" if x is None else f"{x:.1f}"
        print(f"| {f'  read units/min, {label}':{w}} | {unit(kcl, 'rcu'):>16} | {unit(ours, 'rcu'):>16} |")
        print(f"| {f'  write units/min, {label}':{w}} | {unit(kcl, 'wcu'):>16} | {unit(ours, 'wcu'):>16} |")
        print(f"| {f'  billed units/min (writes ×5), {label}':{w}} | {unit(kcl, 'units'):>16} | {unit(ours, 'units'):>16} |")
        def per_worker(r):
            v = r.get(f"ddb_{label}_total")
            return "—" if v is None else f"{v / n:.1f}"
        print(f"| {f'  per worker ({n} workers)':{w}} | {per_worker(kcl):>16} | {per_worker(ours):>16} |")
    if any(not r.get(f"ddb_{l}_stable", True) for r in (kcl, ours) for l in ("idle", "flowing")):
        print("(* ownership changed during that window)")
    print()

    def ratio(a, b):
        return "NA" if a is None or not b else f"{a / b:.2f}"

    def v(r, k, nd=1):
        x = r.get(k)
        return "NA" if x is None else f"{x:.{nd}f}"

    print(
        "RESULT "
        f"kcl_share_s={v(kcl, 'share_s')} ours_share_s={v(ours, 'share_s')} "
        f"kcl_failover_s={v(kcl, 'failover_s')} ours_failover_s={v(ours, 'failover_s')} "
        f"kcl_ddb_req_min={v(kcl, 'ddb_idle_total')} ours_ddb_req_min={v(ours, 'ddb_idle_total')} "
        f"kcl_balanced_s={v(kcl, 'balanced_s')} ours_balanced_s={v(ours, 'balanced_s')} "
        f"kcl_ddb_req_min_flowing={v(kcl, 'ddb_flowing_total')} ours_ddb_req_min_flowing={v(ours, 'ddb_flowing_total')} "
        f"kcl_idle_units_min={v(kcl, 'ddb_idle_units')} ours_idle_units_min={v(ours, 'ddb_idle_units')} "
        f"idle_units_ratio={ratio(kcl.get('ddb_idle_units'), ours.get('ddb_idle_units'))} "
        f"shards={args.shards} workers={args.initial}to{n}",
        flush=True,
    )


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description="Real KCL 2.5.8 side by side with changefeed run (see run.sh)")
    ap.add_argument("--changefeed", required=True, help="the changefeed binary")
    ap.add_argument("--jars", required=True, help="the directory of the KCL jars (amazon_kclpy/jars)")
    ap.add_argument("--dynamodb", required=True, help="DynamoDB Local URL, http://127.0.0.1:8000")
    ap.add_argument("--kinesis", required=True, help="kinesis-mock URL, http://127.0.0.1:4568")
    ap.add_argument("--work", required=True, help="directory for logs and properties files")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--initial", type=int, default=2, help="workers before one joins (default 2: 2 -> 3)")
    ap.add_argument("--write-interval", type=float, default=1.0, help="seconds between writes of one record per shard")
    ap.add_argument("--flow-window", type=float, default=60, help="seconds counting DynamoDB requests with records flowing (0: skip)")
    ap.add_argument("--idle-window", type=float, default=60, help="seconds counting DynamoDB requests with the writer paused")
    ap.add_argument("--settle", type=float, default=10, help="seconds after balancing before counting")
    ap.add_argument("--drain", type=float, default=5, help="seconds after pausing the writer before the idle window")
    ap.add_argument("--poll", type=float, default=0.5, help="seconds between ownership polls")
    ap.add_argument("--deadline-start", type=float, default=None,
                    help="seconds for the first fleet to balance (default 120 + 25 per shard: the KCL steals one lease per 20 s)")
    ap.add_argument("--deadline-join", type=float, default=None, help="seconds for the join (same default)")
    ap.add_argument("--deadline-failover", type=float, default=180)
    ap.add_argument("--poll-error-limit", type=float, default=60, help="give up after ownership polls fail for this long")
    ap.add_argument("--java-heap", default="512m")
    ap.add_argument("--sides", default="kcl,ours", help="which sides, in order (kcl,ours)")
    ap.add_argument("--ours-args", default="", help="extra flags for each `changefeed run` (e.g. \"--renew-interval 3.3s\")")
    args = ap.parse_args()
    if args.initial < 1 or args.shards < args.initial + 1:
        ap.error("need --initial >= 1 and --shards >= --initial + 1")
    if args.deadline_start is None:
        args.deadline_start = 120 + 25 * args.shards
    if args.deadline_join is None:
        args.deadline_join = 120 + 25 * args.shards
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or any(s not in ("kcl", "ours") for s in sides):
        ap.error("--sides takes kcl, ours or both")

    atexit.register(cleanup)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    os.makedirs(args.work, exist_ok=True)
    log(f"run {RUN_ID}; logs in {args.work}")

    kinesis = aws_client("kinesis", args.kinesis)
    ddb = aws_client("dynamodb", args.dynamodb)
    try:
        ddb.list_tables(Limit=1)
    except Exception as e:
        raise BenchError(f"DynamoDB Local at {args.dynamodb} not answering: {e}")
    stream = Stream(kinesis, f"cfkcl-{RUN_ID}", args.shards)
    log(f"stream {stream.name}: {args.shards} shards")
    writer = Writer(stream, args.write_interval)
    writer.start()
    results = {}
    failures = []
    try:
        for name in sides:
            proxy = Proxy(args.dynamodb, os.path.join(args.work, f"proxy-{name}.log"))
            side = (Kcl if name == "kcl" else Ours)(args, stream, ddb, proxy, args.work)
            log(f"{name}: DynamoDB through the counting proxy at {proxy.url}")
            try:
                results[name] = run_side(side, args, writer)
            except BenchError as e:
                failures.append(str(e))
                log(f"FAILED {e}")
            except Exception as e:  # a server gone, a poll that failed outside a wait
                failures.append(f"{name}: {type(e).__name__}: {e}")
                log(f"FAILED {name}: {type(e).__name__}: {e}")
            finally:
                stop(proxy.p)
    finally:
        writer.stopped.set()
        writer.join(5)
        stream.delete()
    if writer.errors:
        log(f"writer: {writer.errors} failed puts, last: {writer.last_error}")
    report(args, results, writer)
    with open(os.path.join(args.work, "results.json"), "w") as f:
        json.dump({"args": vars(args), "results": results, "failures": failures}, f, indent=2)
    if failures:
        for f_ in failures:
            print(f"error: {f_}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
