"""`CPUAdam`: a torch.optim.Optimizer whose step runs the fused host kernel (DeepSpeedCPUAdam's role)."""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

from zero_offload.optim.fused_adam import fused_adam_step

__all__ = ["CPUAdam", "step_seed"]


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW over fp32 (or bf16) CPU parameters, stepping through `fused_adam_step`.

    Same hyper-parameters and results as ``torch.optim.AdamW`` (``adamw_mode=True``, decoupled weight
    decay) or ``torch.optim.Adam`` with L2 ``weight_decay`` (``adamw_mode=False``), mirroring
    DeepSpeed's ``DeepSpeedCPUAdam``. State per parameter: ``step`` (int), ``exp_avg`` and
    ``exp_avg_sq`` (``state_dtype``, same shape as the parameter).

    Extra args (beyond DeepSpeed's):
        state_dtype: torch.float32 (default) or torch.bfloat16 for the two moments: 8 bytes/param of host
            memory and of traffic less per step, at the accuracy bound stated in `zero_offload.optim.fused_adam`.
        num_threads: the kernel's thread count on every step (default: ``torch.get_num_threads()`` at each
            step); the engine gives `zero_offload.offload.host_cores`' share.
        chunk_size: elements per ``on_chunk`` call (default: `fused_adam_step`'s).
        rounding: how bf16 parameters (bf16 master weights, DeepSpeed's ``bf16_master_weights_and_grads``: widened
            to fp32, updated, rounded back) are rounded: "nearest" (DeepSpeed's) or "stochastic".
        seed: stochastic rounding's key; each step draws from (seed, step count, ``index_base`` + element), where
            ``index_base`` is a param group key (default 0: the engine gives each rank's partition offset).

    Raises:
        ValueError: a hyper-parameter out of range, or a parameter that is not an fp32 or bf16 CPU tensor.
    """

    checks_params_at_init = True     # DeepSpeed's name for it (compat.ops.adam) checks them at step instead

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        state_dtype: torch.dtype = torch.float32,
        num_threads: int | None = None,
        chunk_size: int | None = None,
        rounding: str = "nearest",
        seed: int = 0,
    ):
        if lr < 0.0:
            raise ValueError(f"CPUAdam: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"CPUAdam: betas must lie in [0, 1), got {tuple(betas)}")
        if eps < 0.0:
            raise ValueError(f"CPUAdam: eps must be >= 0, got {eps}")
        if weight_decay < 0.0:
            raise ValueError(f"CPUAdam: weight_decay must be >= 0, got {weight_decay}")
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"CPUAdam: state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
        self.state_dtype, self.num_threads, self.chunk_size = state_dtype, num_threads, chunk_size
        self.rounding, self.seed = rounding, seed
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode, bias_correction=bias_correction)
        super().__init__(params, defaults)
        for group in self.param_groups if self.checks_params_at_init else ():
            for p in group["params"]:
                if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError(f"CPUAdam: parameters must be fp32 or bf16 CPU tensors, got {p.dtype} on "
                                     f"{p.device}")

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], torch.Tensor] | None = None,
        *,
        grads: Sequence[Sequence[torch.Tensor | None]] | None = None,
        grad_scale: float = 1.0,
        outputs: Sequence[Sequence[torch.Tensor | None]] | None = None,
        on_chunk: Callable[[int, int, int, int], None] | None = None,
        lrs: Sequence[float] | None = None,
        order: Sequence[tuple[int, int, int, int]] | None = None,
        fetch: Callable[[int, int, int, int], tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    ):
        """One optimizer step over every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (torch's convention).
            grads: per group, per parameter, a gradient to use instead of ``p.grad``; it may be 16-bit
                (the engine passes its bf16/fp16 gradient partition, so no fp32 copy is made).
            grad_scale: multiplies every gradient first (1/loss_scale x clip coefficient).
            outputs: per group, per parameter, an optional 16-bit tensor that receives the updated
                parameter (the engine's pinned copy headed back to the device).
            on_chunk: called as ``on_chunk(group_index, param_index, start, end)`` as soon as elements
                ``start:end`` of that parameter (and of its output) are final, in order.
            lrs: per group, the learning rate to use instead of ``group["lr"]`` (a step running in a
                background thread uses the rates taken when it was launched, while the schedule moves on).
            order: the work items ``(group_index, param_index, start, end)`` in the order to step them (the
                engine's: the order the next forward reads the parameters, so the copies up that ``on_chunk``
                starts land in that order); they must cover every parameter that has a gradient exactly once.
                Default: every parameter whole, group by group.
            fetch: called as ``fetch(group_index, param_index, start, end)`` before each work item is stepped:
                its gradient (``end - start`` elements, read instead of the slice of ``grads``) and, unless None,
                the tensor its updated parameters are written to instead of the slice of ``outputs`` (the engine
                pulls a gradient kept on the device down chunk by chunk: `zero_offload.hoststep.grad_stream`).

        Raises:
            ValueError: ``order`` does not cover some parameter with a gradient exactly once.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = {}     # (group, param) -> the gradient, for each parameter this step updates
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                grad = grads[gi][pi] if grads is not None else p.grad
                if grad is not None:
                    stepped[gi, pi] = grad
        items = _work_items(self.param_groups, stepped, order)
        for gi, pi in stepped:
            self._begin_step(self.param_groups[gi]["params"][pi])
        for gi, pi, lo, hi in items:
            group, grad = self.param_groups[gi], stepped[gi, pi]
            p = group["params"][pi]
            state, out = self.state[p], outputs[gi][pi] if outputs is not None else None
            out = None if out is None else out.view(-1)[lo:hi]
            grad = grad.reshape(-1)[lo:hi]
            if fetch is not None:
                grad, fetched_out = fetch(gi, pi, lo, hi)
                out = fetched_out if fetched_out is not None else out
            beta1, beta2 = group["betas"]
            fused_adam_step(
                p.view(-1)[lo:hi], grad, state["exp_avg"].view(-1)[lo:hi],
                state["exp_avg_sq"].view(-1)[lo:hi],
                step=state["step"], lr=group["lr"] if lrs is None else lrs[gi], beta1=beta1, beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"], adamw_mode=group["adamw_mode"],
                bias_correction=group["bias_correction"], grad_scale=grad_scale,
                out=out,
                on_chunk=None if on_chunk is None else (
                    lambda a, b, gi=gi, pi=pi, lo=lo: on_chunk(gi, pi, lo + a, lo + b)),
                num_threads=self.num_threads, chunk_size=self.chunk_size if on_chunk is not None else None,
                **self._rounding(group, state["step"], lo),
            )
        return loss

    def _rounding(self, group: dict, step: int, lo: int) -> dict:
        """`fused_adam_step`'s rounding arguments for elements from ``lo`` of a parameter of ``group`` at ``step``:
        a key per step, and the elements' index in the group's numbering (``index_base``)."""
        return {"rounding": self.rounding, "seed": step_seed(self.seed, step),
                "index_base": group.get("index_base", 0) + lo}

    def _begin_step(self, p: torch.Tensor) -> None:
        """Make or cast ``p``'s moments and count its step (once per step, however many work items it has)."""
        self.ensure_state(p)
        self.count_step(p)

    def ensure_state(self, p: torch.Tensor) -> None:
        """Make ``p``'s moments (zeros, ``state_dtype``) or cast loaded ones, without counting a step."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.contiguous_format)
        elif state["exp_avg"].dtype != self.state_dtype:  # load_state_dict casts states to fp32
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = state[key].to(self.state_dtype).contiguous()

    def count_step(self, p: torch.Tensor) -> None:
        """Count one step of ``p`` (after `step_into` filled every element of a second bank)."""
        self.state[p]["step"] += 1

    @torch.no_grad()
    def step_into(self, gi: int, lo: int, hi: int, grad: torch.Tensor, grad_scale: float,
                  into: dict[str, torch.Tensor], num_threads: int | None = None,
                  out: torch.Tensor | None = None) -> None:
        """The next step (not counted: `count_step`) of elements [lo, hi) of group ``gi``'s only parameter, read
        from its live master and moments (`ensure_state` made them) and written to ``into``'s ``master``,
        ``exp_avg`` and ``exp_avg_sq`` (1-D like the parameter, moments in ``state_dtype``) at [lo, hi); the live
        state is left as it was (`zero_offload.hoststep.speculation`). ``grad``: hi - lo elements, any dtype the
        kernel reads; ``out``: an optional 16-bit tensor of hi - lo elements that receives the new parameters."""
        group = self.param_groups[gi]
        p = group["params"][0]
        state = self.state[p]
        beta1, beta2 = group["betas"]
        live = (p.view(-1)[lo:hi], state["exp_avg"].view(-1)[lo:hi], state["exp_avg_sq"].view(-1)[lo:hi])
        fused_adam_step(into["master"][lo:hi], grad.reshape(-1), into["exp_avg"][lo:hi], into["exp_avg_sq"][lo:hi],
                        step=state["step"] + 1, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], adamw_mode=group["adamw_mode"],
                        bias_correction=group["bias_correction"], grad_scale=grad_scale,
                        num_threads=num_threads or self.num_threads, sources=live, out=out,
                        **self._rounding(group, state["step"] + 1, lo))


def step_seed(seed: int, step: int) -> int:
    """The stochastic rounding key (uint32) of ``step`` under run seed ``seed``: both mixed (splitmix64's
    finalizer), so neighbouring steps and seeds draw unrelated bits."""
    z = (seed * 0x9E3779B97F4A7C15 + step) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def _work_items(groups: list[dict], stepped: dict, order) -> list[tuple[int, int, int, int]]:
    """`CPUAdam.step`'s ``order``, checked (or the default: each stepped parameter whole, group by group)."""
    if order is None:
        return [(gi, pi, 0, groups[gi]["params"][pi].numel()) for gi, pi in stepped]
    covered: dict[tuple[int, int], int] = {}
    for gi, pi, lo, hi in order:
        if (gi, pi) not in stepped or not 0 <= lo < hi <= groups[gi]["params"][pi].numel():
            raise ValueError(f"CPUAdam.step: order item {(gi, pi, lo, hi)} is not a range of a parameter with a "
                             f"gradient")
        covered[gi, pi] = covered.get((gi, pi), 0) + hi - lo
    short = [k for k in stepped if covered.get(k, 0) != groups[k[0]]["params"][k[1]].numel()]
    if short:
        raise ValueError(f"CPUAdam.step: order covers (group, param) {short[0]} {covered.get(short[0], 0)} elements "
                         f"of {groups[short[0][0]]['params'][short[0][1]].numel()} (each exactly once)")
    return list(order)
