"""Small TRL runs, plain or on zero-offload (the mixin with ``ds_config``), for the TRL tests and their torchrun
script: a tiny Llama and a word-level tokenizer built here and saved to a directory (nothing downloaded), the
datasets each trainer reads, fp32, and TRL's defaults otherwise (gradient checkpointing on)."""
from __future__ import annotations

import os

import torch

from hf_trainer_runs import weights_of

VOCAB_WORDS = 200          # plus the special tokens: a vocabulary of a few hundred
SPECIAL = ["<pad>", "<eos>", "<bos>"]
LR = 1e-3


def word(i: int) -> str:
    return f"w{i}"


def tokenizer():
    """A ``PreTrainedTokenizerFast`` over ``w0 .. w199`` and the special tokens, whitespace-split, with a chat
    template (TRL's conversational datasets need one)."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIAL + [word(i) for i in range(VOCAB_WORDS)])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}{% endif %}")
    return fast


def save_model_dir(path, kind: str = "causal", seed: int = 0, hidden: int = 32, layers: int = 2) -> str:
    """Write a tiny Llama (``kind``: 'causal' or 'reward', a one-label sequence classifier) and the tokenizer
    to ``path``; returns it. TRL trainers given the path load both from there, as from the Hub."""
    import transformers as tf
    tok = tokenizer()
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id, num_labels=1)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg) if kind == "causal" else tf.LlamaForSequenceClassification(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _words(g: torch.Generator, n: int) -> str:
    return " ".join(word(int(i)) for i in torch.randint(0, VOCAB_WORDS, (n,), generator=g))


def dataset(kind: str, n: int = 8, seed: int = 0):
    """``n`` rows of the columns ``kind`` reads: 'text' (language modelling), 'prompt_completion',
    'preference' (prompt, chosen, rejected), 'prompt' (GRPO/RLOO), 'reward' (chosen, rejected)."""
    import datasets
    g = torch.Generator().manual_seed(seed)
    if kind == "text":
        rows = {"text": [_words(g, 6 + i % 5) for i in range(n)]}
    elif kind == "prompt_completion":
        rows = {"prompt": [_words(g, 3 + i % 3) for i in range(n)],
                "completion": [_words(g, 4 + i % 2) for i in range(n)]}
    elif kind == "preference":
        rows = {"prompt": [_words(g, 3 + i % 2) for i in range(n)],
                "chosen": [_words(g, 4) for _ in range(n)], "rejected": [_words(g, 3 + i % 3) for i in range(n)]}
    elif kind == "prompt":
        rows = {"prompt": [_words(g, 3 + i % 2) for i in range(n)]}
    elif kind == "reward":
        rows = {"chosen": [_words(g, 5) for _ in range(n)], "rejected": [_words(g, 4 + i % 2) for i in range(n)]}
    else:
        raise ValueError(kind)
    return datasets.Dataset.from_dict(rows)


def reward_even_words(completions, **kwargs) -> list[float]:
    """A rule reward: the share of a completion's words with an even index (deterministic, cheap)."""
    out = []
    for c in completions:
        ws = c.split() if isinstance(c, str) else []
        out.append(sum(int(w[1:]) % 2 == 0 for w in ws if w[1:].isdigit()) / max(1, len(ws)))
    return out


COMMON = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, learning_rate=LR,
              logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True, disable_tqdm=True,
              dataloader_num_workers=0, bf16=False, max_grad_norm=1.0)


def zero_config(stage: int, offload: bool = True) -> dict:
    """A config as accelerate's templates write it: batch sizes, accumulation and clipping ``"auto"``, no
    precision and no optimizer section (the Trainer's AdamW is taken)."""
    zc: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload and stage >= 1:
        zc["offload_optimizer"] = {"device": "cpu"}
    if offload and stage == 3:
        zc["offload_param"] = {"device": "cpu"}
        zc["stage3_gather_16bit_weights_on_model_save"] = "auto"
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_optimization": zc}


def trainer_class(name: str, zero: bool):
    import trl

    from zero_offload.hf import ZeroOffloadTrainerMixin
    base = {"sft": trl.SFTTrainer, "dpo": trl.DPOTrainer, "grpo": trl.GRPOTrainer, "rloo": trl.RLOOTrainer,
            "reward": trl.RewardTrainer}[name]
    if not zero:
        return base
    return type(f"ZeroOffload{base.__name__}", (ZeroOffloadTrainerMixin, base), {})


