"""Aggregates user records as the Kinesis Producer Library does, with awslabs' official
KPL-compatible aggregator (the PyPI package aws_kinesis_agg), for the `kcl` aggregation test.

Arguments: groups of user record numbers, e.g. `0-4 5-9`; each group becomes one aggregated
Kinesis record of the user records `r-N` (partition key `key-N`). Prints one JSON line per
aggregated record: its partition key, explicit hash key and base64 data, to be put as is."""
import base64
import json
import sys

from aws_kinesis_agg.aggregator import RecordAggregator

for group in sys.argv[1:]:
    first, last = (int(n) for n in group.split("-"))
    aggregator = RecordAggregator()
    for i in range(first, last + 1):
        full = aggregator.add_user_record(f"key-{i}", f"r-{i}".encode())
        assert full is None, "the test's groups fit in one aggregated record"
    assert aggregator.get_num_user_records() == last - first + 1
    pk, ehk, data = aggregator.clear_and_get().get_contents()
    print(json.dumps({"pk": pk, "ehk": ehk, "data": base64.b64encode(data).decode()}))
