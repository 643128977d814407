"""`python -m zero_offload ...`, also under `torchrun --nproc_per_node N -m zero_offload train ...`."""
import sys

from zero_offload.cli import main

sys.exit(main())
