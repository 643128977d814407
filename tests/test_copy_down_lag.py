"""Copies down start as soon as a bucket is reduced (issue 27, item 3): at one rank a bucket's reduction is
complete when it is launched, so its copy down is issued at once, not ``MAX_IN_FLIGHT`` buckets later (before,
the last two buckets of a backward went down only after it). Counted with the simulated streams' copy count,
read in a gradient hook that runs after the engine's own for the same parameter, at stage 3 (one unit per
layer, so a layer's weight completes its unit); stage 2's reducer uses the same `InFlight`, tested alone below."""
import torch

import zero_offload
from test_simulated_streams import in_mode
from zero_offload.offload import simulated
from zero_offload.zero.collectives import InFlight

LAYERS, DIM = 6, 16
PER_LAYER = DIM * DIM + DIM


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def copies_seen_per_layer(stage: int) -> list[int]:
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": PER_LAYER, "overlap_comm": True,
                                 "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}}}
    model = Stack()
    engine = zero_offload.initialize(model, cfg)
    seen: dict[int, int] = {}

    def note(i: int):
        def hook(_param) -> None:
            seen.setdefault(i, simulated.counts().copies)
        return hook
    for i, layer in enumerate(model.layers):     # after the engine's hooks: its bucket was just launched
        layer.weight.register_post_accumulate_grad_hook(note(i))
    x = torch.randn(2, DIM)
    engine.backward(engine(x))        # the first step: buckets are laid out in this backward's order
    engine.step()
    seen.clear()
    start = simulated.counts().copies
    engine.backward(engine(x))
    engine.step()
    engine.close()
    return [seen[i] - start for i in reversed(range(LAYERS))]     # in backward order


def test_each_reduced_unit_goes_down_before_the_next_layer_backward():
    """Stage 3: one unit per layer. By the weight hook of the k-th layer in backward order (k from 0), the k
    units before it went down (before the fix: [0, 0, 1, 2, 3, 4], two behind)."""
    issued = in_mode("sim", copies_seen_per_layer, 3)
    assert all(n >= k for k, n in enumerate(issued)), issued


def test_completed_reductions_finish_at_once_and_the_bound_still_holds():
    finished = []
    done = {"a": True, "b": False, "c": True, "d": False, "e": False, "f": False}
    in_flight = InFlight(2, finished.append, lambda item: done[item])
    in_flight.push("a")                 # complete: finished at once
    in_flight.push("b")
    in_flight.push("c")                 # complete, but behind b: order is kept
    assert finished == ["a"] and len(in_flight) == 2
    in_flight.push("d")                 # over the bound: b goes, then c (complete) right after it
    assert finished == ["a", "b", "c"] and len(in_flight) == 1
    in_flight.push("e")
    in_flight.push("f")                 # the bound alone: d goes
    assert finished == ["a", "b", "c", "d"]
