"""What the TRL examples share: the DeepSpeed config, their command line, and a tiny Llama with a word-level
tokenizer written to a directory so that they run anywhere with no download (``--model`` takes a Hub id or a
local path instead, to train a real model)."""
import argparse
import os

import torch


# accelerate's zero_stage3_offload_config.json: everything the Trainer's arguments know is "auto".
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                          "stage3_gather_16bit_weights_on_model_save": "auto"},
}


def parse_args(doc: str, out: str, steps: int) -> argparse.Namespace:
    """``--model`` (a Hub id or path; default: a tiny Llama written under ``--out``), ``--out``, ``--steps``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", help="a Hub id or path (default: a tiny Llama written under --out)")
    parser.add_argument("--out", default=out)
    parser.add_argument("--steps", type=int, default=steps)
    args = parser.parse_args()
    args.model = args.model or write_tiny_llama(os.path.join(args.out, "tiny-llama"))
    return args


def common_arguments(args: argparse.Namespace) -> dict:
    """The TrainingArguments every example shares: CPU without a GPU, bf16 with one."""
    import torch
    return dict(output_dir=args.out, max_steps=args.steps, logging_steps=max(1, args.steps // 5), save_strategy="no",
                report_to=[], use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(), disable_tqdm=True)


def write_tiny_llama(path: str, words: int = 200) -> str:
    """Save a 2-layer Llama (hidden 64) and its tokenizer over the words ``w0 .. w{words-1}`` to ``path``."""
    import tokenizers
    import transformers
    specials = ["<pad>", "<eos>", "<bos>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(words)])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                bos_token="<bos>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    fast.save_pretrained(path)
    return path


def sentences(n: int, length: int, seed: int = 0) -> list[str]:
    """``n`` strings of ``length`` words in which word i is followed by word i + 1 (a pattern to learn)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 190, (n,), generator=g).tolist()
    return [" ".join(f"w{(s + k) % 200}" for k in range(length)) for s in starts]
