"""DeepSpeed's API over zero-offload's engine; the public entry point is `zero_offload.deepspeed`."""
