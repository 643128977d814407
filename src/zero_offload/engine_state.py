"""`EngineState`: the engine's training state as DeepSpeed's engine exposes it: its own ``state_dict``, checkpoints
saved and loaded (ours, DCP, DeepSpeed's), and the fp32 weights gathered whole.

A mixin of `zero_offload.engine.Engine`: it reads the engine's counters, loss scaler, schedule, ZeRO optimizer
(``zero``), module and host-step pipeline (``host_step``), and calls its ``flush_delayed_update``.
"""
from __future__ import annotations

from typing import Any

import torch

from zero_offload.checkpoint.formats import TORCHTITAN_KEYS, load_any, save_any
from zero_offload.comm import deadline
from zero_offload.runtime.state import check_engine_state

__all__ = ["EngineState"]


class EngineState:
    """Save, load and export of the engine's training state (see the module docstring)."""

    def state_dict(self) -> dict:
        """The engine's own state, JSON-serialisable: ``global_step``, ``skipped_steps``, ``micro_steps``,
        ``loss_scaler`` and ``lr_scheduler`` (their ``state_dict()``; None without a schedule) and ``lrs``
        (one learning rate per param group). Optimizer partitions are in `optimizer_state`."""
        return {"global_step": self.global_step, "skipped_steps": self.skipped_steps,
                "micro_steps": self.micro_steps, "loss_scaler": self.scaler.state_dict(),
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
                "lrs": self.get_lr()}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s output, as of a step boundary: gradients accumulated so far are dropped and
        micro-steps are counted in this run's accumulation (it may differ from the saved one).

        Raises:
            ValueError: a missing key or a learning rate list of another length; nothing is changed then.
        """
        check_engine_state(state, len(self.optimizer.param_groups))
        self.scaler.validate_state_dict(state["loss_scaler"])
        self.zero.zero_grad()
        self._boundary_pending = False
        self.global_step, self.skipped_steps = int(state["global_step"]), int(state["skipped_steps"])
        self.micro_steps = self.global_step * self.gradient_accumulation_steps
        self.scaler.load_state_dict(state["loss_scaler"])
        for group, lr in zip(self.optimizer.param_groups, state["lrs"]):
            group["lr"] = float(lr)
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    @deadline
    def save_checkpoint(self, save_dir, tag: str | None = None, client_state: Any = None,
                        format: str = "zero-offload", dcp_keys: tuple[str, str] = TORCHTITAN_KEYS):
        """Save the full training state, sharded by rank and written atomically (see `checkpoint`).

        A collective: every rank calls it. ``tag`` defaults to ``global_step{N}``; ``save_dir/latest`` is
        updated last. Returns the checkpoint's directory. ``format="dcp"`` writes ``save_dir`` (or
        ``save_dir/tag``) as a ``torch.distributed.checkpoint`` directory that FSDP2 resumes
        (`zero_offload.checkpoint.dcp.save_dcp`; no ``client_state``), the model and the optimizer under
        ``dcp_keys`` (dotted key paths, ``""`` the top level; default torchtitan's: the model at the top level, the
        optimizer under ``"optimizer"``; ``("model", "optim")`` for a ``get_state_dict`` script, ``("app.model",
        "app.optim")`` for the DCP tutorial's); ``format="deepspeed-universal"`` writes
        DeepSpeed's universal layout under ``save_dir/tag``, which DeepSpeed resumes at any stage and world size
        with ``checkpoint.load_universal`` (`zero_offload.checkpoint.deepspeed_write`).

        Raises:
            ValueError: an unknown ``format``, ``client_state`` with ``format="dcp"``, or a ``client_state``
                that is not a dict with ``format="deepspeed-universal"`` (DeepSpeed keeps its keys).
            CheckpointError: writing failed (`save_checkpoint`, `save_dcp`, `save_universal` name the file).
        """
        self.flush_delayed_update()
        return save_any(self, save_dir, tag, client_state, format, dcp_keys)

    @deadline
    def load_checkpoint(self, load_dir, tag: str | None = None, *, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        trust_pickles: bool | None = None) -> Any:
        """Restore a checkpoint (default: the ``latest`` one), resharding from any world size or stage,
        and return the ``client_state`` it was saved with. Two foreign kinds load too, into any stage and world
        size: a ``torch.distributed.checkpoint`` directory that FSDP2 wrote (``load_dir``, or ``load_dir/tag``,
        holding ``.metadata``: its parameters, AdamW moments and step; returns None), and a DeepSpeed checkpoint,
        ZeRO stage 1-3 or universal (`zero_offload.checkpoint.deepspeed_read`: masters, moments, step, loss
        scale, LR schedule; returns the user's ``client_state`` keys). The keyword flags are DeepSpeed's and apply
        to DeepSpeed checkpoints. Pickled files (the client state, DeepSpeed's ``.pt`` files, DCP's metadata) load
        through an allow-list of data types (`zero_offload.checkpoint.safe_pickle`); ``trust_pickles=True`` (None:
        the config key ``checkpoint.trust_pickles``, default false) loads any type, running what the file names.

        Raises:
            CheckpointError: a missing or corrupted file, an unknown tag, another model's checkpoint, or a
                foreign one that cannot be mapped; the engine is left as it was.
        """
        # Finish (not drop) a delayed step first: if the load then fails, the engine stays consistent.
        self.flush_delayed_update()
        trust = self.config.checkpoint.trust_pickles if trust_pickles is None else trust_pickles
        return load_any(self, load_dir, tag, load_optimizer_states=load_optimizer_states,
                        load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                        trust_pickles=trust)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: fp32 CPU tensor} of every parameter (first name of each; floating frozen ones in fp32): the
        trainable ones from the fp32 master weights of all ranks, the frozen ones from their values (gathered
        at stage 3). A collective: every rank must call it. Under the delayed parameter update these are the
        masters after the last step, which the model runs on only from the step after next."""
        self.host_step.wait()
        out = self.zero.full_master_state(self.module)
        sharded = self.zero.frozen_state(every_rank=True)
        for name, p in self.module.named_parameters():
            if not p.requires_grad:
                t = sharded[name] if name in sharded else p.detach().cpu()
                out[name] = t.to(torch.float32 if t.is_floating_point() else t.dtype, copy=True)
        return out
