"""``deepspeed.launcher.runner``: the ``deepspeed`` command. ``main(args)`` launches as ``zero-offload run deepspeed
...`` does (`zero_offload.launcher`): single node, ranks started by torch's elastic launcher."""
from __future__ import annotations

import os

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS", "main"]

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]


def main(args=None) -> int:
    import sys
    from zero_offload.launcher import launch_deepspeed
    return launch_deepspeed(list(sys.argv[1:] if args is None else args))
