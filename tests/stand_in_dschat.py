"""A training script in the style of DeepSpeed-Chat's and OpenRLHF's DeepSpeed utilities, written against DeepSpeed's
API only: run it under DeepSpeed itself or under ``zero-offload run`` (tests/test_stand_in_scripts.py).

    python tests/stand_in_dschat.py OUT --stage 3 [--local_rank N]

On rank 0 it writes {losses, reference logits, the optimizer face's readings} to OUT and the weights (gathered as
DeepSpeed-Chat's ``save_zero_three_model`` does, cloned by ``clone_tensors_for_torch_save``) to OUT.weights.pt.
"""
import argparse
import json
import math
import os
import sys

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.compression.helper import recursive_getattr
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_models import build  # noqa: E402
from hf_trainer_runs import TokenData  # noqa: E402
from stand_in_runs import end_process_group  # noqa: E402


def get_train_ds_config(stage: int, offload: bool) -> dict:
    """DeepSpeed-Chat's ``get_train_ds_config`` (fp32 here: the CPU peer)."""
    device = "cpu" if offload else "none"
    return {"train_batch_size": 2 * 2 * dist.get_world_size(), "train_micro_batch_size_per_gpu": 2,
            "steps_per_print": 10, "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
            "zero_optimization": {"stage": stage, "offload_param": {"device": device if stage == 3 else "none"},
                                  "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": 1e4,
                                  "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                                  "memory_efficient_linear": False}}


def get_eval_ds_config(stage: int) -> dict:
    return {"train_batch_size": 2 * dist.get_world_size(), "train_micro_batch_size_per_gpu": 2,
            "steps_per_print": 10, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1e4,
                                                         "memory_efficient_linear": False}}


def get_optimizer_grouped_parameters(model, weight_decay: float, no_decay=("bias", "ln_", "LayerNorm.weight")):
    return [{"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
             "weight_decay": weight_decay},
            {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
             "weight_decay": 0.0}]


def _z3_params_to_fetch(param_list):
    return [p for p in param_list if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def save_zero_three_model(model_ema, global_rank: int, zero_stage: int) -> dict:
    """DeepSpeed-Chat's ``save_zero_three_model``: each parameter gathered and copied on rank 0."""
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    out = {}
    for k, v in model_to_save.named_parameters():
        if hasattr(v, "ds_id"):
            assert v.ds_shape == torch.Size(list(v.ds_shape)) and v.ds_numel == math.prod(v.ds_shape)
            with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v]), enabled=zero_stage == 3):
                v_p = v.data.cpu()
        else:
            v_p = v.cpu()
        if global_rank == 0:
            out[k] = v_p.clone()
    return clone_tensors_for_torch_save(out)


def get_all_reduce_mean(tensor):
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor / dist.get_world_size()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.local_rank == -1:
        args.local_rank = int(os.environ.get("LOCAL_RANK", 0))
    deepspeed.init_distributed()
    get_accelerator().set_device(args.local_rank) if get_accelerator().device_name() != "cpu" else None
    global_rank = dist.get_rank()
    ds_config = get_train_ds_config(args.stage, offload=True)

    model = build("gpt2")
    assert recursive_getattr(model, "transformer.wte") is model.transformer.wte
    optimizer = DeepSpeedCPUAdam(get_optimizer_grouped_parameters(model, 0.01), lr=1e-3, betas=(0.9, 0.95))
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)
    ref = build("gpt2", seed=1)
    ref, *_ = deepspeed.initialize(model=ref, config=get_eval_ds_config(args.stage if args.stage == 3 else 0))
    ref.eval()

    data = TokenData(8 * dist.get_world_size())
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler)
    device = torch.device(get_accelerator().device_name())
    losses, ref_logits, scales = [], [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch, use_cache=False).loss
        model.backward(loss)
        model.step()
        losses.append(get_all_reduce_mean(loss.detach().clone()).item())
        scales.append([optimizer.cur_scale if hasattr(optimizer, "cur_scale") else 1.0, bool(optimizer.overflow)
                       if hasattr(optimizer, "overflow") else False, model.global_steps])
        with torch.no_grad():
            ref_logits.append(ref(**batch).logits.float().sum().item())
    weights = save_zero_three_model(model, global_rank, args.stage)
    if global_rank == 0:
        torch.save(weights, args.out + ".weights.pt")
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "ref_logits": ref_logits, "scales": scales,
                       "deepspeed": deepspeed.__file__, "lr": lr_scheduler.get_last_lr()}, f)
    get_accelerator().empty_cache()
    end_process_group()


if __name__ == "__main__":
    main()
