"""Fine-tune a small GPT-2 with transformers' Trainer on zero-offload: ZeRO stage 3, optimizer and parameters
offloaded to the host, no DeepSpeed installed. The model is built from a config (nothing is downloaded), trained
on a tiny synthetic corpus, saved with save_model and loaded back with from_pretrained.

    python examples/hf_trainer_finetune.py --out /tmp/gpt2-zero --steps 20
"""
import argparse

import torch
import transformers

from zero_offload.hf import Trainer

DS_CONFIG = {   # a DeepSpeed JSON as users write it for the Trainer: "auto" is filled from TrainingArguments
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    "bf16": {"enabled": "auto"},
}


class Corpus(torch.utils.data.Dataset):
    """Sequences of a repeating pattern the model can learn: token t is followed by t + 1 (mod vocab)."""

    def __init__(self, n: int, seq: int, vocab: int):
        starts = torch.arange(n) % vocab
        self.ids = (starts[:, None] + torch.arange(seq)[None, :]) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpt2-zero-offload")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=64, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    training_args = transformers.TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, weight_decay=0.01, warmup_steps=2, logging_steps=max(1, args.steps // 5),
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=Corpus(256, 16, 64), ds_config=DS_CONFIG)
    result = trainer.train()
    trainer.save_model(args.out)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(args.out)
    batch = Corpus(4, 16, 64)[1]["input_ids"][None]
    with torch.no_grad():
        loss = reloaded(input_ids=batch, labels=batch).loss.item()
    print(f"trained {result.global_step} steps, train loss {result.training_loss:.3f}; "
          f"reloaded from {args.out}: loss {loss:.3f}")


if __name__ == "__main__":
    main()
