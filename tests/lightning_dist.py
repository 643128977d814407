"""Run under ``torchrun --nproc_per_node 2``: Lightning's DDP (gloo on CPU) against ZeroOffloadStrategy at stage 2
with the optimizer offloaded and stage 3 with optimizer and parameters offloaded; accumulation 2 with a shorter
last accumulation, clipping 1.0. Rank 0 writes {losses, weight differences} as JSON to argv[1]."""
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lightning_runs as runs  # noqa: E402
from dist_utils import finish_torchrun  # noqa: E402

torch.set_num_threads(1)        # the two ranks share two cores
warnings.filterwarnings("ignore")


def fit(strategy):
    module = runs.make_module()
    trainer = runs.trainer(strategy, devices=2, use_distributed_sampler=True)
    trainer.fit(module, runs.loader(20))       # 5 batches per rank: accumulations of 2, 2 and 1
    return trainer, module, runs.weights(module, strategy if not isinstance(strategy, str) else None)


def main(out_path: str) -> None:
    from zero_offload.lightning import ZeroOffloadStrategy
    ref_trainer, ref, ref_w = fit("ddp")
    result = {"reference": ref.losses, "reference_steps": ref_trainer.global_step, "runs": {},
              "weight_change": runs.max_diff(ref_w, runs.weights(runs.make_module()))}
    for name, cfg in {"stage2_offload": runs.config(2, True), "stage3_offload": runs.config(3, True, True)}.items():
        strategy = ZeroOffloadStrategy(config=cfg)
        trainer, module, w = fit(strategy)
        result["runs"][name] = {"losses": module.losses, "steps": trainer.global_step,
                                "weight_diff": runs.max_diff(ref_w, w), "world_size": strategy.engine.world_size}
    finish_torchrun(result, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
