#!/usr/bin/env python3
"""A counting HTTP proxy in front of DynamoDB Local.

Every request is forwarded unchanged (same path, headers and body, so SigV4 signatures and the
Host header stay as the client made them) to the upstream, over one persistent upstream
connection per client connection, and counted by its operation, the part of the
`X-Amz-Target` header after the dot (`DynamoDB_20120810.UpdateItem` -> `UpdateItem`).

    ddb_proxy.py --listen 127.0.0.1:PORT --upstream http://127.0.0.1:8000

`GET /__counts` (not forwarded) answers the counts so far as JSON:
`{"UpdateItem": {"n": 120, "failed": 3, "conditional": 3, "rcu": 0, "wcu": 123.0,
"kinds": {"renew": 100, ...}}, ...}` where `failed` counts responses with a status >= 400,
`conditional` those that are a `ConditionalCheckFailedException` (a lost compare-and-swap;
DynamoDB bills these too), `rcu`/`wcu` the read and write capacity units consumed, and `kinds`
what the requests were for as far as `kind()` recognises them.

Capacity units are DynamoDB Local's own figures: the proxy sets `ReturnConsumedCapacity` to
`TOTAL` on every request that did not ask for it (DynamoDB Local does not check signatures, so
the changed body is accepted; the extra `ConsumedCapacity` in the answer is a field every SDK
knows) and adds up what each answer reports, by DynamoDB's rules (1 write unit per KB written,
1 read unit per 4 KB read strongly consistently, half that eventually, transactions twice).
A write refused by its condition is billed by DynamoDB but reported by neither: it counts 1
write unit (a transaction: 2 per item).
Python standard library only.
"""
import argparse
import http.client
import json
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
}

_lock = threading.Lock()
_counts = {}


def kind(op, body):
    """What a request is for, from its body: the KCL's lease-table writes (legacy
    `AttributeUpdates`) and changefeed's items (`pk` = `H#group` heartbeats and change
    counter, `L#group` leases). Best effort: "" when not recognised."""
    try:
        req = json.loads(body or b"{}")
    except ValueError:
        return ""
    if op == "UpdateItem":
        attrs = set(req.get("AttributeUpdates") or {})
        text = req.get("UpdateExpression") or ""
        names = set((req.get("ExpressionAttributeNames") or {}).values())
        touched = attrs or (names | set(text.replace(",", " ").split()))
        if "checkpoint" in touched:
            return "checkpoint"
        if "leaseOwner" in attrs:
            return "take/steal/evict"
        if attrs == {"leaseCounter"}:
            return "renew"
        return "other"
    if op == "PutItem":
        item = req.get("Item") or {}
        pk = (item.get("pk") or {}).get("S", "")
        if pk.startswith("H#"):
            return "heartbeat"
        if pk.startswith("L#"):
            return "lease write (checkpoint)"
        if "leaseKey" in item:
            return "create lease"
        return "other"
    if op == "Query":
        vals = json.dumps(req.get("ExpressionAttributeValues") or {})
        if '"H#' in vals:
            return "heartbeats + counter"
        if '"L#' in vals:
            return "leases"
        return "other"
    return ""


# Operations that take `ReturnConsumedCapacity`, and whether they read or write.
READS = {"GetItem", "Query", "Scan", "BatchGetItem", "TransactGetItems"}
WRITES = {"PutItem", "UpdateItem", "DeleteItem", "BatchWriteItem", "TransactWriteItems"}


def ask_capacity(op, body):
    """The request body with `ReturnConsumedCapacity` set to TOTAL if it asked for none."""
    if op not in READS and op not in WRITES:
        return body
    try:
        req = json.loads(body or b"{}")
    except ValueError:
        return body
    if req.get("ReturnConsumedCapacity") in ("TOTAL", "INDEXES"):
        return body
    req["ReturnConsumedCapacity"] = "TOTAL"
    return json.dumps(req).encode()


