"""`engine.stats`: what one optimizer step moved, counted by the parts that move it, checked against the byte
arithmetic of the step (fp32 toy model, so the 16-bit and fp32 sizes are one)."""
import zero_offload
from dist_utils import run_ranks
from reference import MICRO, engine_config
from toy_model import batch, make_model

GAS = 2


def _train(config, steps=2):
    engine = zero_offload.initialize(make_model(), config)
    seen = []
    for step in range(steps):
        x, y = batch(step, MICRO * GAS)
        for k in range(GAS):
            rows = slice(k * MICRO, (k + 1) * MICRO)
            engine.backward(engine(x[rows], y[rows]))
            engine.step()
        seen.append(engine.stats)
    return seen, {k: v["bytes"] for k, v in engine.memory_breakdown().items()}


def test_stage2_offload_moves_each_micro_steps_gradient_down_and_the_parameters_up_once():
    stats, held = _train(engine_config(2, "cpu", GAS))
    for s in stats:
        assert s.bytes_down == GAS * held["params"]     # every micro-step's reduced buckets, one rank: all
        assert s.bytes_up == held["params"]             # the updated parameters, once per step
        assert s.reductions > 0 and s.reductions % GAS == 0
        assert s.gathers == 0 and s.host_syncs == 0     # one rank; no accelerator


def test_stage0_on_the_device_copies_nothing():
    stats, _ = _train(engine_config(0, "none", GAS))
    assert all(s.bytes_down == s.bytes_up == 0 and s.reductions > 0 for s in stats)


def test_stage3_gathers_a_persistent_unit_once_per_step_and_a_released_one_per_use():
    """Persistent units are gathered once after each step (their shards changed); with nothing persistent and
    no reuse, every unit is gathered for its forward and again for its backward, on every micro-step."""
    kept, _ = _train(engine_config(3, "none", GAS, stage3_param_persistence_threshold=10**9))
    released, _ = _train(engine_config(3, "none", GAS, stage3_param_persistence_threshold=0,
                                       stage3_max_reuse_distance=0))
    units = kept[-1].gathers
    assert units > 0        # (the first step runs on the units gathered at initialize)
    assert released[-1].gathers >= 2 * GAS * units - GAS   # the last unit of a forward may serve its backward
    assert released[-1].reductions == kept[-1].reductions == GAS * units


def _two_ranks():
    return [s.as_dict() for s in _train(engine_config(2, "none", GAS, ws=2))[0]]


def test_stage2_all_gathers_once_per_group_and_step_at_two_ranks():
    for per_step in run_ranks(_two_ranks, 2):
        assert [s["gathers"] for s in per_step] == [1, 1]
