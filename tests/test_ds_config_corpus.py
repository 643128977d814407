"""Every real DeepSpeed config in tests/data/ds_configs loads, or is refused for a listed reason.

The corpus holds configs as they appear in DeepSpeed's docs and tutorials, DeepSpeedExamples (incl.
DeepSpeed-Chat), transformers' and accelerate's DeepSpeed templates. Hugging Face ``"auto"`` values are
resolved with what transformers' Trainer would supply (`TRAINER_VALUES`) and a model with a hidden size.
"""
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from zero_offload import Config, ConfigError
from zero_offload.config import AutoContext

CORPUS = Path(__file__).parent / "data" / "ds_configs"
FILES = sorted(p.name for p in CORPUS.iterdir())

# Refused, each for a setting docs/configs.md lists as not built (or one DeepSpeed 0.19.8 refuses itself).
REFUSED = {
    "ds_docs_onebit_adam.json": "'OneBitAdam' is accepted by DeepSpeed but not implemented",
    "ds_removed_sparse_attention.json": "as DeepSpeed 0.19.8 refuses it",
    "ds_megatron_gpt2_zero2.json": "max_grad_norm' is not an optimizer parameter (DeepSpeed refuses it too)",
}
# What transformers' Trainer fills "auto" with (TrainingArguments defaults, 100 steps).
TRAINER_VALUES = {
    "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    "optimizer.params.lr": 5e-5, "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_num_steps": 1,
    "scheduler.params.total_num_steps": 100, "steps_per_print": 100,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": True,
}
MODEL = SimpleNamespace(config=SimpleNamespace(hidden_size=64))


def test_corpus_is_representative():
    assert len(FILES) >= 30
    assert any(f.endswith(".hjson") for f in FILES)


@pytest.mark.parametrize("name", FILES)
def test_real_config_loads(name):
    ctx = AutoContext(world_size=2, model=MODEL, values=TRAINER_VALUES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name in REFUSED:
            with pytest.raises(ConfigError) as e:
                Config.load(CORPUS / name, auto=ctx)
            assert REFUSED[name] in str(e.value)
            return
        cfg = Config.load(CORPUS / name, auto=ctx)
    if cfg.train_batch_size or cfg.train_micro_batch_size_per_gpu:
        cfg.batch_sizes(1 if name.startswith("dschat") or "cifar" in name else 2)


def test_auto_resolution_follows_transformers():
    cfg = Config.load(CORPUS / "transformers_ds_config_zero3.json",
                      auto=AutoContext(world_size=2, model=MODEL, values=TRAINER_VALUES))
    zc = cfg.zero_optimization
    assert (zc.reduce_bucket_size, zc.stage3_prefetch_bucket_size, zc.stage3_param_persistence_threshold) == \
        (64 * 64, int(0.9 * 64 * 64), 640)
    assert cfg.precision == "fp32"            # fp16/bf16 "auto" on a CPU device
    assert cfg.scheduler.params.warmup_min_lr == 0.0 and cfg.scheduler.params.warmup_max_lr == 5e-5
    assert cfg.batch_sizes(2).train_batch_size == 16


def test_auto_without_a_source_names_the_key_and_argument():
    with pytest.raises(ConfigError, match="'optimizer.params.lr' = 'auto'.*TrainingArguments.learning_rate"):
        Config.load({"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
                    auto=AutoContext(model=MODEL))
    with pytest.raises(ConfigError, match="'train_batch_size' = 'auto' cannot be resolved"):
        Config.load(CORPUS / "transformers_ds_config_zero2.json", auto=AutoContext(model=MODEL))
    with pytest.raises(ConfigError, match="'zero_optimization.reduce_bucket_size' = 'auto' needs the model's "
                                          "hidden size"):
        Config.load({"train_batch_size": 2, "zero_optimization": {"reduce_bucket_size": "auto"}})
    with pytest.raises(ConfigError, match="'train_micro_batch_size_per_gpu' = 'auto' cannot be resolved"):
        Config.load({"train_micro_batch_size_per_gpu": "auto"})
