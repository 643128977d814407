"""DeepSpeed's ``per_head_muon``: the attention heads each Muon matrix's rows split into, read from the model.

DeepSpeed 0.19.8 (``deepspeed/__init__.py``, ``set_optimizer_flags``) orthogonalizes each head's rows of the query,
key and value projections on their own: a projection of shape ``[heads x head_dim, in]`` is seen as ``heads``
matrices of ``head_dim x in``. A parameter is such a projection by its module's name (``q_proj``, ``query``,
``wq``; ``k_proj``/``v_proj``, ``key``/``value``, ``wk``/``wv``), confirmed by its shape against the model config's
head counts (``num_attention_heads`` for queries, ``num_key_value_heads`` for keys and values) and ``head_dim``
(``hidden_size / num_attention_heads`` where the config has none). Fused QKV and output projections stay whole, as
in DeepSpeed. Multi-head latent attention and the linear-attention modules DeepSpeed also reads are not read here:
their configs are refused by name.
"""
from __future__ import annotations

import torch

from zero_offload.config import ConfigError

__all__ = ["attention_heads"]

_QUERY = ("q_proj", "query", "wq")
_KV = ("k_proj", "key", "wk", "v_proj", "value", "wv")
_WHOLE = ("qkv_proj", "query_key_value", "c_attn", "in_proj_qkv", "wqkv", "q_a_proj", "kv_a_proj")
_Q_COUNTS = ("num_attention_heads", "num_heads", "n_heads", "n_head", "attention_heads")
_KV_COUNTS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "kv_n_heads") + _Q_COUNTS


def _first(config, names) -> int | None:
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)


def attention_heads(model: torch.nn.Module, params: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """{parameter name: heads} for the query, key and value projections among ``params`` (name, parameter).

    Raises:
        ConfigError: a model without a config naming its head count, a multi-head latent attention config, or no
            projection confirmed (``per_head_muon`` would do nothing), naming the key.
    """
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    queries = _first(text, _Q_COUNTS) if text is not None else None
    key = "config key 'optimizer.params.per_head_muon' = true"
    if queries is None:
        raise ConfigError(f"{key} needs the model's config to name its attention heads (num_attention_heads); "
                          f"{type(model).__name__} has none")
    if getattr(text, "qk_nope_head_dim", None) is not None:
        raise ConfigError(f"{key}: multi-head latent attention (qk_nope_head_dim in the config) is not read here; "
                          f"unset it to orthogonalize each matrix whole")
    kv = _first(text, _KV_COUNTS) or queries
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // queries
                                                   if getattr(text, "hidden_size", 0) % queries == 0 else None)
    heads = {}
    for name, p in params:
        leaf = name.split(".")[-2].lower() if "." in name else name.lower()
        if head_dim is None or p.dim() != 2 or any(leaf.startswith(w) for w in _WHOLE):
            continue
        count = kv if any(leaf.startswith(k) for k in _KV) else queries if any(leaf.startswith(q) for q in _QUERY) \
            else None
        if count is not None and p.shape[0] == count * head_dim:
            heads[name] = count
    if not heads:
        raise ConfigError(f"{key} but no query, key or value projection of {type(model).__name__} matches its "
                          f"config's heads x head_dim: per-head Newton-Schulz would do nothing; unset it")
    return heads
