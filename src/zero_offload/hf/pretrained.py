"""A Hugging Face checkpoint loaded a shard per rank at ZeRO stage 3: no rank ever holds the whole model.

Inside `sharded_from_pretrained`, ``PreTrainedModel.from_pretrained`` builds the model on the meta device as
transformers always does, then, instead of materialising each checkpoint tensor whole, each rank reads only its
slice of it: the same flattened 1/N chunk `zero_offload.init_sharded` keeps (`sharded_init.slice_bounds`), read
from the safetensors file through ``safe_open(...).get_slice`` (memory-mapped; the rows that hold the chunk,
never the rest) and converted to the parameter's dtype. Each parameter stays a meta tensor with that slice
beside it, so `zero_offload.initialize` (or the Trainer) at stage 3 assembles its units from the slices as for
a model built under `init_sharded`.

Everything else is transformers' own code, so a model loads as ``from_pretrained`` loads it: the key renames
and base-model prefix (``rename_source_key``), the per-tensor dtype (``dtype`` and the ``keep_in_fp32`` plan),
tied weights (``tie_weights``: the tied parameter is the same object, with one slice), and the report: a
missing key is initialised by the model's ``_init_weights`` (then rank 0's values are kept, as DeepSpeed's
``GatheredParameters(modifier_rank=0)`` under transformers' ZeRO-3 path), a missing or unexpected key is listed
in transformers' LOAD REPORT warning, and a shape mismatch raises its ``RuntimeError`` ("Error(s) in loading
state_dict ... size mismatch ...") unless ``ignore_mismatched_sizes=True``. Buffers saved in the checkpoint are
small and read whole. A parameter transformers builds from several checkpoint tensors as it loads (an MoE layer's
experts, stacked: a ``WeightConverter``) is read whole, converted by transformers' own converter, then cut, one
such group at a time.

Memory per rank: the model's bytes / N (the slices) + at most one tensor's rows around its slice (the read
before the cut; a converted group whole) + transformers' fixed cost (the meta model, the config); the file's
mapping is opened per tensor, so mapped pages do not accumulate. transformers' own ZeRO-3 path
(``is_deepspeed_zero3_enabled``) loads the whole state dict on rank 0 instead.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import math

import torch
from safetensors import safe_open
from transformers import PreTrainedModel
from transformers.core_model_loading import WeightConverter, WeightRenaming, build_glob_alternation, rename_source_key
from transformers.utils.loading_report import LoadStateDictInfo

from zero_offload.zero.stage3.sharded_init import adopt_slice, has_slice, rank_world, shard_in_place, slice_bounds
from zero_offload.zero.stage3.swap import swap_keeping_attributes

__all__ = ["sharded_from_pretrained", "read_flat_range"]


def read_flat_range(path: str, key: str, lo: int, hi: int, out: torch.Tensor) -> None:
    """Copy elements ``[lo, hi)`` of the flattened tensor ``key`` of the safetensors file ``path`` into ``out``
    (1-D, ``hi - lo`` elements; converted to its dtype), reading only the rows of the tensor's first dimension
    that hold them (memory-mapped; the mapping is closed on return)."""
    with safe_open(path, framework="pt") as f:
        view = f.get_slice(key)
        shape = view.get_shape()
        if hi <= lo or len(shape) == 0:           # a rank that holds only padding, or a 0-d tensor
            out.copy_(f.get_tensor(key).reshape(-1)[lo:hi])
            return
        row = math.prod(shape) // shape[0]
        first, last = lo // row, -(-hi // row)
        out.copy_(view[first:last].reshape(-1)[lo - first * row:hi - first * row])


def _dtype_for(name: str, empty: torch.Tensor, plan) -> torch.dtype:
    """The dtype ``convert_and_load_state_dict_in_model`` gives the tensor ``name``: the ``keep_in_fp32`` plan's
    when it names it, else the dtype the model was built with."""
    if plan is not None:
        alternation, by_group, dtypes = plan
        hit = alternation.search(name)
        if hit is not None:
            return dtypes[by_group[hit.lastgroup]]
    return empty.dtype


def _refuse_unsupported(state_dict, checkpoint_files, load_config) -> None:
    if state_dict is not None:
        raise ValueError("sharded_from_pretrained reads the checkpoint's files a slice per rank; from_pretrained("
                         "state_dict=...) already holds the whole model: call it outside the context")
    if load_config.is_quantized or load_config.device_map is not None:
        raise ValueError("sharded_from_pretrained loads unquantized weights to the CPU for ZeRO stage 3: drop "
                         "quantization_config= and device_map= (the engine places the shards)")
    pickled = [f for f in checkpoint_files or () if not f.endswith(".safetensors")]
    if pickled or not checkpoint_files:
        found = pickled[0] if pickled else "none"
        raise ValueError(f"sharded_from_pretrained reads safetensors checkpoints; {found} is not one: convert it "
                         f"(save_pretrained writes safetensors) or load it outside the context")


def _load_slices(model, state_dict, checkpoint_files, load_config, expected_keys=None):
    """``PreTrainedModel._load_pretrained_model`` (transformers 5) with each rank reading only its slices."""
    _refuse_unsupported(state_dict, checkpoint_files, load_config)
    rank, world = rank_world()
    targets = model.state_dict(keep_vars=True)
    mapping = load_config.weight_mapping or []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {source: c for c in converters for source in c.source_patterns}
    plan = None
    if load_config.dtype_plan:
        alternation, by_group, _ = build_glob_alternation(list(load_config.dtype_plan))
        plan = (alternation, by_group, load_config.dtype_plan)
    info = LoadStateDictInfo(missing_keys=set(targets), unexpected_keys=set(), mismatched_keys=set(),
                             error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    prefix = model.base_model_prefix
    merged: dict[str, WeightConverter] = {}       # a target made of several checkpoint tensors -> its converter
    for path in checkpoint_files:
        with safe_open(path, framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        for key, shape in shapes.items():
            name, pattern = rename_source_key(key, renamings, converters, prefix, targets)
            if name not in targets and key in targets:
                name, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=targets)
            if name not in targets:
                info.unexpected_keys.add(name)
                continue
            dtype = _dtype_for(name, targets[name], plan)
            if pattern is not None:                  # read whole when converted, as transformers does
                merged.setdefault(name, copy.deepcopy(by_pattern[pattern])).add_tensor(
                    name, key, pattern, functools.partial(_read_whole, path, key, dtype))
            else:
                _place(model, targets, info, name, shape, dtype, (path, key), rank, world)
    for name, converter in merged.items():          # one converted group in memory at a time
        for target, value in converter.convert(name, model=model, config=model.config, loading_info=info).items():
            value = value[0] if isinstance(value, list) else value
            _place(model, targets, info, target, tuple(value.shape), value.dtype, value, rank, world)
    model._weight_conversions = [m for m in mapping if m.was_used()]
    return info, None


def _read_whole(path: str, key: str, dtype: torch.dtype) -> torch.Tensor:
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(key).to(dtype)


def _place(model, targets: dict, info, name: str, shape: tuple, dtype: torch.dtype, source, rank: int,
           world: int) -> None:
    """Give the meta tensor ``name`` its values from ``source``: ``(file, key)`` (read a slice) or a tensor
    (converted in memory); a shape mismatch is recorded as transformers' ``set_param_for_module`` does."""
    info.missing_keys.discard(name)
    empty = targets[name]
    if shape != tuple(empty.shape):
        info.mismatched_keys.add((name, torch.Size(shape), empty.shape))
        return
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    if attr in module._buffers:                      # small: read whole, as transformers does
        value = source if isinstance(source, torch.Tensor) else _read_whole(*source, dtype)
        module._buffers[attr] = value.to(dtype)
        module._buffers[attr]._is_hf_initialized = True
        return
    param = getattr(module, attr)
    if param.dtype != dtype:                         # keep the object (ties, references), change its dtype
        meta = torch.nn.Parameter(torch.empty(param.shape, dtype=dtype, device="meta"),
                                  requires_grad=param.requires_grad and dtype.is_floating_point)
        swap_keeping_attributes(param, meta)
    lo, hi = slice_bounds(param.numel(), rank, world)
    piece = adopt_slice(param, rank, world)[:hi - lo]
    if isinstance(source, torch.Tensor):
        piece.copy_(source.reshape(-1)[lo:hi])
    else:
        read_flat_range(*source, lo, hi, piece)
    param._is_hf_initialized = True


