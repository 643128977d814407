"""Bad input gets an error that names the key, value or file at fault; DeepSpeed-only keys warn once."""
import json
import warnings

import pytest
import torch

import zero_offload
from zero_offload import Config, ConfigError
from toy_model import make_model

BASE = {"train_batch_size": 4}
WITH_OPTIMIZER = {**BASE, "optimizer": {"type": "AdamW"}}   # initialize needs one


def _load(**extra):
    return Config.load({**BASE, **extra})


@pytest.mark.parametrize("extra,message", [
    ({"zero_optimisation": {}}, "unknown config key 'zero_optimisation'; did you mean 'zero_optimization'"),
    ({"zero_optimization": {"stag": 2}}, "'zero_optimization.stag'; did you mean 'stage'"),
    ({"fp16": {"enabled": True, "loss_scale_windw": 10}}, "did you mean 'loss_scale_window'"),
    ({"zero_optimization": {"stage": "two"}}, "'zero_optimization.stage': got 'two', expected an integer"),
    ({"zero_optimization": {"stage": 5}}, "'zero_optimization.stage': got 5, must be <= 3"),
    ({"gradient_clipping": -1}, "'gradient_clipping': got -1.0, must be >= 0"),
    ({"fp16": {"enabled": "yes"}}, "'fp16.enabled': got 'yes', expected true/false"),
    ({"optimizer": {"type": "Sgdx"}}, "'optimizer.type': got 'Sgdx', allowed: 'Adam', 'AdamW', 'Lamb' or a"),
    ({"optimizer": {"type": "OneBitLamb"}}, "'optimizer.type': 'OneBitLamb' is accepted by DeepSpeed but not"),
    ({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}}, "'optimizer.params.betas' for torch.optim.SGD"),
    ({"optimizer": {"params": {"max_grad_norm": 1.0}}}, "use the top-level 'gradient_clipping'"),
    ({"optimizer": {"params": {"betas": [0.9]}}}, "'optimizer.params.betas'"),
    ({"optimizer": {"params": {"betas": [0.9, 1.5]}}}, "'optimizer.params.betas[1]': got 1.5"),
    ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, "contradicts"),
    ({"scheduler": {"type": "Cyclic"}}, "'scheduler.type': got 'Cyclic'"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}},
     "'scheduler.params.cycle_min_lr' is required"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "'scheduler.params.total_num_steps' is required"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}}}, "did you mean 'warmup_num_steps'"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "'fp16.enabled' and 'bf16.enabled'"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "'zero_optimization.offload_param.nvme_path' is required with 'zero_optimization.offload_param.device' = 'nvme'"),
    ({"gradient_allreduce_op": "sum"}, "'gradient_allreduce_op': 'sum' is accepted by DeepSpeed but not implemented"),
    ({"amp": {"enabled": True}}, "'amp' is refused, as DeepSpeed 0.19.8 refuses it"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "master weights are always fp32"),
    ({"tensor_parallel": {"autotp_size": 2}}, "'tensor_parallel.autotp_size': 2 is accepted by DeepSpeed"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, "'zero_optimization.reduce_bucket_size': got 0, must be >= 1"),
    ({"zero_optimization": {"stage3_param_persistence_threshold": -1}},
     "'zero_optimization.stage3_param_persistence_threshold': got -1, must be >= 0"),
])
def test_bad_value_names_the_key(extra, message):
    with pytest.raises(ConfigError) as e:
        _load(**extra)
    assert message in str(e.value)


def test_deepspeed_only_keys_warn_once_and_are_accepted():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg = _load(wall_clock_breakdown=True,
                    zero_optimization={"stage": 2, "round_robin_gradients": True,
                                       "offload_optimizer": {"device": "cpu", "max_in_cpu": 1}})
    messages = [str(x.message) for x in w]
    assert sum("'wall_clock_breakdown' has no effect" in m for m in messages) == 1
    assert sum("'zero_optimization.round_robin_gradients'" in m for m in messages) == 1
    assert sum("'zero_optimization.offload_optimizer.max_in_cpu'" in m for m in messages) == 1
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_seed_config_from_the_tutorial_loads():
    cfg = Config.load({"train_batch_size": 10, "fp16": {"enabled": True},
                       "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                             "contiguous_gradients": True, "overlap_comm": True}})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu" and cfg.precision == "fp16"


@pytest.mark.parametrize("sizes,world,message", [
    ({"train_batch_size": 9, "train_micro_batch_size_per_gpu": 2}, 2, "do not divide"),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 3}, 2, "do not divide"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 2,
     "inconsistent"),
    ({"gradient_accumulation_steps": 2}, 1, "needs 'train_batch_size' or 'train_micro_batch_size_per_gpu'"),
])
def test_batch_sizes_that_do_not_divide(sizes, world, message):
    with pytest.raises(ConfigError) as e:
        Config.load(sizes).batch_sizes(world)
    text = str(e.value)
    assert message in text
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                f"world size={world}"):
        assert key in text


