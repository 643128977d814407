"""The configs the planner tries (`Candidate`), in its order of preference (`candidates`): see
`zero_offload.estimate.planner`, which searches each for its batch setting and picks the fastest that fits."""
from __future__ import annotations

from dataclasses import dataclass, field

from zero_offload.estimate.batching import BatchChoice
from zero_offload.estimate.memory import MemoryEstimate

__all__ = ["Candidate", "candidates"]


@dataclass
class Candidate:
    """One config the planner considers: ``zero`` is merged into ``zero_optimization``."""
    name: str
    zero: dict
    reason: str
    estimate: MemoryEstimate | None = None
    fits: bool = False
    short: dict[str, int] = field(default_factory=dict)     # side -> bytes missing
    error: str | None = None                                # a config the engine does not accept here
    bf16: dict = field(default_factory=dict)                # merged into the base config's bf16 section
    batch: BatchChoice | None = None                        # the batch setting the estimate is of


def candidates() -> list[Candidate]:
    """Every config the planner tries, in order of preference (`zero_offload.estimate.planner`'s docstring)."""
    cpu, on_dev = {"device": "cpu"}, {"device": "cpu", "gradients_on_device": True}
    rows = [
        Candidate("stage 0", {"stage": 0}, "everything fits on the device: plain data parallelism, the fastest"),
        Candidate("stage 1", {"stage": 1}, "partitioning the optimizer states (stage 1) makes it fit on the device"),
        Candidate("stage 2", {"stage": 2}, "partitioning gradients too (stage 2) makes it fit on the device"),
        Candidate("stage 2 + offload opt", {"stage": 2, "offload_optimizer": cpu},
                  "optimizer states and step on the host (ZeRO-Offload) leave only 16-bit parameters, buckets "
                  "and activations on the device"),
        Candidate("stage 2 + offload opt, grads on device", {"stage": 2, "offload_optimizer": on_dev},
                  "ZeRO-Offload with the gradient partition kept on the device and pulled down by the host step "
                  "(offload_optimizer.gradients_on_device): 2 host bytes per parameter fewer (4 under accumulation), "
                  "no copies down or host adds during the micro-steps"),
        Candidate("stage 2 + offload opt, bf16 moments", {"stage": 2, "offload_optimizer": cpu},
                  "ZeRO-Offload with the Adam moments in bf16 on the host (bf16.bf16_optimizer_states): 10 "
                  "instead of 14 host bytes per parameter", bf16={"bf16_optimizer_states": True}),
        Candidate("stage 2 + offload opt, bf16 masters+moments", {"stage": 2, "offload_optimizer": cpu},
                  "ZeRO-Offload with bf16 master weights and moments (bf16.bf16_master_weights_and_grads): 8 host "
                  "bytes per parameter; changes what is trained, so only where allowed",
                  bf16={"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}),
        Candidate("stage 2 + offload opt, bf16 moments, grads on device", {"stage": 2, "offload_optimizer": on_dev},
                  "ZeRO-Offload with bf16 moments and the gradient partition kept on the device, pulled down by "
                  "the host step (offload_optimizer.gradients_on_device): 8 host bytes per parameter, 2 more on "
                  "the device", bf16={"bf16_optimizer_states": True}),
        Candidate("stage 2 + offload opt, bf16 masters+moments, grads on device",
                  {"stage": 2, "offload_optimizer": on_dev},
                  "bf16 master weights and moments, the gradient partition on the device: 6 host bytes per "
                  "parameter; changes what is trained, so only where allowed",
                  bf16={"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}),
        Candidate("stage 3", {"stage": 3}, "16-bit parameters partitioned too (stage 3)"),
        Candidate("stage 3 + offload opt", {"stage": 3, "offload_optimizer": cpu},
                  "stage 3 with the optimizer states and step on the host"),
        Candidate("stage 3 + offload opt+param", {"stage": 3, "offload_optimizer": cpu, "offload_param": cpu},
                  "stage 3 with parameter shards on the host too: the device holds only live units"),
        Candidate("stage 2 + nvme opt", {"stage": 2, "offload_optimizer": {"device": "nvme"}},
                  "ZeRO-Offload with the optimizer states on NVMe (ZeRO-Infinity): host memory holds the gradient "
                  "partition and the sub-group pool; a share of the states may stay on the device (ratio)"),
        Candidate("stage 3 + nvme opt", {"stage": 3, "offload_optimizer": {"device": "nvme"},
                                         "offload_param": cpu},
                  "optimizer states on NVMe: host memory holds parameters and staging only"),
        Candidate("stage 3 + nvme opt+param", {"stage": 3, "offload_optimizer": {"device": "nvme"},
                                               "offload_param": {"device": "nvme"}},
                  "optimizer states and parameters on NVMe"),
        Candidate("stage 2 + offload opt, small buckets", {"stage": 2, "offload_optimizer": cpu,
                                                           "reduce_bucket_size": 50_000_000,
                                                           "allgather_bucket_size": 50_000_000},
                  "ZeRO-Offload with 5e7-element buckets"),
        Candidate("stage 3 + offload opt+param, low live", {"stage": 3, "offload_optimizer": cpu,
                                                            "offload_param": cpu,
                                                            "stage3_max_live_parameters": 100_000_000,
                                                            "stage3_prefetch_bucket_size": 10_000_000},
                  "stage 3 offload with at most 1e8 live parameters and 1e7 prefetched"),
    ]
    return rows
