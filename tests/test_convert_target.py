"""`convert`'s target (`checkpoint.convert_target`): the partitions are a stream handed on once, checked as it
goes, and the small state takes only an engine's `state_dict` form."""
import pytest
import torch

import zero_offload

from zero_offload.checkpoint.convert import skeleton
from zero_offload.checkpoint.convert_target import ConversionTarget, StreamedPartitions, single_rank_layout

SHAPES = {"a.w": (2, 3), "b": (4,)}
CONFIG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}


def _pieces(values):
    return [(0, {k: values for k in ("master", "exp_avg", "exp_avg_sq")})]


def test_a_layout_of_one_rank_puts_the_parameters_end_to_end():
    layout = single_rank_layout(["b", "a.w"], SHAPES)
    assert layout.partition_numel == 10
    assert [(p.name, p.pieces[0].part_offset, p.pieces[0].length) for p in layout.params] == [("b", 0, 4),
                                                                                          ("a.w", 4, 6)]


def test_the_stream_is_handed_on_once_and_checked():
    parts = StreamedPartitions([single_rank_layout(list(SHAPES), SHAPES)])
    with pytest.raises(RuntimeError, match="not loaded, or already passed on"):
        parts.state_chunks(0)
    parts.load_state_chunks(0, 7, _pieces(torch.arange(10.)))
    assert parts.group_step(0) == 7
    assert torch.equal(next(iter(parts.state_chunks(0)))[1]["master"], torch.arange(10.))
    with pytest.raises(RuntimeError, match="already passed on"):
        parts.state_chunks(0)
    parts.load_state_chunks(0, 7, _pieces(torch.arange(9.)))
    with pytest.raises(ValueError, match="cover 9 of group 0's 10 elements"):
        list(parts.state_chunks(0))


def test_frozen_shards_are_refused():
    with pytest.raises(ValueError, match=r"frozen parameters \['f'\] have no shards here"):
        StreamedPartitions([]).load_frozen_state({"f": torch.zeros(1)})


def test_the_small_state_starts_as_an_engines_and_takes_only_its_form():
    target = ConversionTarget(skeleton(SHAPES, {}, device="meta"), CONFIG, [({"lr": 5e-4}, ["a.w", "b"])])
    state = target.state_dict()
    model = skeleton(SHAPES, {})
    engine = zero_offload.initialize(model, CONFIG, [{"params": list(model.parameters()), "lr": 5e-4}])
    try:
        assert state == engine.state_dict()
    finally:
        engine.close()
    with pytest.raises(ValueError, match="engine state lacks lrs"):
        target.load_state_dict({k: v for k, v in state.items() if k != "lrs"})
    with pytest.raises(ValueError, match="2 learning rates for 1 param groups"):
        target.load_state_dict({**state, "lrs": [1.0, 2.0]})
    target.load_state_dict({**state, "global_step": 5, "lrs": [2e-4]})
    assert target.global_step == 5 and target.optimizer.param_groups[0]["lr"] == 2e-4