@pytest.mark.parametrize("sizes,expected", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, (16, 2, 4)),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, (16, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, (12, 3, 2)),
    ({"train_batch_size": 8}, (8, 4, 1)),
])
def test_batch_arithmetic_as_deepspeed(sizes, expected):
    b = Config.load(sizes).batch_sizes(2)
    assert (b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps) == expected


def test_json_file_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="nope.json' cannot be read"):
        Config.load(str(missing))
    broken = tmp_path / "broken.json"
    broken.write_text("{\"train_batch_size\": 4,")
    with pytest.raises(ConfigError, match="broken.json' is not valid JSON"):
        Config.load(broken)
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"train_batch_size": 4, "zero_optimization": {"stage": 1}}))
    assert Config.load(good).zero_optimization.stage == 1


def test_model_without_trainable_parameters():
    model = make_model()
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        zero_offload.initialize(model, WITH_OPTIMIZER)


def test_foreign_parameter_in_groups():
    with pytest.raises(ValueError, match="not in the model"):
        zero_offload.initialize(make_model(), WITH_OPTIMIZER, model_parameters=[torch.nn.Parameter(torch.ones(3))])


def test_non_scalar_loss():
    engine = zero_offload.initialize(make_model(), WITH_OPTIMIZER)
    with pytest.raises(ValueError, match="scalar loss"):
        engine.backward(torch.ones(3, requires_grad=True))


def test_config_type_error():
    with pytest.raises(ConfigError, match="dict, a JSON file path or a zero_offload.Config"):
        Config.load(42)


# Issue 20, section 1: a GPU machine with no network has torch but no hjson. Only a file that is not strict JSON
# needs it; everything else runs in a fresh process where importing hjson fails.
NO_HJSON = r'''
import json, sys
class NoHjson:
    def find_spec(self, name, path=None, target=None):
        if name == "hjson" or name.startswith("hjson."):
            raise ImportError("No module named 'hjson' (blocked by the test)")
sys.meta_path.insert(0, NoHjson())
import torch
import zero_offload
from zero_offload import Config, ConfigError
import zero_offload.deepspeed
strict, loose = sys.argv[1:3]
assert Config.load({"train_batch_size": 4, "zero_optimization": {"stage": 2}}).zero_optimization.stage == 2
assert Config.load(strict).zero_optimization.stage == 1
engine = zero_offload.initialize(torch.nn.Linear(4, 2), strict)
engine.backward(engine(torch.ones(4, 4)).sum())
engine.step()
try:
    Config.load(loose)
    message = None
except ConfigError as e:
    message = str(e)
print(json.dumps({"hjson_imported": "hjson" in sys.modules, "message": message}))
'''


def test_json_configs_need_no_hjson(tmp_path):
    import subprocess
    import sys
    strict = tmp_path / "strict.json"
    strict.write_text(json.dumps({"train_batch_size": 4, "optimizer": {"type": "AdamW"},
                                  "zero_optimization": {"stage": 1}}))
    loose = tmp_path / "loose.hjson"
    loose.write_text('{"train_batch_size": 4, // a comment\n "zero_optimization": {"stage": 1,},}\n')
    proc = subprocess.run([sys.executable, "-c", NO_HJSON, str(strict), str(loose)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["hjson_imported"]
    message = result["message"]
    assert message is not None and "pip install hjson" in message and str(loose) in message, message
    assert "not strict JSON" in message


def test_hjson_file_without_hjson_names_the_package_and_file(tmp_path, monkeypatch):
    import sys
    loose = tmp_path / "with_comments.json"
    loose.write_text('{"train_batch_size": 4, # hash comment\n}')
    assert Config.load(loose).train_batch_size == 4            # hjson installed here: it loads
    monkeypatch.setitem(sys.modules, "hjson", None)             # as if it were not
    with pytest.raises(ConfigError, match=r"with_comments\.json.*pip install hjson"):
        Config.load(loose)
    strict = tmp_path / "strict.json"
    strict.write_text('{"train_batch_size": 4}')
    assert Config.load(strict).train_batch_size == 4
