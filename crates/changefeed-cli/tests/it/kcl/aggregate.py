"""Aggregates user records as the Kinesis Producer Library does, with awslabs' official
KPL-compatible aggregator (the PyPI package aws_kinesis_agg), for the `kcl` aggregation test.

Arguments: groups of user record numbers, e.g. `0-4 5-9`; each group becomes one aggregated
Kinesis record of the user records `r-N` (partition key `key-N`). Prints one JSON line per
aggregated record: its partition key, explicit hash key and base64 data, to be put as is.

With `--hash` and a JSON list of groups, each a list of `[N, how, lo, hi]`, user record `r-N`
gets a hash key in the range `lo..=hi` (decimal strings): with `how` "ehk" as its explicit hash
key `lo + N`, with "pk" as the MD5 of its partition key, the first `key-N-J` (J = 0, 1, ...) whose
MD5 falls in the range. The aggregated record goes where its first user record's hash key says
(the aggregator's explicit hash key, or Kinesis's MD5 of the partition key)."""
import base64
import hashlib
import json
import sys

from aws_kinesis_agg.aggregator import RecordAggregator


def emit(aggregator, count):
    assert aggregator.get_num_user_records() == count
    pk, ehk, data = aggregator.clear_and_get().get_contents()
    print(json.dumps({"pk": pk, "ehk": ehk, "data": base64.b64encode(data).decode()}))


if sys.argv[1:2] == ["--hash"]:
    for group in json.loads(sys.argv[2]):
        aggregator = RecordAggregator()
        for n, how, lo, hi in group:
            lo, hi = int(lo), int(hi)
            if how == "ehk":
                pk, ehk = f"key-{n}", str(lo + n)
                assert lo + n <= hi
            else:
                ehk = None
                pk = next(
                    k for k in (f"key-{n}-{j}" for j in range(10_000))
                    if lo <= int.from_bytes(hashlib.md5(k.encode()).digest(), "big") <= hi
                )
            full = aggregator.add_user_record(pk, f"r-{n}".encode(), ehk)
            assert full is None, "the test's groups fit in one aggregated record"
        emit(aggregator, len(group))
    sys.exit(0)

for group in sys.argv[1:]:
    first, last = (int(n) for n in group.split("-"))
    aggregator = RecordAggregator()
    for i in range(first, last + 1):
        full = aggregator.add_user_record(f"key-{i}", f"r-{i}".encode())
        assert full is None, "the test's groups fit in one aggregated record"
    emit(aggregator, last - first + 1)
