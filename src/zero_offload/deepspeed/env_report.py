"""``deepspeed.env_report``: what stands in for DeepSpeed here, and the versions it runs on."""
from __future__ import annotations

__all__ = ["main", "cli_main"]


def main(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False) -> None:
    import platform

    import torch

    import zero_offload
    from zero_offload_stand_in import deepspeed_version
    print(f"DeepSpeed stand-in ...... zero-offload {zero_offload.__version__} (DeepSpeed {deepspeed_version()})")
    print(f"torch version ........... {torch.__version__}")
    print(f"torch cuda available .... {torch.cuda.is_available()}")
    print(f"python .................. {platform.python_version()}")


def cli_main() -> None:
    main()
