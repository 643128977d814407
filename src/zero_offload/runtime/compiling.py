"""``torch.compile`` under the engine: `compile_module`, which `Engine.compile` runs (DeepSpeed 0.19.8's
``DeepSpeedEngine.compile``, same keywords), and `compile_counts`, the documented way to see graphs, graph breaks and
recompiles (docs/library.md, "torch.compile").

The engine's hooks are never traced: stage 3's module hooks (gather before a module's forward, release after it,
the backward hooks they register) are wrapped in ``torch.compiler.disable``, so dynamo breaks the graph at each of
them and runs them eagerly, and the gradient hooks of every stage run in autograd's engine, outside any graph. A
parameter keeps its identity across gather and release, and its shape whenever a compiled graph runs, so guards hold
and nothing recompiles after the first step (tests/test_compile.py counts frames and graphs with `compile_counts`).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

__all__ = ["CompileCounts", "compile_counts", "compile_module", "is_compiled_module"]


@dataclass(frozen=True)
class CompileCounts:
    """Dynamo's running totals in this process.

    Attributes:
        frames: frames compiled (a recompile adds one).
        graphs: unique graphs produced.
        graph_breaks: graph breaks met while compiling (each break site once per compile).
    """
    frames: int
    graphs: int
    graph_breaks: int

    def since(self, earlier: "CompileCounts") -> "CompileCounts":
        """What was compiled after ``earlier`` was taken (all zero: no recompilation)."""
        return CompileCounts(self.frames - earlier.frames, self.graphs - earlier.graphs,
                             self.graph_breaks - earlier.graph_breaks)


def compile_counts() -> CompileCounts:
    """Dynamo's counts now (``torch._dynamo.utils.counters``); take one after warm-up and compare a later one with
    `CompileCounts.since`."""
    from torch._dynamo.utils import counters
    return CompileCounts(int(counters["frames"]["ok"]), int(counters["stats"]["unique_graphs"]),
                         int(sum(counters["graph_break"].values())))


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` itself is compiled: a ``torch.compile(m)`` wrapper or ``m.compile()`` in place."""
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


def compile_module(module: torch.nn.Module, backend="inductor", compile_kwargs: dict | None = None, schedule=None,
                   compiled_autograd_enabled: bool = False) -> bool:
    """Compile ``module`` in place (``module.compile(backend=..., **compile_kwargs)``), as DeepSpeed 0.19.8's
    ``DeepSpeedEngine.compile`` does without DeepCompile; returns False (and warns) when it is compiled already.

    Args:
        backend: torch.compile's backend (a name or a callable); DeepSpeed's default on CUDA and CPU, "inductor".
        compile_kwargs: torch.compile's other keywords (``mode``, ``fullgraph``, ``dynamic``, ``options``); a
            ``backend`` among them is overridden by ``backend``, with a warning, as DeepSpeed does.
        schedule: DeepCompile's pass schedule: refused (DeepCompile is not built here).
        compiled_autograd_enabled: refused: compiled autograd would trace the engine's gradient hooks (bucketing,
            reductions, copies to the host), which run eagerly.

    Raises:
        ValueError: ``schedule`` given, or ``compiled_autograd_enabled`` true (the message names the argument).
    """
    if schedule is not None:
        raise ValueError("engine.compile: schedule configures DeepCompile's passes (config key "
                         "'compile.deepcompile'), which zero-offload does not build; leave it None")
    if compiled_autograd_enabled:
        raise ValueError("engine.compile: compiled_autograd_enabled=True is not supported: compiled autograd would "
                         "trace the engine's gradient hooks (bucketing, reductions, copies to the host), which "
                         "run eagerly; leave it False")
    kwargs = dict(compile_kwargs or {})
    if "backend" in kwargs:
        warnings.warn("engine.compile: the 'backend' in compile_kwargs is overridden by the backend argument",
                      stacklevel=3)
        kwargs.pop("backend")
    if is_compiled_module(module):
        warnings.warn("engine.compile: the model is compiled already (torch.compile or .compile() before "
                      "initialize); it is not compiled again", stacklevel=3)
        return False
    module.compile(backend=backend, **kwargs)
    return True
