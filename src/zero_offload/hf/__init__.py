"""Hugging Face ``transformers.Trainer`` on zero-offload: ``zero_offload.hf.Trainer(..., ds_config=...)``.

    from zero_offload.hf import Trainer
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds, ds_config="ds_config.json")
    trainer.train(); trainer.save_model("out")        # from_pretrained("out") loads it

At stage 3, ``with sharded_from_pretrained(): model = AutoModelForCausalLM.from_pretrained(path)`` reads only
this rank's slice of each tensor (`pretrained`); the Trainer does so itself for a model name at stage 3.

Needs the ``hf`` extra (``pip install 'zero-offload[hf]'``: transformers 5 and accelerate); ``import
zero_offload`` does not import this package. See docs/hf.md.
"""
try:
    import transformers  # noqa: F401
except ImportError as e:    # pragma: no cover - exercised only where transformers is missing
    raise ImportError("zero_offload.hf needs transformers and accelerate: pip install 'zero-offload[hf]'") from e

from zero_offload.hf.config_fill import fill_from_training_args, load_ds_config
from zero_offload.hf.pretrained import sharded_from_pretrained
from zero_offload.hf.trainer import Trainer, ZeroOffloadTrainerMixin

__all__ = ["Trainer", "ZeroOffloadTrainerMixin", "fill_from_training_args", "load_ds_config",
           "sharded_from_pretrained"]