def units(op, status, body, req_body):
    """(read units, write units) one answered request consumed."""
    if status >= 400:
        if op in WRITES and b"ConditionalCheckFailed" in body:
            return 0.0, 1.0
        if op == "TransactWriteItems" and b"TransactionCanceled" in body:
            try:
                n = len(json.loads(req_body).get("TransactItems") or [])
            except ValueError:
                n = 1
            return 0.0, 2.0 * n
        return 0.0, 0.0
    try:
        cc = json.loads(body or b"{}").get("ConsumedCapacity")
    except ValueError:
        return 0.0, 0.0
    rcu = wcu = 0.0
    for c in cc if isinstance(cc, list) else [cc] if cc else []:
        r, w = c.get("ReadCapacityUnits"), c.get("WriteCapacityUnits")
        if r is None and w is None:
            total = float(c.get("CapacityUnits") or 0.0)
            if op in READS:
                rcu += total
            else:
                wcu += total
        else:
            rcu += float(r or 0.0)
            wcu += float(w or 0.0)
    return rcu, wcu


def _count(op, status, body, req_body):
    k = kind(op, req_body)
    rcu, wcu = units(op, status, body, req_body)
    with _lock:
        c = _counts.setdefault(
            op, {"n": 0, "failed": 0, "conditional": 0, "rcu": 0.0, "wcu": 0.0, "kinds": {}}
        )
        c["n"] += 1
        c["rcu"] += rcu
        c["wcu"] += wcu
        if k:
            c["kinds"][k] = c["kinds"].get(k, 0) + 1
        if status >= 400:
            c["failed"] += 1
            if b"ConditionalCheckFailed" in body:
                c["conditional"] += 1


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream = None  # (host, port), set in main
    dump = 0  # log the first N request bodies (--dump)

    def setup(self):
        super().setup()
        self._up = None

    def finish(self):
        try:
            super().finish()
        finally:
            if self._up is not None:
                self._up.close()

    def log_message(self, fmt, *args):  # quiet
        pass

    def _upstream_conn(self, fresh=False):
        if fresh and self._up is not None:
            self._up.close()
            self._up = None
        if self._up is None:
            self._up = http.client.HTTPConnection(*self.upstream, timeout=30)
        return self._up

    def do_GET(self):
        if self.path == "/__counts":
            with _lock:
                body = json.dumps(_counts).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self._forward()

    def do_POST(self):
        self._forward()

    def _forward(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        target = self.headers.get("X-Amz-Target") or ""
        op = target.split(".", 1)[-1] if target else f"(no target: {self.command})"
        body = ask_capacity(op, body)
        for attempt in (0, 1):
            conn = self._upstream_conn(fresh=attempt == 1)
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() not in HOP_BY_HOP:
                        conn.putheader(k, v)
                conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.HTTPException, OSError):
                # A stale keep-alive connection to the upstream: retry once on a new one.
                if attempt == 1:
                    self.send_error(502, "upstream DynamoDB not reachable")
                    return
        _count(op, resp.status, data, body)
        if Handler.dump > 0:
            Handler.dump -= 1
            print(f"{op} {resp.status} {body[:600]!r}", file=sys.stderr, flush=True)
        self.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in HOP_BY_HOP:
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", required=True, help="HOST:PORT to listen on")
    ap.add_argument("--upstream", required=True, help="http://HOST:PORT of DynamoDB Local")
    ap.add_argument("--dump", type=int, default=0, help="log the first N requests' bodies to stderr")
    args = ap.parse_args()
    Handler.dump = args.dump
    host, port = args.listen.rsplit(":", 1)
    up = urllib.parse.urlsplit(args.upstream)
    Handler.upstream = (up.hostname, up.port or 80)
    server = ThreadingHTTPServer((host, int(port)), Handler)
    server.daemon_threads = True
    print(f"ddb_proxy listening on {host}:{server.server_address[1]} -> {args.upstream}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