def trl_config(name: str, out_dir, overrides: dict):
    import trl
    cls = {"sft": trl.SFTConfig, "dpo": trl.DPOConfig, "grpo": trl.GRPOConfig, "rloo": trl.RLOOConfig,
           "reward": trl.RewardConfig}[name]
    kw = dict(COMMON, output_dir=str(out_dir))
    if name in ("grpo", "rloo"):
        kw.update(num_generations=2, max_completion_length=4, generation_batch_size=4, beta=0.1,
                  per_device_train_batch_size=2)
    kw.update(overrides)
    return cls(**kw)


# variant -> (trainer, run keywords): what item 1 of the TRL issue names, each with TRL's defaults otherwise.
VARIANTS = {
    "sft": ("sft", {}),
    "sft-packing": ("sft", {"packing": True, "max_length": 16}),
    "sft-padding-free": ("sft", {"padding_free": True, "max_length": None}),
    "sft-completion-only": ("sft", {"data": "prompt_completion"}),
    "sft-lora": ("sft", {"lora": True}),
    "dpo": ("dpo", {}),
    "dpo-ref-model": ("dpo", {"ref_model": True}),
    "grpo": ("grpo", {}),
    "rloo": ("rloo", {}),
    "reward": ("reward", {}),
}


def run_variant(variant: str, model_dirs: dict, out_dir, ds_config: dict | None = None, **overrides):
    """`run` of one of `VARIANTS`; ``model_dirs``: {'causal': path, 'reward': path}."""
    name, kw = VARIANTS[variant]
    kw = dict(kw, **overrides)
    if kw.pop("lora", False):
        from peft import LoraConfig
        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return run(name, model_dirs["reward" if name == "reward" else "causal"], out_dir, ds_config, **kw)


def initial_weights(model_dir: str, kind: str = "causal") -> dict:
    """{name: fp32 tensor} of the saved model, before training."""
    import transformers as tf
    cls = tf.AutoModelForCausalLM if kind == "causal" else tf.AutoModelForSequenceClassification
    return {n: p.detach().float().clone() for n, p in cls.from_pretrained(model_dir).named_parameters()}


def run(name: str, model_dir: str, out_dir, ds_config: dict | None = None, data: str | None = None,
        peft_config=None, ref_model: bool = False, **overrides):
    """Train TRL's ``name`` trainer ('sft', 'dpo', 'grpo', 'rloo', 'reward') on the model at ``model_dir``, plain
    (``ds_config`` None) or on zero-offload; returns (trainer, per-step losses, {name: fp32 CPU weight})."""
    import transformers as tf
    args = trl_config(name, out_dir, overrides)
    default_data = {"sft": "text", "dpo": "preference", "grpo": "prompt", "rloo": "prompt", "reward": "reward"}
    kw: dict = dict(args=args, train_dataset=dataset(data or default_data[name]),
                    processing_class=tf.AutoTokenizer.from_pretrained(model_dir))
    if name in ("grpo", "rloo"):
        kw["reward_funcs"] = reward_even_words
    if name == "dpo" and ref_model:
        kw["ref_model"] = tf.AutoModelForCausalLM.from_pretrained(model_dir)
    if peft_config is not None:
        kw["peft_config"] = peft_config
    if ds_config is not None:
        kw["ds_config"] = ds_config
    torch.manual_seed(0)
    trainer = trainer_class(name, ds_config is not None)(model=model_dir, **kw)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses, weights_of(trainer)


def _base_name(name: str) -> str:
    """A PEFT model's name for a base weight, as the plain model names it."""
    return name.replace("base_model.model.", "").replace(".base_layer", "")


def max_weight_diff(a: dict, b: dict) -> float:
    """The largest difference over the names both hold (PEFT names compared with the plain model's)."""
    a = {_base_name(k): v for k, v in a.items()}
    b = {_base_name(k): v for k, v in b.items()}
    common = set(a) & set(b)
    assert common, (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in common)


if __name__ == "__main__":       # a quick look: python tests/trl_runs.py sft 3
    import sys
    import tempfile
    name, stage = sys.argv[1], int(sys.argv[2])
    with tempfile.TemporaryDirectory() as d:
        md = save_model_dir(os.path.join(d, "m"), "reward" if name == "reward" else "causal")
        _, ref_losses, ref_w = run(name, md, os.path.join(d, "ref"))
        _, losses, w = run(name, md, os.path.join(d, "zo"), zero_config(stage))
        print("ref", ref_losses, "\nzo ", losses, "\nweight diff", max_weight_diff(ref_w, w))
