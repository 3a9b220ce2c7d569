"""A record processor written for the KCL's DynamoDB Streams Kinesis adapter, against
amazon_kclpy's documented v3 API: each record's data is the JSON of a DynamoDB Streams Record
(eventName, dynamodb.Keys / NewImage / OldImage in typed attribute values, SequenceNumber …),
which it parses as such. It appends to the JSON-lines ledger named by $KCL_TEST_LEDGER each
record as it parsed it, each checkpoint it asked for (and whether it was granted), and the
lifecycle calls. It checkpoints at the last record of every batch, at that record's sequence
number, and never at a shutdown, so that where a restart resumes shows those checkpoints."""
import json
import os

from amazon_kclpy import kcl
from amazon_kclpy.v3 import processor

LEDGER = os.environ["KCL_TEST_LEDGER"]
HOST = os.environ.get("CHANGEFEED_HOST", "?")


def note(**fields):
    fields["host"] = HOST
    fields["pid"] = os.getpid()
    with open(LEDGER, "a") as f:
        f.write(json.dumps(fields) + "\n")


class RecordProcessor(processor.RecordProcessorBase):
    def __init__(self):
        self.shard = None

    def initialize(self, initialize_input):
        self.shard = initialize_input.shard_id
        note(ev="init", shard=self.shard, seq=initialize_input.sequence_number)

    def checkpoint(self, checkpointer, seq, why):
        note(ev="ckpt_ask", shard=self.shard, seq=seq, why=why)
        try:
            checkpointer.checkpoint(seq)
            note(ev="ckpt", shard=self.shard, seq=seq, why=why)
        except kcl.CheckpointError as e:
            note(ev="ckpt_error", shard=self.shard, seq=seq, error=str(e), why=why)

    def process_records(self, process_records_input):
        last = None
        for record in process_records_input.records:
            change = json.loads(record.binary_data)
            note(ev="rec", shard=self.shard, seq=record.sequence_number,
                 key=record.partition_key, change=change)
            last = record.sequence_number
        if last is not None:
            self.checkpoint(process_records_input.checkpointer, last, "batch")

    def lease_lost(self, lease_lost_input):
        note(ev="lost", shard=self.shard)

    def shard_ended(self, shard_ended_input):
        note(ev="ended", shard=self.shard)
        self.checkpoint(shard_ended_input.checkpointer, None, "shard_end")

    def shutdown_requested(self, shutdown_requested_input):
        note(ev="shutdown_requested", shard=self.shard)


if __name__ == "__main__":
    kcl.KCLProcess(RecordProcessor()).run()
