"""``UlyssesSPAttentionHF.register_with_transformers``: Ulysses under a Hugging Face model with no change to its code.

Mirrors DeepSpeed 0.19.8: the groups are made (`zero_offload.sequence.groups`), and the entry of
``transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS`` for the model's own attention implementation is replaced by
the Ulysses wrapper, so every code path transformers keys on that implementation's name still runs; only the call
into attention is intercepted. The returned ``mpu`` goes to ``deepspeed.initialize(mpu=...)``.
`unregister_from_transformers` puts the original function back (DeepSpeed added it after 0.19.8).
"""
from __future__ import annotations

from zero_offload.sequence import groups as sp_groups

__all__ = ["register_with_transformers", "unregister_from_transformers", "registered"]

UNSUPPORTED = ("eager", "paged|eager")     # they need a dense 4-D mask, which the wrapper drops
_originals: dict[str, object] = {}


def _model_config(model_name_or_path, core_attn_implementation: str):
    from transformers import AutoConfig, PreTrainedModel
    loaded = hasattr(model_name_or_path, "config") or isinstance(model_name_or_path, PreTrainedModel)
    config = model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
    used = getattr(config, "_attn_implementation", None) if loaded else None
    if used is not None and used != core_attn_implementation:
        raise ValueError(f"core_attn_implementation={core_attn_implementation!r} does not match the model's "
                         f"attn_implementation={used!r}; set both to the same value so that the sequence-parallel "
                         f"wrapper intercepts the attention the model runs")
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def register_with_transformers(cls, model_name_or_path, core_attn_implementation: str, sequence_parallel_size: int,
                               micro_batch_size: int, seq_length: int | None = None,
                               seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                               max_length: int | None = None):
    """Register Ulysses for ``core_attn_implementation`` and return the `SequenceParallelGroups` (the ``mpu``), or
    None when ``sequence_parallel_size`` is 1 (nothing is registered).

    ``model_name_or_path``: a loaded model (or anything with a ``config``, a PEFT model) or a name/path for
    ``AutoConfig``. ``seq_length`` (the global length) is needed unless ``seq_length_is_variable``; ``max_length`` is
    its deprecated name.

    Raises:
        ValueError: ``eager`` attention, an implementation transformers does not know, one that differs from the
            loaded model's, no ``seq_length`` with ``seq_length_is_variable=False``, head counts that do not divide
            the size.
        SequenceParallelError: a size that does not divide the world size.
    """
    if sequence_parallel_size == 1:
        return None
    seq_length = seq_length if seq_length is not None else max_length
    if not seq_length_is_variable and seq_length is None:
        raise ValueError("register_with_transformers: pass seq_length (the global sequence length of every batch) "
                         "or seq_length_is_variable=True")
    if core_attn_implementation in UNSUPPORTED:
        raise ValueError(f"core_attn_implementation={core_attn_implementation!r} is not supported by Ulysses "
                         f"sequence parallelism: it needs a dense 4-D attention mask; use 'sdpa', a flash "
                         f"attention variant or 'flex_attention'")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"core_attn_implementation={core_attn_implementation!r} is not an attention implementation "
                         f"transformers knows; choose from {list(ALL_ATTENTION_FUNCTIONS.valid_keys())}")
    arch = _model_config(model_name_or_path, core_attn_implementation)
    mpu = sp_groups.initialize(sequence_parallel_size, key="sequence_parallel_size")
    core = _originals.get(core_attn_implementation, ALL_ATTENTION_FUNCTIONS[core_attn_implementation])
    heads = arch.num_attention_heads
    local = None if seq_length_is_variable else seq_length // sequence_parallel_size
    uattn = cls(attn=core, batch_size=micro_batch_size, attn_head_count=heads,
                attn_head_size=getattr(arch, "head_dim", None) or arch.hidden_size // heads,
                kv_head_count=getattr(arch, "num_key_value_heads", None) or heads,
                num_hidden_layers=arch.num_hidden_layers, process_group=mpu.group,
                seq_length_is_variable=seq_length_is_variable, local_seq_length=local,
                global_seq_length=None if seq_length_is_variable else seq_length, disable_in_eval=disable_in_eval,
                world_size=mpu.size)
    uattn.core_attn_implementation = core_attn_implementation

    def ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):
        return uattn(module, query, key, value, attention_mask, *args, **kwargs)

    _originals.setdefault(core_attn_implementation, core)
    ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_attention
    return mpu


def unregister_from_transformers(core_attn_implementation: str) -> None:
    """Put back the attention function `register_with_transformers` replaced and forget the groups."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if core_attn_implementation in _originals:
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = _originals.pop(core_attn_implementation)
    sp_groups.release()


def registered() -> set[str]:
    """The attention implementations Ulysses wraps now."""
    return set(_originals)
