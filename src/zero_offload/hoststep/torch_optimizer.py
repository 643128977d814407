"""Any torch optimizer over this rank's partition, for the settings the fused Adam kernel does not cover.

As DeepSpeed runs ``getattr(torch.optim, optimizer.type)(params, **optimizer.params)`` for a type it has no kernel
of its own for, and torch's Adam for ``amsgrad``, that optimizer steps the fp32 master partition here (on the host
when offloaded), written back as `PartitionedAdam` writes it. ``Lamb`` (`zero_offload.optim.lamb.Lamb`, DeepSpeed's
FusedLamb) runs here too, told where each parameter's pieces sit so that its per-tensor trust ratios see whole tensors.
"""
from __future__ import annotations

from typing import Sequence

import torch

from zero_offload.optim.lamb import Lamb
from zero_offload.runtime.state import fill_from_chunks
from zero_offload.hoststep.role import GradSource
from zero_offload.hoststep.adam import PartitionedAdam

__all__ = ["PartitionedTorchOptimizer"]


class PartitionedTorchOptimizer(PartitionedAdam):
    """`PartitionedAdam`'s partition, masters and write-back, stepped by a torch optimizer.

    Args:
        type_name: ``Adam``/``AdamW`` (then with ``amsgrad=True``), ``Lamb`` or a torch.optim class name.
        torch_kwargs: the config's ``optimizer.params`` for a torch.optim type or Lamb (None for Adam/AdamW);
            each group's ``lr`` (and ``weight_decay``; Lamb's ``betas`` and ``eps`` too) come from
            ``hparams``, so per-group values and the LR schedule apply.
        segments: Lamb only: per group, ``(pieces, count)``: the (start, end, tensor index) element ranges
            of the partition and how many tensors the group holds (`zero_offload.optim.lamb.Lamb`).
        all_reduce: Lamb only: sums the per-tensor squared norms over the ranks (None: tensors are whole).
    """

    def __init__(self, parts, hparams, offload, copies, host_params=False, *, type_name: str,
                 torch_kwargs: dict | None, segments: list | None = None, all_reduce=None):
        super().__init__(parts, hparams, offload, copies, host_params=host_params)
        self.type_name = type_name
        groups = []
        for master, h in zip(self.masters, hparams):
            if torch_kwargs is None:
                cls = torch.optim.AdamW if h["adamw_mode"] else torch.optim.Adam
                groups.append(dict(params=[master], lr=h["lr"], betas=h["betas"], eps=h["eps"],
                                   weight_decay=h["weight_decay"], amsgrad=True))
            else:
                cls = Lamb if type_name == "Lamb" else getattr(torch.optim, type_name)
                group = dict(torch_kwargs, params=[master], lr=h["lr"])
                if "weight_decay" in torch_kwargs or h["weight_decay"]:
                    group["weight_decay"] = h["weight_decay"]
                if cls is Lamb:
                    group.update(betas=h["betas"], eps=h["eps"])
                groups.append(group)
        # The config's params as constructor defaults too: some optimizers read them only from there when they
        # set up state (Adagrad's initial_accumulator_value).
        segments = {m: seg for m, seg in zip(self.masters, segments)} if segments else None
        extra = dict(segments=segments, all_reduce=all_reduce) if type_name == "Lamb" else {}
        self.optimizer = cls(groups, **(torch_kwargs or {}), **extra)
        self.amsgrad = torch_kwargs is None
        self.steps = [0] * len(self.masters)         # optimizer steps taken, per group (SGD keeps no count)
        self._probe_state(cls, groups[0])

    @torch.no_grad()
    def step(self, grads: Sequence[GradSource], grad_scale: float, lrs: Sequence[float] | None = None,
             publish: bool = True) -> None:
        """The `PartitionOptimizer` step, by the torch optimizer on the masters. Never deferred: ``lrs`` and
        ``publish`` are not used (the groups' learning rates apply).

        Raises:
            RuntimeError: a gradient source with copies still in flight (`GradSource.ready`).
        """
        for master, g in zip(self.masters, grads):
            master.grad = g.ready().to(master.device, torch.float32, copy=True).mul_(grad_scale)
        self.optimizer.step()
        self.steps = [s + 1 for s in self.steps]
        self.write_parts()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Master partitions and the optimizer's per-element states (first-moment-like under ``exp_avg``,
        the rest under ``exp_avg_sq``), for memory accounting."""
        first, rest = [], []
        for m in self.masters:
            for name, t in self.optimizer.state.get(m, {}).items():
                if isinstance(t, torch.Tensor) and t.numel() == m.numel():
                    (first if name in ("exp_avg", "momentum_buffer") else rest).append(t)
        return {"master": self.masters, "exp_avg": first, "exp_avg_sq": rest}

    # -- checkpoints: the per-element states in the two moment slots of the checkpoint format --------------
    def _probe_state(self, cls, group: dict) -> None:
        """Step a two-element copy of the optimizer once to learn its state's names: per-element tensors go to
        the checkpoint's ``exp_avg``/``exp_avg_sq`` slots in that order, ``step`` is the shared step count,
        anything else cannot be saved here (`checkpoint_refusal` names it)."""
        probe = torch.zeros(2, requires_grad=True)     # two elements: per-element states vs scalars
        opt = cls([dict(group, params=[probe])])
        probe.grad = torch.ones(2)
        opt.step()
        state = opt.state[probe]
        self.slot_names = tuple(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() == 2
                                and k != "step")
        self.step_like = state.get("step")
        self.checkpoint_refusal = None
        others = [k for k, v in state.items() if k != "step" and k not in self.slot_names and v is not None]
        if len(self.slot_names) > 2 or others:
            key = (others + list(self.slot_names[2:]))[0]
            self.checkpoint_refusal = (
                f"checkpoints of optimizer type {self.type_name!r}{' with amsgrad' if self.amsgrad else ''} are "
                f"not built: its state {key!r} has no place in the checkpoint format (master, exp_avg, "
                f"exp_avg_sq per element, one step count) and could not be resharded. Save with another "
                f"optimizer type, or save the model with engine.save_16bit_model / engine.full_state_dict()")
        self.initial_state = [{k: v.clone() if isinstance(v, torch.Tensor) else v
                               for k, v in self.optimizer.state.get(m, {}).items()} for m in self.masters]

    def state_format(self) -> str:
        """What the checkpoint's moment slots hold: ``torch.<type>:<slot names>``."""
        return f"torch.{self.type_name}{'+amsgrad' if self.amsgrad else ''}:{','.join(self.slot_names)}"

    def group_step(self, g: int) -> int:
        return self.steps[g]

    def state_chunks(self, g: int, chunk_numel: int = 1 << 24):
        """As `PartitionedAdam.state_chunks`, with the optimizer's per-element states (SGD's momentum_buffer,
        Adagrad's sum, ...; zeros where absent) under ``exp_avg`` and ``exp_avg_sq``.

        Raises:
            NotImplementedError: the optimizer keeps a state the format cannot hold (amsgrad's
                max_exp_avg_sq, NAdam's mu_product, ...), naming the type and the state key.
        """
        if self.checkpoint_refusal:
            raise NotImplementedError(self.checkpoint_refusal)
        yield from super().state_chunks(g, chunk_numel)

    def _moments(self, g: int) -> list[torch.Tensor | None]:
        # Per-element states in the two moment slots (SGD momentum, Adagrad sum, ...); fewer leave zeros.
        state = self.optimizer.state.get(self.masters[g], {})
        return [state.get(key) if key else None for key in (*self.slot_names, None, None)[:2]]

    @torch.no_grad()
    def load_state_chunks(self, g: int, step: int, chunks) -> None:
        """Replace group ``g``'s partition from `state_chunks`' pieces, with ``step`` steps taken; at step 0
        the optimizer's state is its fresh one (as after construction).

        Raises:
            NotImplementedError: as `state_chunks`. ValueError: pieces that do not cover the partition.
        """
        if self.checkpoint_refusal:
            raise NotImplementedError(self.checkpoint_refusal)
        mine = self.masters[g]
        if step == 0:
            fresh = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.initial_state[g].items()}
            self.optimizer.state.pop(mine, None)
            if fresh:
                self.optimizer.state[mine] = fresh
            slots = {}
        else:
            state = self.optimizer.state.get(mine) or {}
            for name in self.slot_names:
                if not isinstance(state.get(name), torch.Tensor):
                    state[name] = torch.zeros_like(mine)
            if self.step_like is not None:
                state["step"] = (torch.tensor(float(step), dtype=self.step_like.dtype)
                                 if isinstance(self.step_like, torch.Tensor) else step)
            self.optimizer.state[mine] = state
            slots = dict(zip(("exp_avg", "exp_avg_sq"), (state[k] for k in self.slot_names)))
        fill_from_chunks(chunks, g, {"master": mine, **slots})
        self.steps[g] = step
        self.write_parts([g])
