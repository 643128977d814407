"""A client optimizer handed to ``deepspeed.initialize`` with ``offload_optimizer`` set runs as the engine's host
Adam with its hyper-parameters and param groups (issue 21, section 4): torch.optim.AdamW, torch.optim.Adam (L2
weight decay, DeepSpeed's ``adam_w_mode`` false) and DeepSpeedCPUAdam / FusedLamb built under the compat layer's
names (``zero_offload.deepspeed.ops``); each against plain torch on one process, same model, data and seed."""
import pytest
import torch

import zero_offload.deepspeed as deepspeed
from lamb_reference import ReferenceLamb
from reference import LR, MICRO
from toy_model import batch, make_model
from zero_offload.deepspeed.ops.adam import DeepSpeedCPUAdam
from zero_offload.optim import CPUAdam

STEPS = 3


def _groups(model):
    """Weight decay and the base lr on matrices; none, and twice the lr, on biases and LayerNorms."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.05},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0, "lr": 2 * LR}]


CLIENTS = {
    "torch AdamW": (lambda g: torch.optim.AdamW(g, lr=LR, betas=(0.85, 0.99)), torch.optim.AdamW),
    "torch Adam (L2)": (lambda g: torch.optim.Adam(g, lr=LR, eps=1e-6), torch.optim.Adam),
    "DeepSpeedCPUAdam": (lambda g: DeepSpeedCPUAdam(g, lr=LR, betas=(0.85, 0.99)), torch.optim.AdamW),
    "DeepSpeedCPUAdam adamw_mode=False": (lambda g: deepspeed.ops.adam.DeepSpeedCPUAdam(g, lr=LR, adamw_mode=False),
                                          torch.optim.Adam),
}


def _train(engine):
    for step in range(STEPS):
        x, y = batch(step, MICRO)
        engine.backward(engine(x, y))
        engine.step()
    return engine.full_state_dict()


def _reference(make, ref_cls):
    model = make_model()
    client = make(_groups(model))           # the reference takes the client's own groups and defaults
    opt = ref_cls([{k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
                   for g in client.param_groups])
    for step in range(STEPS):
        x, y = batch(step, MICRO)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return dict(model.named_parameters())


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", list(CLIENTS))
def test_client_optimizer_runs_as_the_host_adam(name, stage):
    make, ref_cls = CLIENTS[name]
    model = make_model()
    client = make(_groups(model))
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client, config={
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}})
    assert type(optimizer.optimizer) is CPUAdam        # DeepSpeed's ZeRO optimizer face over the fused host kernel
    for mine, theirs in zip(optimizer.param_groups, client.param_groups):
        assert (mine["lr"], mine["weight_decay"], tuple(mine["betas"]), mine["eps"]) == (
            theirs["lr"], theirs["weight_decay"], tuple(theirs["betas"]), theirs["eps"])
        assert mine["adamw_mode"] is (ref_cls is torch.optim.AdamW)
    full = _train(engine)
    for key, p in _reference(make, ref_cls).items():
        assert (full[key] - p.detach()).abs().max().item() <= 1e-5, key


def test_client_fused_lamb_runs_as_lamb():
    lamb = {"lr": 0.02, "weight_decay": 0.01, "max_coeff": 0.3, "min_coeff": 0.02}
    model = make_model()
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=deepspeed.ops.lamb.FusedLamb(model.parameters(), **lamb),
        config={"train_micro_batch_size_per_gpu": MICRO,
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert type(optimizer.optimizer).__name__ == "Lamb"
    full = _train(engine)
    ref_model = make_model()
    ref = ReferenceLamb(ref_model.parameters(), **lamb)
    for step in range(STEPS):
        x, y = batch(step, MICRO)
        ref.zero_grad()
        ref_model(x, y).backward()
        ref.step()
    for key, p in ref_model.named_parameters():
        assert (full[key] - p.detach()).abs().max().item() <= 1e-5, key


@pytest.mark.parametrize("make,message", [
    (lambda ps: DeepSpeedCPUAdam(ps, amsgrad=True), "amsgrad=True"),
    (lambda ps: DeepSpeedCPUAdam(ps, fp32_optimizer_states=False), "fp32_optimizer_states=False"),
    (lambda ps: DeepSpeedCPUAdam([{"params": ps[:1]}, {"params": ps[1:], "bias_correction": False}]),
     "param group 1 sets bias_correction=False"),
    (lambda ps: deepspeed.ops.lamb.FusedLamb(ps, max_grad_norm=1.0), "gradient_clipping"),
])
def test_bad_deepspeed_class_arguments_are_named(make, message):
    model = make_model()
    with pytest.raises(ValueError, match=message):
        deepspeed.initialize(model=model, optimizer=make(list(model.parameters())),
                             config={"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 2}})


def test_deepspeed_cpu_adam_steps_alone_on_host_parameters_only():
    w = torch.nn.Parameter(torch.ones(4))
    opt = DeepSpeedCPUAdam([w], lr=0.1)
    w.grad = torch.ones(4)
    opt.step()
    ref = torch.nn.Parameter(torch.ones(4))
    torch_opt = torch.optim.AdamW([ref], lr=0.1, weight_decay=0)
    ref.grad = torch.ones(4)
    torch_opt.step()
    assert torch.allclose(w, ref)
    half = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = DeepSpeedCPUAdam([half])                              # constructed anywhere, as DeepSpeed
    half.grad = torch.ones(4, dtype=torch.float16)
    with pytest.raises(ValueError, match="fp32 CPU tensors"):
        opt.step()
