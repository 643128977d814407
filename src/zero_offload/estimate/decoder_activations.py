"""Activation memory of a Llama-family decoder (Hugging Face ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``MistralForCausalLM``) trained with SDPA attention, for the memory model (`zero_offload.estimate.memory`).

Source: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1)
adapted to RMSNorm, rotary embeddings, grouped-query attention and the SwiGLU MLP, every term measured from
autograd's saved tensors (``torch.autograd.graph.saved_tensors_hooks``, unique storages, parameters excluded) of
transformers 5's modelling code under torch 2.13 on the CPU. `decoder_saved_bytes` is that count in closed form
(tests/test_decoder_activations.py holds it to the measured bytes, exactly); `decoder_activation_bytes` adds the
backward's largest transient (held to the process heap's measured peak).

What a block saves (T = b*s tokens, d the training dtype's bytes, q = heads*head_dim, kv = kv_heads*head_dim):
- each of its two RMSNorms: the input in fp32 4*T*h (``.to(float32)``: a copy in 16-bit training, the tensor
  itself in fp32), the reciprocal RMS 4*T, the normalised tensor and the weighted output d*T*h each;
- attention: q and k after rotary, d*T*q and d*T*kv, v d*T*kv (k and v with their ``kv_heads`` only:
  transformers passes ``enable_gqa`` when there is no mask), the output d*T*q, which is also o_proj's input (the
  kernel writes it in the (b, s, heads, head_dim) layout: no copy), and the fp32 logsumexp 4*T*heads.
  On the CPU SDPA runs torch's flash kernel for the CPU; on the GPU (bf16/fp16, head_dim <= 256) the flash
  kernel, which supports GQA and saves the same tensors. Neither saves an s x s matrix; an fp32 run on the GPU may
  fall back to SDPA's math path, which does (not counted);
- MLP: the gate and up outputs, SiLU's output and their product, d*T*I each; residual adds save nothing.
Once per forward: the token ids 8*T, rotary cos and sin 2*s*head_dim*d, the final RMSNorm, and the loss:
transformers' ``ForCausalLMLoss`` upcasts the logits to fp32, and cross_entropy saves the fp32 log-probabilities
4*T*V, the shifted labels 8*T and a 4-byte total weight. The training-dtype logits are not saved (the Trainer
drops the model's outputs before backward). In backward, log_softmax's incoming gradient and its result (fp32,
4*T*V each) are alive beside the saved log-probabilities: the head's peak, 12*T*V in all.

With activation checkpointing (transformers' non-reentrant ``checkpoint`` per block) each block keeps only its
input d*T*h, and the block recomputed in backward saves its tensors again. In a block's backward the MLP's two
input gradients (d*T*I each) are alive beside its saved tensors: the peak when the vocabulary is small.

Not counted: a padding attention mask (with one, transformers repeats k and v to every head and SDPA saves the
b x s x s mask; so does a Mistral sliding window shorter than the sequence), attention dropout, and gradients of
parameters (the engine's buckets and partitions count those).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DecoderShape", "DECODER_TYPES", "decoder_shape", "decoder_saved_bytes", "decoder_activation_bytes",
           "decoder_formula", "decoder_block_bytes", "tiled_head_bytes", "SequenceTiles"]

# transformers' ``model_type`` of the decoders whose blocks are Llama's (RMSNorm, rotary, GQA, SwiGLU); Qwen2's
# q/k/v biases save nothing more.
DECODER_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class DecoderShape:
    """A Llama-family decoder's sizes (from its transformers config).

    Attributes:
        hidden, intermediate, vocab, layers: ``hidden_size``, ``intermediate_size``, ``vocab_size``,
            ``num_hidden_layers``.
        heads, kv_heads, head_dim: ``num_attention_heads``, ``num_key_value_heads`` (default ``heads``),
            ``head_dim`` (default ``hidden // heads``).
        activation_checkpointing: the model's own setting (``is_activation_checkpointing``).
        name: the config's ``model_type``.
    Tied embeddings change no activation byte (the head saves its input, not its weight).
    """
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    activation_checkpointing: bool = False
    name: str = "llama"


def decoder_shape(config, activation_checkpointing: bool = False) -> DecoderShape | None:
    """The `DecoderShape` of a transformers config (a ``PretrainedConfig`` or its ``config.json`` dict) whose
    ``model_type`` is in `DECODER_TYPES`; None for any other model, or one whose sizes are not all integers (its
    activations are not modelled)."""
    get = config.get if isinstance(config, dict) else (lambda k, default=None: getattr(config, k, default))
    sizes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
    if get("model_type") not in DECODER_TYPES or not all(isinstance(get(k), int) for k in sizes):
        return None
    heads = get("num_attention_heads")
    return DecoderShape(hidden=get("hidden_size"), intermediate=get("intermediate_size"), heads=heads,
                        kv_heads=get("num_key_value_heads") or heads,
                        head_dim=get("head_dim") or get("hidden_size") // heads, layers=get("num_hidden_layers"),
                        vocab=get("vocab_size"), activation_checkpointing=bool(activation_checkpointing),
                        name=get("model_type"))


def _norms(m: DecoderShape, t: int, d: int, tiled: bool, count: int, recomputed: bool = False) -> int:
    """Bytes ``count`` RMSNorms save for ``t`` tokens: each its fp32 input, reciprocal RMS, normalised tensor and
    output; tiled (`zero_offload.tiling.tile_rms_norms`), its input and output only. In a recompute the first
    norm's input is the kept block input (nothing new when tiled, or in fp32, where ``.to(float32)`` is the tensor
    itself)."""
    if tiled:
        return count * 2 * d * t * m.hidden - (d * t * m.hidden if recomputed else 0)
    return count * (4 * t * m.hidden + 4 * t + 2 * d * t * m.hidden) - (4 * t * m.hidden if recomputed and d == 4
                                                                         else 0)


def _block(m: DecoderShape, t: int, d: int, norms_tiled: bool = False, recomputed: bool = False) -> int:
    """Bytes one block saves for ``t`` tokens (the module docstring's terms); ``recomputed``: in its recompute
    under checkpointing."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    attention = d * t * (2 * q + 2 * kv) + 4 * t * m.heads
    return _norms(m, t, d, norms_tiled, 2, recomputed) + attention + 4 * d * t * m.intermediate


def decoder_block_bytes(m: DecoderShape, tokens: int, dtype_bytes: int, norms_tiled: bool = False) -> int:
    """Bytes one block saves for ``tokens`` tokens in a dtype of ``dtype_bytes`` (not checkpointed)."""
    return _block(m, tokens, dtype_bytes, norms_tiled)


def _model_level(m: DecoderShape, b: int, s: int, d: int, norms_tiled: bool = False) -> int:
    """Bytes saved once per forward but the log-probabilities: ids, rotary cos/sin, the final RMSNorm, the labels
    and cross_entropy's 4-byte total weight."""
    t = b * s
    return 8 * t + 2 * s * m.head_dim * d + _norms(m, t, d, norms_tiled, 1) + 8 * t + 4


def _checkpointing(m: DecoderShape, checkpointing: bool | None) -> bool:
    return m.activation_checkpointing if checkpointing is None else checkpointing


def decoder_saved_bytes(m: DecoderShape, micro_batch: int, seq_len: int, dtype_bytes: int,
                        checkpointing: bool | None = None, norms_tiled: bool = False, loss_tiled: bool = False) -> int:
    """Bytes autograd saves for one forward of ``micro_batch`` x ``seq_len`` tokens in a dtype of ``dtype_bytes``
    (measured: saved_tensors_hooks, unique storages, no parameters). With activation checkpointing
    (transformers' non-reentrant ``checkpoint`` per block): each block's input d*T*h, plus the saved tensors of
    the one block being recomputed in backward. ``norms_tiled``: the RMSNorms keep only input and output
    (`zero_offload.tiling.tile_rms_norms`). ``loss_tiled``: the logits and loss in tiles (`TiledFusedLogitsLoss`)
    save no fp32 log-probabilities (one tile's exist in backward: `tiled_head_bytes`); the labels are counted as
    the model's own loss shifts them, 8*T (a caller that pads them to shift, as ALST does, saves 8*b more)."""
    t, d = micro_batch * seq_len, dtype_bytes
    outer = _model_level(m, micro_batch, seq_len, d, norms_tiled) + (0 if loss_tiled else 4 * t * m.vocab)
    if _checkpointing(m, checkpointing):
        return m.layers * d * t * m.hidden + outer + _block(m, t, d, norms_tiled, recomputed=True)
    return m.layers * _block(m, t, d, norms_tiled) + outer


@dataclass(frozen=True)
class SequenceTiles:
    """Sequence-tiled compute the run uses (`zero_offload.tiling`): ``loss`` tiles of the logits and loss
    (`TiledFusedLogitsLoss`), ``mlp`` tiles of each block's MLP (`TiledMLP`), ``norms`` tiles of each RMSNorm
    (`tile_rms_norms`); None: whole."""
    loss: int | None = None
    mlp: int | None = None
    norms: int | None = None


def tiled_head_bytes(m: DecoderShape, tokens: int, loss_tiles: int) -> int:
    """The head's backward peak with the logits and loss in ``loss_tiles`` tiles (an fp32 cross entropy per tile):
    one tile's 12*c*V (c = ceil(T / tiles)), plus the fp32 sums the tiles' gradients add into, ``lm_head``'s 4*V*h
    and the hidden states' 4*T*h (measured on the CPU heap within 1 %: tests/test_decoder_activations.py)."""
    tile = -(-tokens // loss_tiles)
    return 12 * tile * m.vocab + 4 * m.vocab * m.hidden + 4 * tokens * m.hidden


def _mlp_backward(m: DecoderShape, t: int, d: int, mlp_tiles: int | None) -> int:
    """A block's MLP backward beside its saved tensors: the two input gradients of the MLP's width, 2*d*T*I; tiled
    (`TiledMLP`), one tile's recompute and gradients 6*d*c*I plus the fp32 sums of its three weights' and its
    input's gradients, 12*I*h + 4*T*h (measured on the CPU heap within 1 %)."""
    if not mlp_tiles:
        return 2 * d * t * m.intermediate
    tile = -(-t // mlp_tiles)
    return 6 * d * tile * m.intermediate + 12 * m.intermediate * m.hidden + 4 * t * m.hidden


def decoder_activation_bytes(m: DecoderShape, micro_batch: int, seq_len: int, dtype_bytes: int,
                             checkpointing: bool | None = None, tiles: SequenceTiles | None = None) -> int:
    """Peak activation bytes of one forward and backward (the memory model's ``activations``), at whichever of two
    points of backward is higher (measured on the CPU heap: tests/test_decoder_activations.py):
    - the head's backward, first: the fp32 log-probabilities and log_softmax's two fp32 gradients, 12*T*V, beside
      everything the blocks saved;
    - the last block's MLP backward, once the head is freed: the block's saved tensors (with checkpointing, as its
      recompute saves them) and two gradients of the MLP's width, 2*d*T*I, beside them.
    For a language model's vocabulary (V >> I) the head's is the peak. With sequence-tiled compute (``tiles``) the
    head holds one tile (`tiled_head_bytes`), and a tiled MLP saves none of its 4*d*T*I intermediates: they exist
    for one tile in its backward (`_mlp_backward`)."""
    tiles = tiles or SequenceTiles()
    t, d, lean = micro_batch * seq_len, dtype_bytes, bool(tiles.norms)
    head = 12 * t * m.vocab if not tiles.loss else tiled_head_bytes(m, t, tiles.loss)
    mlp_backward = _mlp_backward(m, t, d, tiles.mlp)
    untiled_mlp = 4 * d * t * m.intermediate if tiles.mlp else 0     # what a tiled MLP does not save
    outer = _model_level(m, micro_batch, seq_len, d, lean)
    if _checkpointing(m, checkpointing):
        return (m.layers * d * t * m.hidden + outer
                + max(head, _block(m, t, d, lean, recomputed=True) - untiled_mlp + mlp_backward))
    return m.layers * (_block(m, t, d, lean) - untiled_mlp) + outer + max(head, mlp_backward)


def decoder_formula(checkpointing: bool) -> str:
    """`decoder_activation_bytes` as a formula: b micro-batch, s sequence, h hidden, q = heads*head_dim,
    kv = kv_heads*head_dim, a heads, I intermediate, V vocabulary, L layers, d the dtype's bytes."""
    block = "b*s*(8h + 8 + 4d*h + 2d*(q + kv) + 4a + 4d*I)"
    model = "b*s*(4h + 2d*h + 20) + 2*s*head_dim*d + 4 (ids, rotary, final norm, labels)"
    head = "12*b*s*V (fp32 log-probs and log_softmax's two gradients)"
    if checkpointing:
        return (f"L*b*s*h*d (block inputs) + {model} + max({head}, one block's {block} (recompute; fp32: less "
                f"4*b*s*h, its first norm saves the kept input) + 2d*b*s*I (MLP gradients))")
    return f"L * {block} + {model} + max({head}, 2d*b*s*I (MLP gradients))"
