"""Where the model and the optimizer state dicts sit in a ``torch.distributed.checkpoint`` directory.

People write several layouts, and DCP's metadata flattens each nested key path with dots:

=====================================  ==================================  =================================
who writes it                          model                               optimizer
=====================================  ==================================  =================================
torchtitan (the default written here)  top level: ``layers.0.w.weight``    ``optimizer.state.<name>.exp_avg``
``get_state_dict`` scripts             ``model.<name>``                    ``optim.state.<name>.exp_avg``
many training scripts                  ``model.<name>``                    ``optimizer.state.<name>.exp_avg``
the DCP tutorial (``AppState``)        ``app.model.<name>``                ``app.optim.state.<name>.exp_avg``
=====================================  ==================================  =================================

A reader need not be told which: `find_layout` finds the optimizer by its AdamW states (``<root>state.<name>.exp_avg``
beside ``<root>param_groups``) and the model by the parameters' own names under one prefix, and refuses only what
is ambiguous, naming the candidates. A key path is dotted (``"app.model"``); ``""`` is the top level.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zero_offload.checkpoint.io import CheckpointError

__all__ = ["DcpLayout", "TORCHTITAN", "find_layout", "model_root", "optimizer_names"]


@dataclass(frozen=True)
class DcpLayout:
    """The key paths of the model and the optimizer state dicts (dotted; ``""``: the top level)."""
    model: str
    optim: str

    def model_key(self, name: str) -> str:
        """The flattened key of model entry ``name``."""
        return _join(self.model, name)

    def optim_key(self, *parts: str) -> str:
        """The flattened key of the optimizer's entry at ``parts`` (``"state", name, "exp_avg"``)."""
        return _join(self.optim, ".".join(parts))

    def nest(self, model: dict | None = None, optim: dict | None = None) -> dict:
        """A state dict with ``model``'s entries at the model's path and ``optim``'s at the optimizer's."""
        out: dict = {}
        for root, value in ((self.model, model), (self.optim, optim)):
            if value is not None:
                _place(out, root, value)
        return out

    def model_part(self, tree: dict) -> dict:
        return _at(tree, self.model)

    def optim_part(self, tree: dict) -> dict:
        return _at(tree, self.optim)


TORCHTITAN = DcpLayout("", "optimizer")


def _join(root: str, rest: str) -> str:
    return f"{root}.{rest}" if root else rest


def _place(tree: dict, root: str, value: dict) -> None:
    if not root:
        tree.update(value)
        return
    *parents, last = root.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[last] = value


def _at(tree: dict, root: str) -> dict:
    for key in root.split(".") if root else ():
        tree = tree[key]
    return tree


def _optimizer_roots(meta: dict) -> dict[str, set[str]]:
    """{optimizer root (dotted, ``""`` for the top level): the parameter names its AdamW states are for}: every
    ``<root>state.<name>.exp_avg`` key whose root also holds ``param_groups``."""
    roots: dict[str, set[str]] = {}
    for key in meta:
        if not key.endswith(".exp_avg"):
            continue
        at = 0
        while (at := key.find("state.", at)) >= 0:
            if at == 0 or key[at - 1] == ".":
                root = key[:at - 1] if at else ""
                if any(k.startswith(_join(root, "param_groups.")) for k in meta):
                    roots.setdefault(root, set()).add(key[at + len("state."):-len(".exp_avg")])
            at += 1
    return roots


def optimizer_names(meta: dict, path: Path) -> tuple[str, set[str]]:
    """The optimizer's root in the checkpoint and the names of the parameters it has AdamW states for.

    Raises:
        CheckpointError: none or several optimizers (their roots named).
    """
    roots = _optimizer_roots(meta)
    if len(roots) != 1:
        found = ", ".join(repr(r) for r in sorted(roots)) or "none"
        raise CheckpointError(f"checkpoint '{path}': expected one AdamW optimizer state (keys '<root>.state.<name>."
                              f"exp_avg' beside '<root>.param_groups'), found {found}")
    return next(iter(roots.items()))


def model_root(meta: dict, names: list[str], path: Path) -> str:
    """The one prefix under which every parameter of ``names`` is a tensor in the checkpoint.

    Raises:
        CheckpointError: the first name found under no prefix (``another model``), or several prefixes (named).
    """
    first = names[0]
    roots = {k[:-len(first) - 1] if k != first else "" for k in meta if k == first or k.endswith("." + first)}
    roots = {r for r in roots if all(hasattr(meta.get(_join(r, n)), "size") for n in names)}
    if not roots:
        missing = next((n for n in names if not any(hasattr(v, "size") for k, v in meta.items()
                                                    if k == n or k.endswith("." + n))), first)
        raise CheckpointError(f"checkpoint '{path}' is from another model: it has no parameter '{missing}' (under "
                              f"any prefix)")
    if len(roots) > 1:
        found = ", ".join(repr(r) for r in sorted(roots))
        raise CheckpointError(f"checkpoint '{path}' holds the model's parameters under several prefixes: {found}; "
                              f"name the one to load: zero_offload.checkpoint.dcp.load_dcp(engine, path, "
                              f"keys=(model key, optimizer key))")
    return roots.pop()


def find_layout(meta: dict, names: list[str], path: Path) -> DcpLayout:
    """The layout of the checkpoint whose metadata is ``meta`` ({flattened key: storage metadata}), for a model
    whose trainable parameters are ``names`` (see the module docstring).

    Raises:
        CheckpointError: no AdamW state or no such parameters (the first missing named), or an ambiguous layout
            (the candidates named).
    """
    model = model_root(meta, names, path)
    optim, saved = optimizer_names(meta, path)
    for name in names:
        if name not in saved:
            raise CheckpointError(f"checkpoint '{path}' has no optimizer state 'exp_avg' for parameter '{name}' "
                                  f"(under '{_join(optim, 'state')}'): not an AdamW checkpoint of this model")
    return DcpLayout(model, optim)
