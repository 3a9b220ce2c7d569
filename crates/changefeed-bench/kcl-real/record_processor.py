#!/usr/bin/env python3
"""The KCL side's record processor: a MultiLangDaemon child (one per shard) that reads each
batch and checkpoints after every batch, the KCL counterpart of `changefeed run --handler
'cat >/dev/null'` with its default `--checkpoint every-batch`."""
from amazon_kclpy import kcl
from amazon_kclpy.v3 import processor


class Processor(processor.RecordProcessorBase):
    def initialize(self, initialize_input):
        pass

    def process_records(self, process_records_input):
        records = process_records_input.records
        for record in records:
            record.binary_data  # decode, as a real handler would
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
