"""Stage-3 sharded init keeps what a parent module's ``__init__`` writes into its already-sharded children
(issue 21, section 3; DeepSpeed's ``TestZero3InitForParentWeightInitialization``).

A model built under `init_sharded` / ``deepspeed.zero.Init`` has the weights of a normal build with the same
seed: Hugging Face GPT-2 and Llama (``post_init`` re-initialises every child, GPT-2's attention writes its
child ``c_proj``), the project's GPT (``init_weights`` in ``__init__``), and the other write forms (views,
``.data``, ``nn.init``), at 1 and 2 ranks, checked through ``initialize`` (stage 3) and `gathered_parameters`.
"""
import warnings

import pytest
import torch
import torch.distributed as dist

import zero_offload
import zero_offload.deepspeed as deepspeed
from dist_utils import run_ranks

transformers = pytest.importorskip("transformers")
from hf_models import build  # noqa: E402

CONFIG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _built(kind: str, compat: bool) -> dict:
    warnings.simplefilter("ignore")
    with deepspeed.zero.Init() if compat else zero_offload.init_sharded():
        model = build(kind, seed=0)
    assert all(p.is_meta for p in model.parameters())
    engine = zero_offload.initialize(model, CONFIG)
    return engine.full_state_dict()


@pytest.mark.parametrize("kind,world,compat", [("gpt2", 1, False), ("llama", 1, True), ("gpt2", 2, True),
                                               ("llama", 2, False)])
def test_hf_model_built_sharded_has_the_weights_of_a_normal_build(kind, world, compat):
    warnings.simplefilter("ignore")
    ref = dict(build(kind, seed=0).named_parameters())
    for full in run_ranks(_built, world, kind, compat):
        assert full.keys() == ref.keys()
        for name, p in ref.items():
            assert torch.equal(full[name], p.detach()), name


def test_project_gpt_keeps_its_init_weights():
    from zero_offload.train.model import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    with zero_offload.init_sharded():
        model = GPT(cfg)
    full = zero_offload.initialize(model, CONFIG).full_state_dict()
    for name, p in ref.named_parameters():
        assert torch.equal(full[name], p.detach()), name
    assert 0.01 < full["transformer.wpe.weight"].std().item() < 0.03      # GPT-2's N(0, 0.02), not N(0, 1)


class ParentWrites(torch.nn.Module):
    """Children built first, then written by the parent in every form a constructor uses."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(6, 4)
        self.lin = torch.nn.Linear(4, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.own = torch.nn.Parameter(torch.ones(2))
        self.apply(self._init)
        with torch.no_grad():
            self.emb.weight.data[2].zero_()                    # a view of .data, as padding_idx zeroing
            self.emb.weight[0] = 5.0                           # __setitem__
            self.lin.weight.T[1].fill_(3.0)                    # a view through .T
            self.lin.bias *= 2.0                               # an in-place operator reads the old values
        torch.nn.init.kaiming_uniform_(self.lin.weight.data[:1], a=1.0)
        self.norm.weight.data = torch.full((3,), 0.5)          # .data = tensor
        self.norm.bias.data.copy_(self.lin.bias.data)          # copy_ from another sharded parameter

    @staticmethod
    def _init(module):
        if isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, torch.nn.Linear):
            module.bias.data.uniform_(-1.0, 1.0)


def _parent_writes():
    torch.manual_seed(0)
    with zero_offload.init_sharded():
        model = ParentWrites()
    probe = model.lin.weight.sum()
    assert probe.is_meta                                       # reads of a sharded parameter stay meta
    return zero_offload.initialize(model, CONFIG).full_state_dict()


@pytest.mark.parametrize("world", [1, 2])
def test_every_write_form_of_a_parent_reaches_the_shards(world):
    torch.manual_seed(0)
    ref = ParentWrites()
    for full in run_ranks(_parent_writes, world):
        for name, p in ref.named_parameters():
            assert torch.equal(full[name], p.detach()), name


class RankDependentInit(torch.nn.Module):
    """DeepSpeed's ModelWhereParentInitializesChildWeights: every rank writes its own value."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(12, 1)
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, torch.nn.Linear):
            with torch.no_grad():
                module.weight.fill_(1 + dist.get_rank())


def _rank_dependent():
    with deepspeed.zero.Init():
        model = RankDependentInit()
    with deepspeed.zero.GatheredParameters(model.linear.weight):
        return model.linear.weight.detach().clone()


def test_rank_zero_values_are_kept_as_in_deepspeed():
    for weight in run_ranks(_rank_dependent, 2):
        assert torch.equal(weight, torch.ones(1, 12))          # DeepSpeed's test: rank 0's 1 on every rank
