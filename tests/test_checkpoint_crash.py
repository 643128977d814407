"""A save killed with SIGKILL at any point leaves the previous checkpoint loadable (and nothing corrupt)."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import zero_offload
from reference import engine_config
from toy_model import make_model

HERE = os.path.dirname(__file__)
SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {here!r})
    import zero_offload
    from reference import engine_config
    from toy_model import batch, make_model
    engine = zero_offload.initialize(make_model(), engine_config(2, "cpu", 1))
    def train(step):
        x, y = batch(step, 2)
        engine.backward(engine(x, y))
        engine.step()
    train(0)
    engine.save_checkpoint({root!r}, tag={first_tag!r})
    torch.save(engine.full_state_dict(), {root!r} + "/../first.pt")
    import os
    os.environ["ZERO_OFFLOAD_KILL_AT"] = {point!r}
    train(1)
    engine.save_checkpoint({root!r}, tag={second_tag!r})
    torch.save(engine.full_state_dict(), {root!r} + "/../second.pt")
""")
POINTS = ["shard_written", "before_manifest", "old_moved_aside", "renamed", "before_latest"]


@pytest.mark.parametrize("same_tag", [False, True], ids=["new-tag", "same-tag"])
@pytest.mark.parametrize("point", POINTS)
def test_killed_save_leaves_a_loadable_checkpoint(tmp_path, point, same_tag):
    if point == "old_moved_aside" and not same_tag:
        pytest.skip("only a re-save of an existing tag moves the old one aside")
    root = tmp_path / "ckpt"
    code = SCRIPT.format(here=HERE, root=str(root), point=point, first_tag="a",
                         second_tag="a" if same_tag else "b")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    engine = zero_offload.initialize(make_model(seed=7), engine_config(2, "cpu", 1))
    engine.load_checkpoint(root)
    loaded = engine.full_state_dict()
    first = torch.load(tmp_path / "first.pt")
    # The interrupted save never reached `latest` (or completed the swap): the first state is what loads,
    # except that a rename already done with `latest` pointing at the same tag exposes the new state.
    expected = [first]
    if same_tag and point in ("renamed", "before_latest"):
        expected = []   # the new data is complete under the same tag: it must be that one
    if expected:
        assert all(torch.equal(loaded[n], first[n]) for n in first)
    else:
        assert any(not torch.equal(loaded[n], first[n]) for n in first)
        assert engine.global_step == 2
