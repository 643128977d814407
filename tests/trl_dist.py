"""Run under ``torchrun --nproc_per_node 2``: TRL's trainers without the mixin (their own DDP, gloo on CPU) against
the same trainers on zero-offload at stage 0, stage 2 + optimizer offload and stage 3 + optimizer and parameter
offload, every variant of `trl_runs.VARIANTS`.
Rank 0 writes {losses, weight differences} as JSON to argv[1]."""
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_runs as runs  # noqa: E402
from dist_utils import finish_torchrun  # noqa: E402

torch.set_num_threads(1)        # the two ranks share two cores
warnings.filterwarnings("ignore")
STAGES = {"stage0": runs.zero_config(0), "stage2-offload": runs.zero_config(2),
          "stage3-offload-all": runs.zero_config(3)}


def main(out_path: str) -> None:
    result = {"runs": {}}
    dist.init_process_group("gloo")
    with tempfile.TemporaryDirectory() as d:
        where = [os.path.join(d, "models")]
        dist.broadcast_object_list(where)     # rank 0 writes the models (save_pretrained writes on rank 0 only)
        dirs = {"causal": os.path.join(where[0], "causal"), "reward": os.path.join(where[0], "reward")}
        if dist.get_rank() == 0:
            runs.save_model_dir(dirs["causal"])
            runs.save_model_dir(dirs["reward"], "reward")
        dist.barrier()
        for variant in runs.VARIANTS:
            _, ref_losses, ref_w = runs.run_variant(variant, dirs, os.path.join(d, f"ref-{variant}"))
            for stage, cfg in STAGES.items():
                trainer, losses, w = runs.run_variant(variant, dirs, os.path.join(d, f"{variant}-{stage}"), cfg)
                result["runs"][f"{variant}-{stage}"] = {"losses": losses, "reference": ref_losses,
                                                        "weight_diff": runs.max_weight_diff(ref_w, w),
                                                        "world_size": trainer.engine.world_size}
    finish_torchrun(result, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