def _finalize_then_shard(original):
    def finalize(model, load_config, loading_info):
        info = original(model, load_config, loading_info)      # ties, initialises what is missing, reports
        shard_in_place(model)            # what transformers initialised: rank 0's values, a slice per rank
        # transformers (5.25 does) then kernelizes for the parameters' device, meta here: name the CPU, where a
        # plain load puts them, as transformers itself names the executed device of parameters offloaded to meta.
        model._kernels_device = "cpu"
        return info
    return finalize


@contextlib.contextmanager
def _swapped(owner: type, name: str, value):
    """``owner.name`` is ``value`` inside (a static or class method given as such), restored on exit."""
    before = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def _adapters_on_the_host(original):
    """peft's device probe for a layer it adapts: the CPU where the base layer is sharded here (meta), so a LoRA
    adapter made now keeps the values peft draws for it (moved to meta, it would have none)."""
    def probe(self, base_layer):
        device, dtype = original(self, base_layer)
        weight = getattr(base_layer, "weight", None)
        if device is not None and device.type == "meta" and weight is not None and has_slice(weight):
            device = torch.device("cpu")
        return device, dtype
    return probe


def _with_own(cls: type, name: str) -> list[type]:
    """``cls`` and its subclasses that define ``name`` themselves."""
    found, todo, seen = [], [cls], set()
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            found += [c] if name in c.__dict__ else []
            todo.extend(c.__subclasses__())
    return found


