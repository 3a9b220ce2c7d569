#!/usr/bin/env python3
"""The latency run's record processor (MultiLangDaemon child, under the Java KCL or under
`changefeed run --properties`): each record's data is the writer's wall-clock time in
milliseconds when it put it; the processor appends `now - that` per record to the file
$KCL_LATENCY_OUT, and checkpoints after every batch."""
import os
import time

from amazon_kclpy import kcl
from amazon_kclpy.v3 import processor


class Processor(processor.RecordProcessorBase):
    def initialize(self, initialize_input):
        self.out = open(os.environ["KCL_LATENCY_OUT"], "a", buffering=1)

    def process_records(self, process_records_input):
        now = time.time() * 1000.0
        records = process_records_input.records
        for record in records:
            try:
                sent = float(record.binary_data.decode())
            except ValueError:
                continue
            self.out.write(f"{now - sent:.1f}\n")
        if records:
            process_records_input.checkpointer.checkpoint()

    def lease_lost(self, lease_lost_input):
        pass

    def shard_ended(self, shard_ended_input):
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input):
        shutdown_requested_input.checkpointer.checkpoint()


if __name__ == "__main__":
    kcl.KCLProcess(Processor()).run()
