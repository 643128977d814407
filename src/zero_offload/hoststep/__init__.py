"""The optimizer step on this rank's partitions, wherever it runs, and when: the partition optimizers and the
host-step pipeline.

- `pipeline.HostStepPipeline`: what the engine calls at the boundary; it runs the `policy.StepPolicy` the config
  asks for (synchronous, the delayed update of `delayed`, the speculative step of `speculation` and its
  `banks`).
- `builder.build_partition_optimizer`: the one place that chooses a partition optimizer (the `role` it fills):
  `adam.PartitionedAdam` (host or device memory), `torch_optimizer.PartitionedTorchOptimizer`, `nvme_adam.NvmeAdam`
  (swap files), `split.SplitAdam` (``offload_optimizer.ratio``).
- `copies_up.CopiesUp`: the copies of updated parameters to the device that a host step queues chunk by chunk.

zero/ partitions and reduces the gradients these read; it imports only the `role` from here (the engine hands it the
builder). offload/ holds the copies, pinned buffers and threads these use; nvme/ the swap files.
"""
