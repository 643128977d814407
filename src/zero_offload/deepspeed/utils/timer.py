"""``deepspeed.utils.timer``: DeepSpeed's timer names and its `ThroughputTimer` (the engine's ``tput_timer``:
`zero_offload.compat.throughput`; zero-offload's own timings: ``engine.timings``)."""
from zero_offload.compat.throughput import ThroughputTimer

__all__ = ["FORWARD_MICRO_TIMER", "FORWARD_GLOBAL_TIMER", "BACKWARD_MICRO_TIMER", "BACKWARD_GLOBAL_TIMER",
           "BACKWARD_INNER_MICRO_TIMER", "BACKWARD_INNER_GLOBAL_TIMER", "BACKWARD_REDUCE_MICRO_TIMER",
           "BACKWARD_REDUCE_GLOBAL_TIMER", "STEP_MICRO_TIMER", "STEP_GLOBAL_TIMER", "TIME_EPSILON", "ThroughputTimer"]

FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"
TIME_EPSILON = 1e-6

