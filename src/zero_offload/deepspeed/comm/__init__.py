"""``deepspeed.comm``: DeepSpeed's communication API (``import deepspeed.comm as dist``), over torch.distributed."""
from zero_offload.deepspeed.comm.comm import *  # noqa: F401,F403
from zero_offload.deepspeed.comm.comm import __all__  # noqa: F401
