"""Tiny Hugging Face models built from configs (random init, no download) and their training batches."""
from __future__ import annotations

import torch

VOCAB, SEQ = 64, 8


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny ``kind`` model ('gpt2', 'llama', 'bert', 't5'), initialised from ``seed``; dropout off."""
    import transformers as tf
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = tf.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "bert":
        cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        model = tf.BertForMaskedLM(cfg)
    elif kind == "t5":
        cfg = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                          dropout_rate=0.0, decoder_start_token_id=0)
        model = tf.T5ForConditionalGeneration(cfg)
    else:
        raise ValueError(kind)
    return model.train()


def batch(kind: str, step: int, size: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(1, VOCAB, (size, SEQ), generator=g)
    labels = torch.randint(1, VOCAB, (size, SEQ), generator=g)
    if kind == "t5":
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": ids if kind in ("gpt2", "llama") else labels}
