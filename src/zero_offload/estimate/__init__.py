"""Memory needs and a plan: `estimate_memory` (bytes per rank, by kind) and `plan` (the fastest config that
fits). `memory.py` is the model, `planner.py` the search, `table.py` the `zero-offload estimate` output."""
from zero_offload.estimate.memory import MemoryEstimate, ModelShape, estimate_memory, model_shape
from zero_offload.estimate.planner import Plan, fmt_bytes, parse_bytes, plan

__all__ = ["MemoryEstimate", "ModelShape", "estimate_memory", "model_shape", "Plan", "plan", "parse_bytes",
           "fmt_bytes"]
