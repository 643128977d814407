"""``deepspeed.checkpoint.constants``: the key names of DeepSpeed 0.19.8's (universal) checkpoints."""
__all__ = ["UNIVERSAL_CHECKPOINT_INFO", "UNIVERSAL_CHECKPOINT_VERSION_KEY", "UNIVERSAL_CHECKPOINT_VERSION_VALUE",
           "PADDED_VOCAB_SIZE", "ORIGINAL_VOCAB_SIZE", "VOCABULARY_PARAMETER_PATTERNS",
           "PIPELINE_REPLICATED_PARAMETER_PATTERNS", "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS",
           "TP_REPLICATED_PARAMETER_PATTERNS", "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0"]

UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.4
PADDED_VOCAB_SIZE = "padded_vocab_size"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
PIPELINE_REPLICATED_PARAMETER_PATTERNS = "pipeline_replicated_parameter_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"
