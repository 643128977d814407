"""Run under ``torchrun --nproc_per_node 2``: the plain Trainer (its own DDP, gloo on CPU) against
zero_offload.hf.Trainer at stage 0, stage 2 + optimizer offload and stage 3 + optimizer and parameter offload,
tiny GPT-2, gas 2, max_grad_norm 1.0. Rank 0 writes {losses, weight differences} as JSON to argv[1]."""
import os
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_trainer_runs as runs  # noqa: E402
from dist_utils import finish_torchrun  # noqa: E402

torch.set_num_threads(1)        # the two ranks share two cores
warnings.filterwarnings("ignore")


def main(out_path: str) -> None:
    # (reference weight decay, config): with an optimizer section every parameter decays (DeepSpeed's one
    # group), so that run is compared with weight decay 0; without one the Trainer's groups are kept.
    configs = {"stage0": (0.1, runs.zero_config(0, optimizer_section=False)),
               "stage2_offload": (0.1, runs.zero_config(2, True, optimizer_section=False)),
               "stage3_offload": (0.1, runs.zero_config(3, True, True, optimizer_section=False)),
               "stage2_offload_section": (0.0, runs.zero_config(2, True))}
    result = {"runs": {}}
    with tempfile.TemporaryDirectory() as d:
        refs = {wd: runs.run("gpt2", f"{d}/ref{wd}", n_samples=24, weight_decay=wd) for wd in (0.0, 0.1)}
        for name, (wd, cfg) in configs.items():
            trainer, losses, lrs, norms, w = runs.run("gpt2", f"{d}/{name}", cfg, n_samples=24, weight_decay=wd)
            _, ref_losses, ref_lrs, ref_norms, ref_w = refs[wd]
            result["runs"][name] = {"losses": losses, "reference": ref_losses, "lrs": lrs, "reference_lrs": ref_lrs,
                                    "grad_norms": norms, "reference_grad_norms": ref_norms,
                                    "weight_diff": runs.max_weight_diff(ref_w, w),
                                    "weight_change": runs.max_weight_diff(ref_w, runs.initial_weights("gpt2")),
                                    "world_size": trainer.engine.world_size}
    finish_torchrun(result, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
