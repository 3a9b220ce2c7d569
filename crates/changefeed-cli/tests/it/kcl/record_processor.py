"""A record processor written against amazon_kclpy's documented v3 API, as a KCL user writes
one; the `kcl` tests run it under `changefeed run --properties`. It appends what it sees to the
JSON-lines ledger named by $KCL_TEST_LEDGER: each record, each checkpoint it asked for (and
whether it was granted), and the lifecycle calls. It checkpoints at every record whose data ends
in a multiple of 3, at the record's own sequence and sub-sequence numbers (a user record of a
KPL-aggregated record has its own), never at the end of a batch, so that a stored checkpoint shows
it went exactly where the processor asked.

With $KCL_TEST_STDOUT_NOISE set it also prints to stdout, among its protocol messages, what a
structured logger and a chatty library print there: a JSON log line and a plain text line."""
import json
import os

from amazon_kclpy import kcl
from amazon_kclpy.v3 import processor

LEDGER = os.environ["KCL_TEST_LEDGER"]
HOST = os.environ.get("CHANGEFEED_HOST", "?")
NOISE = bool(os.environ.get("KCL_TEST_STDOUT_NOISE"))


def noise(msg):
    if NOISE:
        print(json.dumps({"level": "info", "msg": msg}), flush=True)
        print("plain text: " + msg, flush=True)


def note(**fields):
    fields["host"] = HOST
    fields["pid"] = os.getpid()
    with open(LEDGER, "a") as f:
        f.write(json.dumps(fields) + "\n")


class RecordProcessor(processor.RecordProcessorBase):
    def __init__(self):
        self.shard = None
        self.last = None

    def initialize(self, initialize_input):
        self.shard = initialize_input.shard_id
        noise("starting record processor")
        note(ev="init", shard=self.shard, seq=initialize_input.sequence_number,
             sub=initialize_input.sub_sequence_number)

    def checkpoint(self, checkpointer, seq, sub, why):
        # Noted before asking too: a host killed after storing a checkpoint but before
        # answering leaves an asked-for checkpoint stored without its grant in the ledger.
        at = (seq, sub) if seq is not None else (self.last or (None, None))
        note(ev="ckpt_ask", shard=self.shard, seq=at[0], sub=at[1], why=why)
        try:
            checkpointer.checkpoint(seq, sub)
            note(ev="ckpt", shard=self.shard, seq=at[0], sub=at[1], why=why)
        except kcl.CheckpointError as e:
            note(ev="ckpt_error", shard=self.shard, seq=seq, sub=sub, error=str(e), why=why)

    def process_records(self, process_records_input):
        noise("processing records")
        for record in process_records_input.records:
            data = record.binary_data.decode()
            seq = record.sequence_number
            note(ev="rec", shard=self.shard, seq=seq, data=data, key=record.partition_key,
                 sub=record.sub_sequence_number, ts=record.timestamp_millis)
            self.last = (seq, record.sub_sequence_number)
            if int(data.rsplit("-", 1)[1]) % 3 == 0:
                self.checkpoint(process_records_input.checkpointer, seq,
                                record.sub_sequence_number, "record")

    def lease_lost(self, lease_lost_input):
        note(ev="lost", shard=self.shard)

    def shard_ended(self, shard_ended_input):
        note(ev="ended", shard=self.shard)
        self.checkpoint(shard_ended_input.checkpointer, None, None, "shard_end")

    def shutdown_requested(self, shutdown_requested_input):
        note(ev="shutdown_requested", shard=self.shard)
        self.checkpoint(shutdown_requested_input.checkpointer, None, None, "shutdown")


if __name__ == "__main__":
    kcl.KCLProcess(RecordProcessor()).run()
