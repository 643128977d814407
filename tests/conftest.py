"""Every test starts from the same random state: a random tensor a test draws without its own generator is
still seeded, so a failure reproduces on any machine (issue 18: tests that hold on any CPU)."""
import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _seeded():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
