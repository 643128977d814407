"""Every test starts from the same random state: a random tensor a test draws without its own generator is
still seeded, so a failure reproduces on any machine (issue 18: tests that hold on any CPU). A process group a
test leaves in the pytest process (``deepspeed.initialize`` creates a one-rank group, as DeepSpeed's does) is
destroyed after it, so the ranks `dist_utils.run_ranks` forks later start without one. The planner reads no
calibration file a developer wrote with ``zero-offload calibrate`` (its tests assume the built-in figures), and
keeps the step model's recordings in a directory of the run's own."""
import os
import random
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist

os.environ["ZERO_OFFLOAD_CALIBRATION"] = os.path.join(os.path.dirname(__file__), "no-such-calibration.json")
# The step model's recordings go to a directory of this run (shared by its subprocesses), never the user's cache.
_RECORDINGS = tempfile.TemporaryDirectory(prefix="zo-recordings-")
os.environ["ZERO_OFFLOAD_RECORDINGS_DIR"] = _RECORDINGS.name


@pytest.fixture(autouse=True)
def _seeded():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
