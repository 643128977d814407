"""The optimizer step on this rank's partitions, wherever it runs, and when (the map: ARCHITECTURE.md).

`pipeline.HostStepPipeline` runs the `policy.StepPolicy` the config asks for (synchronous, the delayed update of
`delayed`, the speculative step of `speculation` and its `banks`); `builder.build_partition_optimizer` is the one
place that chooses a partition optimizer (the `role` it fills); `copies_up.CopiesUp` queues the copies of updated
parameters to the device. zero/ imports only the `role` from here (the engine hands it the builder).
"""
