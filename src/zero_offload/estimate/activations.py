"""Activation memory of a GPT's forward and backward (Korthikanti et al. 2022, Sec. 4.1), and of a Llama-family
decoder (`zero_offload.estimate.decoder_activations`), for the memory model (`zero_offload.estimate.memory`)."""
from __future__ import annotations

from zero_offload.estimate.decoder_activations import (DecoderShape, SequenceTiles, decoder_activation_bytes,
                                                       decoder_block_bytes, decoder_formula)
from zero_offload.estimate.sequence_activations import decoder_sequence_parallel_extra, local_length
from zero_offload.presets import GPTConfig

__all__ = ["activation_bytes", "activation_formula", "add_decoder_activations", "move_checkpoint_inputs",
           "move_layer_activations", "add_model_activations"]


def activation_formula(checkpointing: bool) -> str:
    per_layer = "s*b*h*(34 + 5*a*s/h) * d/2"
    head = "b*s*V*(d + 8)"
    if checkpointing:
        return f"L * s*b*h*d (block inputs kept) + one block's {per_layer} (recompute) + {head} (logits, fp32 loss)"
    return f"L * {per_layer} + {head} (logits, fp32 loss)"


def activation_bytes(gpt: GPTConfig, micro_batch: int, seq_len: int, dtype_bytes: int,
                     checkpointing: bool | None = None, sequence_parallel: int = 1) -> int:
    """Activation bytes of one forward/backward of a GPT (Korthikanti et al. 2022, Sec. 4.1): per block
    ``s*b*h*(34 + 5*a*s/h)`` bytes of 16-bit activations (scaled by ``d/2`` for fp32); with activation
    checkpointing only each block's input ``s*b*h*d`` is kept, plus one block's activations during its
    recompute; plus the logits ``b*s*V`` in the training dtype and their fp32 loss copy and gradient.
    s = seq_len, b = micro_batch, h = n_embd, a = n_head, V = vocab, L = n_layer, d = dtype bytes. Under Ulysses
    of size P (`zero_offload.estimate.sequence_activations`) each rank's tokens are s/P, its attention scores cover
    the whole sequence for a/P heads, and a block keeps one more copy of its attention output, s/P*b*h*d."""
    s, b, h, a, v, n = seq_len, micro_batch, gpt.n_embd, gpt.n_head, gpt.vocab_size, gpt.n_layer
    ckpt = gpt.activation_checkpointing if checkpointing is None else checkpointing
    local = local_length(s, sequence_parallel)
    block = int(local * b * h * (34 + 5 * a * s / h) * dtype_bytes / 2)
    if sequence_parallel > 1:
        block += local * b * h * dtype_bytes
    logits = b * local * v * (dtype_bytes + 8)
    return (n * local * b * h * dtype_bytes + block if ckpt else n * block) + logits


def add_decoder_activations(est, decoder: DecoderShape, micro_batch: int, seq_len: int | None, dtype_bytes: int,
                            checkpointing: bool | None, sequence_parallel: int = 1,
                            tiles: SequenceTiles | None = None) -> None:
    """Add a Llama-family decoder's ``activations`` (device bytes, `decoder_activation_bytes`) and its formula to
    the `MemoryEstimate` ``est``; without ``seq_len`` only a formula line saying they are not counted (a decoder's
    context length is no training length)."""
    if seq_len is None:
        est.formulas["activations"] = (f"not counted: a {decoder.name} decoder's activations need seq_len "
                                       f"(estimate_memory(..., seq_len=), plan(..., seq_len=))")
        return
    ckpt = decoder.activation_checkpointing if checkpointing is None else checkpointing
    p = sequence_parallel
    local = local_length(seq_len, p)
    est.add("device", "activations", decoder_activation_bytes(decoder, micro_batch, local, dtype_bytes, ckpt, tiles)
            + decoder_sequence_parallel_extra(decoder, micro_batch, seq_len, dtype_bytes, p, ckpt))
    ulysses = f" + Ulysses' copies (P={p}: estimate.sequence_activations)" if p > 1 else ""
    if tiles and tiles.loss:
        ulysses += (f"; the logits and loss in {tiles.loss} tiles (TiledFusedLogitsLoss): the head's 12*b*s*V "
                    f"becomes 12*ceil(b*s/{tiles.loss})*V + 4*V*h + 4*b*s*h")
    if tiles and tiles.mlp:
        ulysses += (f"; each MLP in {tiles.mlp} tiles (TiledMLP): none of its 4d*b*s*I saved, one tile's 6d*c*I "
                    f"in backward + 12*I*h + 4*b*s*h")
    if tiles and tiles.norms:
        ulysses += "; each RMSNorm in tiles (tile_rms_norms): it keeps its input and output, 2d*b*s*h"
    est.formulas["activations"] = (decoder_formula(ckpt) + f" with b={micro_batch}, s={local}, d={dtype_bytes} "
                                   f"({decoder.name}: q={decoder.heads * decoder.head_dim}, "
                                   f"kv={decoder.kv_heads * decoder.head_dim}, I={decoder.intermediate}){ulysses}")


