"""``deepspeed.runtime.zero`` (``deepspeed.zero``): ``Init``, ``GatheredParameters``, ``register_external_parameter``
over zero-offload's stage 3, and DeepSpeed's config and offload enums."""
from zero_offload.deepspeed.runtime.zero import partition_parameters
from zero_offload.deepspeed.runtime.zero.partition_parameters import (GatheredParameters, Init, ZeroParamStatus,
                                                                      register_external_parameter,
                                                                      unregister_external_parameter)
from zero_offload.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter", "partition_parameters", "OffloadDeviceEnum", "OffloadStateTypeEnum"]
