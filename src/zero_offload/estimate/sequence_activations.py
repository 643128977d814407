"""Activation bytes per rank under Ulysses sequence parallelism (`zero_offload.sequence`), for the memory model.

A rank of a group of ``P`` holds ``s / P`` positions, so everything a decoder saves per token is counted at the
local length (`decoder_saved_bytes(m, b, s / P, d)`). What Ulysses adds, measured from autograd's saved tensors
under torch 2.13 and transformers 5 on the CPU (tests/test_ulysses.py holds it to the byte):
- per block, one more tensor of the attention output's size, d*b*(s/P)*q: the kernel's output (whole sequence,
  ``heads / P`` heads) and ``o_proj``'s input (back on the sequence split) are two tensors, where without Ulysses
  they are one;
- per block, when ``kv_heads < P``: the replicated keys and values, each rank holding one head over the whole
  sequence, 2*d*b*s*head_dim*(1 - kv_heads / P) more than its share;
- once: ``position_ids`` are passed (Ulysses needs them), so the rotary cos and sin are per sample,
  2*(b - 1)*(s/P)*head_dim*d more, and the ids themselves 8*b*(s/P) are saved.
With activation checkpointing the per-block terms count once (the block being recomputed).

For the GPT (Korthikanti et al. 2022's formula, `activations.activation_bytes`) the linear terms run at ``s / P`` and
the attention scores over the whole sequence for ``a / P`` heads, ``5 * (a / P) * s^2 * b``, plus the same output copy.
"""
from __future__ import annotations

from zero_offload.estimate.decoder_activations import DecoderShape

__all__ = ["decoder_sequence_parallel_extra", "local_length"]


def local_length(seq_len: int, sequence_parallel: int) -> int:
    """The positions one rank holds.

    Raises:
        ValueError: ``seq_len`` is not divisible by ``sequence_parallel``.
    """
    if seq_len % sequence_parallel:
        raise ValueError(f"seq_len {seq_len} is not divisible by sequence_parallel_size {sequence_parallel}")
    return seq_len // sequence_parallel


def decoder_sequence_parallel_extra(m: DecoderShape, micro_batch: int, seq_len: int, dtype_bytes: int,
                                    sequence_parallel: int, checkpointing: bool) -> int:
    """The bytes a rank saves under Ulysses of size ``sequence_parallel`` beyond `decoder_saved_bytes` at its local
    length (the module docstring's terms); 0 at size 1."""
    p = sequence_parallel
    if p == 1:
        return 0
    b, d, local = micro_batch, dtype_bytes, local_length(seq_len, p)
    block = d * b * local * m.heads * m.head_dim
    if m.kv_heads < p:
        block += round(2 * d * b * seq_len * m.head_dim * (1 - m.kv_heads / p))
    once = 2 * (b - 1) * local * m.head_dim * d + 8 * b * local
    return (1 if checkpointing else m.layers) * block + once
