"""DeepSpeed 0.19.8's own Muon (docs/muon.md): its ZeRO 1-2 runs against its optimizer alone, the reference
`test_muon` compares this engine with (they agree without clipping; with a clip that fires DeepSpeed's ZeRO clips the
orthogonalized update instead of the gradient, and so does this engine by default), and its ZeRO 1-2 checkpoints,
optimizer on the device or offloaded, resumed here on 1 rank. DeepSpeed runs on its CPU accelerator in `dist_utils.run_ranks`."""
import os

import pytest
import torch
import torch.distributed as dist

import zero_offload
from deepspeed_peer import needs_deepspeed
from dist_utils import run_ranks
from muon_reference import MICRO, MUON, deepspeed_muon, fp32_iteration, reference_run
from toy_model import batch, make_model

pytestmark = needs_deepspeed
N, M = 3, 2


def _ds_run(stage, offload, clip, path=None):
    """DeepSpeed trains N + M steps (saving ``path`` after N); its full parameters."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    rank, ws = dist.get_rank(), dist.get_world_size()
    zc = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": clip, "zero_optimization": zc,
              "zero_force_ds_cpu_optimizer": False, "optimizer": {"type": "Muon", "params": MUON}}
    with fp32_iteration(), torch._dynamo.config.patch(disable=True):
        engine, *_ = deepspeed.initialize(model=make_model(), config=config)
        for step in range(N + M):
            if step == N and path:
                engine.save_checkpoint(path)
            x, y = batch(step, MICRO * ws)
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(engine(x[rows], y[rows]))
            engine.step()
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _max_error(a, b):
    return max((a[k] - v).abs().max().item() for k, v in b.items())


@pytest.mark.parametrize("stage,offload", [(1, False), (2, True)])
def test_deepspeed_zero_muon_equals_its_optimizer(stage, offload, tmp_path):
    """The reference is DeepSpeed's own (its ZeRO runs equal it), and a DeepSpeed ZeRO checkpoint resumes here: N
    steps under DeepSpeed on 2 ranks, saved, then M steps here on 1 rank equal DeepSpeed's M."""
    ref = reference_run(lambda m: deepspeed_muon(MUON, m), ws=2, steps=N + M)
    path = str(tmp_path / "ds")
    theirs = run_ranks(_ds_run, 2, stage, offload, 0.0, path)[0]
    assert _max_error(theirs, ref) <= 1e-5
    config = {"train_micro_batch_size_per_gpu": MICRO * 2, "optimizer": {"type": "Muon", "params": MUON},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with fp32_iteration():
        engine = zero_offload.initialize(make_model(), config)
        engine.load_checkpoint(path)
        assert engine.global_step == N
        for step in range(N, N + M):
            x, y = batch(step, MICRO * 2)
            engine.backward(engine(x, y))
            engine.step()
    assert _max_error(engine.full_state_dict(), theirs) <= 1e-5


def _our_run(stage, offload, clip, params=MUON):
    """This engine on the same config as `_ds_run` (N + M steps); its full parameters."""
    rank = dist.get_rank()
    zc = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": clip, "zero_optimization": zc,
              "optimizer": {"type": "Muon", "params": params}}
    with fp32_iteration():
        engine = zero_offload.initialize(make_model(), config)
        for step in range(N + M):
            x, y = batch(step, MICRO * 2)
            engine.backward(engine(x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]))
            engine.step()
        return engine.full_state_dict()


@pytest.mark.parametrize("stage,offload", [(2, False), (1, True)])
def test_zero_clips_the_update_as_deepspeeds_zero(stage, offload):
    """With a clip that fires, DeepSpeed's ZeRO clips the orthogonalized Muon update together with the Adam half's
    gradients: its run equals the reference in that order (`zero_order_step`), and so does this engine's on the
    same config (issue 57). ``"clip": "gradient"`` is the other order, the optimizer alone's, which DeepSpeed's ZeRO
    moves away from."""
    theirs = run_ranks(_ds_run, 2, stage, offload, 7.0)[0]
    assert _max_error(theirs, reference_run(lambda m: deepspeed_muon(MUON, m), ws=2, clip=7.0, steps=N + M,
                                            clip_update=True)) <= 1e-5
    assert _max_error(run_ranks(_our_run, 2, stage, offload, 7.0)[0], theirs) <= 1e-5
    alone = reference_run(lambda m: deepspeed_muon(MUON, m), ws=2, clip=7.0, steps=N + M)
    assert _max_error(alone, theirs) > 1e-3
    gradient_order = run_ranks(_our_run, 2, stage, offload, 7.0, dict(MUON, clip="gradient"))[0]
    assert _max_error(gradient_order, alone) <= 1e-5


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def _tokens(step, rows):
    return torch.randint(0, 96, (rows, 12), generator=torch.Generator().manual_seed(step))


PER_HEAD = dict(MUON, per_head_muon=True)


def _per_head_reference(ws):
    """DeepSpeed's own per-head tagging (``set_optimizer_flags``) and its ``SingleDeviceMuonWithAuxAdam``, which
    orthogonalizes per head (``MuonWithAuxAdam`` of ``muon_optimizer`` would not: its matrix path leaves
    ``num_heads`` out, and DeepSpeed's ZeRO paths pass it)."""
    from types import SimpleNamespace
    from deepspeed import set_optimizer_flags
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.muon.original_muon import SingleDeviceMuonWithAuxAdam
    model = _llama()
    set_optimizer_flags(SimpleNamespace(optimizer_name="muon", optimizer_params=PER_HEAD), model)
    tagged = {n: p.muon_num_heads for n, p in model.named_parameters() if p.muon_num_heads}
    opt = SingleDeviceMuonWithAuxAdam(DeepSpeedEngine._muon_param_groups(list(model.parameters()), dict(PER_HEAD)))
    with fp32_iteration(), torch._dynamo.config.patch(disable=True):
        for step in range(N):
            x = _tokens(step, MICRO * ws)
            model.zero_grad()
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, tagged


def _per_head_engine():
    rank, ws = dist.get_rank(), dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "Muon", "params": PER_HEAD},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 2000}}
    with fp32_iteration():
        engine = zero_offload.initialize(_llama(), config)
        for step in range(N):
            x = _tokens(step, MICRO * ws)[rank * MICRO:(rank + 1) * MICRO]
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
    heads = {n: h for g in engine.zero.adam.owners.matrices for n, h in [(g.name, g.num_heads)] if h}
    return engine.full_state_dict(), heads


def test_per_head_muon_matches_deepspeeds():
    """``per_head_muon`` on a Llama with grouped-query attention (4 query heads, 2 key/value heads): the same
    projections tagged with the same head counts as DeepSpeed's, and the weights within 1e-5 of its per-head
    optimizer after N steps on 2 ranks."""
    ref, tagged = _per_head_reference(2)
    for full, heads in run_ranks(_per_head_engine, 2):
        assert heads == tagged and len(tagged) == 6, (heads, tagged)
        assert _max_error(full, ref) <= 1e-5
