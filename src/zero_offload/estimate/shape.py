"""What the memory model needs to know of a model: its parameters as the engine groups them (`ModelShape`), from
an ``nn.Module``, a preset name, a `GPTConfig` or a bare parameter count (`model_shape`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_offload.estimate.decoder_activations import DecoderShape, decoder_shape
from zero_offload.presets import GPTConfig, gpt_units, preset

from zero_offload.param_groups import takes_muon

__all__ = ["ModelShape", "model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs to know of a model.

    Attributes:
        units: ``(module name, param group, [numels])`` per stage-3 unit, in the engine's build order.
        gpt: the transformer's shape when known (sizes activations), else None.
        name: for messages and tables.
        frozen: ``(module name, -1, [numels])`` per unit of ``requires_grad=False`` parameters (sharded at
            stage 3 like trainable ones, `zero.stage3.frozen`; never optimized).
        muon_groups: the param groups optimizer type Muon steps with Muon (group 0: the matrices; group 1 the
            rest, as `zero_offload.param_groups` splits them).
        muon_matrices: the shapes of the matrices Muon orthogonalizes (the step model's Newton-Schulz FLOPs).
        decoder: a Llama-family Hugging Face decoder's sizes when the model is one (sizes its activations:
            `zero_offload.estimate.decoder_activations`), else None.
    """
    units: tuple[tuple[str, int, tuple[int, ...]], ...]
    gpt: GPTConfig | None = None
    name: str = "model"
    frozen: tuple[tuple[str, int, tuple[int, ...]], ...] = ()
    muon_groups: frozenset[int] = frozenset()
    muon_matrices: tuple[tuple[int, ...], ...] = ()
    decoder: DecoderShape | None = None

    @property
    def n_params(self) -> int:
        return sum(sum(n) for _, _, n in self.units)

    def group_numels(self) -> list[list[int]]:
        groups: dict[int, list[int]] = {}
        for _, g, numels in self.units:
            groups.setdefault(g, []).extend(numels)
        return [groups[g] for g in sorted(groups)]

    @property
    def largest_unit(self) -> int:
        return max(sum(n) for _, _, n in self.units)


def model_shape(model, muon: bool = False) -> ModelShape:
    """A `ModelShape` from an ``nn.Module`` (any device, meta included; one param group, as
    `initialize` makes without ``model_parameters``), a preset name, a `GPTConfig`, or a parameter count.
    ``muon``: optimizer type Muon, which splits the parameters into a Muon and an Adam group
    (`zero_offload.param_groups.takes_muon`; a preset is built on the meta device for its names; a bare count
    stays one group).

    Raises:
        ValueError: an unknown preset name (the message lists the valid ones), a count < 1, or a module with
            no trainable parameters.
        TypeError: anything else.
    """
    if muon and isinstance(model, (str, GPTConfig)):
        from zero_offload.train.model import GPT          # the main job's model, named as the engine groups it
        cfg = preset(model) if isinstance(model, str) else model
        with torch.device("meta"):
            units = model_shape(GPT(cfg), muon=True)
        return ModelShape(units.units, cfg, model if isinstance(model, str) else "gpt", (), units.muon_groups,
                          units.muon_matrices)
    if isinstance(model, str):
        cfg = preset(model)
        return ModelShape(tuple((m, g, tuple(n)) for m, g, n in gpt_units(cfg)), cfg, model)
    if isinstance(model, GPTConfig):
        return ModelShape(tuple((m, g, tuple(n)) for m, g, n in gpt_units(model)), model, "gpt")
    if isinstance(model, bool) or not isinstance(model, (int, torch.nn.Module)):
        if isinstance(model, float) and model.is_integer():
            model = int(model)
        else:
            raise TypeError(f"estimate_memory needs an nn.Module, a preset name or a parameter count, "
                            f"got {type(model).__name__}")
    if isinstance(model, int):
        if model < 1:
            raise ValueError(f"a model needs at least 1 parameter, got {model}")
        return ModelShape((("model", 0, (model,)),), None, f"{model / 1e9:.3g}B params")
    units, frozen = _module_units(model, True, muon), _module_units(model, trainable=False)
    if not units and not frozen:
        raise ValueError(f"{type(model).__name__} has no parameters")
    gpt = getattr(model, "config", None)
    muon_groups = frozenset({0}) if muon and any(g == 0 for _, g, _ in units) else frozenset()
    if muon and not muon_groups:          # no matrix takes Muon: the Adam half is the only group
        units = tuple((m, 0, n) for m, _, n in units)
    matrices = tuple(tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad and takes_muon(p, n)) \
        if muon_groups else ()
    return ModelShape(units, gpt if isinstance(gpt, GPTConfig) else None, type(model).__name__, frozen,
                      muon_groups, matrices, _decoder(model))


def _decoder(model: torch.nn.Module) -> DecoderShape | None:
    """A transformers decoder's `DecoderShape`, with its own checkpointing setting (``is_activation_checkpointing``
    in transformers 5, ``is_gradient_checkpointing`` before it)."""
    config = getattr(model, "config", None)
    if config is None or isinstance(config, GPTConfig) or getattr(config, "model_type", None) is None:
        return None
    if not callable(getattr(model, "get_output_embeddings", None)) or model.get_output_embeddings() is None:
        return None                      # no LM head (a base model, a classifier): the head's term would be wrong
    ckpt = getattr(model, "is_activation_checkpointing", None)
    if ckpt is None:
        ckpt = getattr(model, "is_gradient_checkpointing", False)
    return decoder_shape(config, bool(ckpt))


def _module_units(model: torch.nn.Module, trainable: bool,
                  muon: bool = False) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
    """Stage 3's unit rule: a parameter belongs to the first module that holds it (tied ones count once); with
    ``muon``, per group (Muon's, then Adam's), as the engine builds them."""
    seen: set[int] = set()
    units = []
    for name, module in model.named_modules():
        own = [(f"{name}.{n}" if name else n, p) for n, p in module.named_parameters(recurse=False)
               if p.requires_grad == trainable and id(p) not in seen]
        if own:
            seen.update(id(p) for _, p in own)
            group = (lambda n, p: 0 if takes_muon(p, n) else 1) if muon else (lambda n, p: 0 if trainable else -1)
            units += [(name, g, tuple(p.numel() for n, p in own if group(n, p) == g))
                      for g in sorted({group(n, p) for n, p in own})]
    return tuple(sorted(units, key=lambda u: u[1]) if muon else units)