def move_checkpoint_inputs(est, layers: int, tokens: int, hidden: int, dtype_bytes: int, section) -> None:
    """With ``activation_checkpointing.cpu_checkpointing`` (``section``) and checkpointing on: every block input but
    the last and the first ``cpu_checkpointing_device_inputs`` (K), ``(L - 1 - K) * b*s*h*d`` bytes, moves from the
    device's ``activations`` to the host's ``checkpoint_inputs`` (`zero_offload.offload.checkpoint_offload`; inputs
    under ``cpu_checkpointing_min_bytes`` stay). The host side counts the pool's buffers, one per moved input, kept
    between steps; ``est.checkpoint_input_bytes`` is one input's bytes."""
    each = tokens * hidden * dtype_bytes
    if not section.cpu_checkpointing or layers < 2 or each < section.cpu_checkpointing_min_bytes:
        return
    est.checkpoint_input_bytes = each
    kept = section.cpu_checkpointing_device_inputs
    moved = max(0, layers - 1 - kept) * each
    est.add("device", "activations", -moved)
    est.add("host", "checkpoint_inputs", moved)
    est.formulas["checkpoint_inputs"] = (f"(L - 1 - {kept}) * b*s*h*d: every block input but the last and the first "
                                         f"{kept}, in host memory" if kept else
                                         "(L - 1) * b*s*h*d: every block input but the last, in host memory")


def move_layer_activations(est, block_bytes: int, checkpointing: bool, section) -> None:
    """With ``activation_checkpointing.cpu_layers`` N (``section``) and the blocks not checkpointed: N blocks' saved
    activations, ``N * block_bytes``, move from the device's ``activations`` to the host's ``layer_activations``
    (`zero_offload.offload.checkpoint_offload.keep_layers`). A checkpointed block saves only its input, which is
    ``cpu_checkpointing``'s to move, so nothing moves then."""
    if not section.cpu_layers or checkpointing:
        return
    moved = section.cpu_layers * block_bytes
    est.add("device", "activations", -moved)
    est.add("host", "layer_activations", moved)
    est.formulas["layer_activations"] = f"{section.cpu_layers} blocks' saved activations in host memory (cpu_layers)"


def add_model_activations(est, shape, micro_batch: int, seq_len: int | None, d: int, checkpointing: bool | None,
                          sp: int, tiles: SequenceTiles | None, section) -> None:
    """A GPT's or a decoder's ``activations`` (``shape``: `estimate.memory.ModelShape`), with what ``section``
    (``activation_checkpointing``) moves to host memory, under Ulysses of size ``sp`` and with ``tiles``."""
    if shape.gpt is not None:
        s = seq_len or shape.gpt.block_size
        ckpt = shape.gpt.activation_checkpointing if checkpointing is None else checkpointing
        est.add("device", "activations", activation_bytes(shape.gpt, micro_batch, s, d, ckpt, sp))
        est.formulas["activations"] = activation_formula(ckpt) + f" with b={micro_batch}, s={s}, d={d}" + (
            f", s/{sp} tokens per rank (Ulysses)" if sp > 1 else "")
        if ckpt:
            move_checkpoint_inputs(est, shape.gpt.n_layer, micro_batch * s // sp, shape.gpt.n_embd, d, section)
    elif shape.decoder is not None:
        add_decoder_activations(est, shape.decoder, micro_batch, seq_len, d, checkpointing, sp, tiles)
        ckpt = shape.decoder.activation_checkpointing if checkpointing is None else checkpointing
        if seq_len is not None:
            tokens = micro_batch * seq_len // sp
            if ckpt:
                move_checkpoint_inputs(est, shape.decoder.layers, tokens, shape.decoder.hidden, d, section)
            block = decoder_block_bytes(shape.decoder, tokens, d, bool(tiles and tiles.norms))
            if tiles and tiles.mlp:
                block -= 4 * d * tokens * shape.decoder.intermediate     # a tiled MLP saves none of these
            est.block_activation_bytes = 0 if ckpt else block
            move_layer_activations(est, block, ckpt, section)