def _adapters_keep_their_values(original):
    """peft's ``_replace_module`` moves the new layer's adapters to the device of the layer it replaces: meta
    where that layer is sharded here, which would drop the values peft drew for them; they are put back."""
    def replace(self, parent, child_name, new_module, child):
        drawn = {n: p.detach() for n, p in new_module.named_parameters() if self.prefix in n and not p.is_meta}
        original(self, parent, child_name, new_module, child)
        for name, p in list(new_module.named_parameters()):
            if name in drawn and p.is_meta:
                owner, _, attr = name.rpartition(".")
                new_module.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(
                    drawn[name], requires_grad=p.requires_grad)
    return replace


@contextlib.contextmanager
def sharded_from_pretrained():
    """Inside this context ``from_pretrained`` of any transformers model builds it sharded for ZeRO stage 3, each
    rank reading only its slice of every tensor (see the module docstring); `zero_offload.initialize` or
    `zero_offload.hf.Trainer` with stage 3 then takes the model. A collective when a missing key is initialised
    (rank 0's values are broadcast): every rank loads the same checkpoint. The Trainer enters it around its own
    construction at stage 3, so a TRL trainer given a model name loads it this way. A peft adapter added inside
    (``get_peft_model``, TRL's ``peft_config``) over a sharded layer is made on the CPU, whole (it is small), with
    the values peft gives it.

    Example::

        with zero_offload.hf.sharded_from_pretrained():
            model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.1-8B", dtype=torch.bfloat16)
        engine = zero_offload.initialize(model, config)         # "zero_optimization": {"stage": 3, ...}

    Raises (from ``from_pretrained``):
        ValueError: the checkpoint is not safetensors, or ``state_dict=``, ``device_map=`` or a quantization
            config was given.
        RuntimeError: transformers' own, for a shape mismatch.
    """
    finalize = PreTrainedModel.__dict__["_finalize_model_loading"].__func__
    with contextlib.ExitStack() as stack:
        stack.enter_context(_swapped(PreTrainedModel, "_load_pretrained_model", staticmethod(_load_slices)))
        stack.enter_context(_swapped(PreTrainedModel, "_finalize_model_loading",
                                     staticmethod(_finalize_then_shard(finalize))))
        if importlib.util.find_spec("peft") is not None:
            from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
            probe = BaseTunerLayer.__dict__["_get_base_layer_device_and_dtype"]
            stack.enter_context(_swapped(BaseTunerLayer, "_get_base_layer_device_and_dtype",
                                         _adapters_on_the_host(probe)))
            for tuner in _with_own(BaseTuner, "_replace_module"):     # LoRA's tuner has its own
                replace = tuner.__dict__["_replace_module"]
                stack.enter_context(_swapped(tuner, "_replace_module", _adapters_keep_their_values(replace)))
        yield
