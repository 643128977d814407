"""``zero-offload estimate --largest`` (issue 42, item 4): the largest GPT-2-shaped model a machine trains, with its
plan and predicted MFU. Checked against the planner itself: the answer fits, and one layer more does not."""
from __future__ import annotations

import dataclasses

import zero_offload
from zero_offload.cli import main
from zero_offload.estimate.largest import ASPECT, largest
from zero_offload.presets import count_parameters

BOX = dict(gpus=1, gpu_memory="16GB", host_memory="32GB")


def test_the_largest_fits_and_one_layer_more_does_not():
    found = largest(**BOX)
    assert found is not None and found.plan.fits and found.plan.batch.timing is not None
    s = found.shape
    assert found.params == count_parameters(s).total and s.n_embd == 128 * s.n_head
    assert 0 < found.mfu < 1
    if s.n_layer + 1 <= s.n_embd // ASPECT[0]:
        deeper = zero_offload.plan(dataclasses.replace(s, n_layer=s.n_layer + 1), micro_batch=1,
                                   gradient_accumulation=1, activation_checkpointing=True, timed=False, **BOX)
        assert not deeper.fits
    smaller = largest(gpus=1, gpu_memory="16GB", host_memory="16GB")
    assert smaller is not None and smaller.params < found.params        # less host memory, a smaller model


def test_the_cli_answers(capsys):
    assert main(["estimate", "--largest", "--gpu-mem", "16GB", "--host-mem", "32GB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("largest GPT-2-shaped model that trains: ") and "predicted MFU" in out


def test_bf16_masters_only_where_allowed_and_then_a_larger_model():
    """bf16 master weights (8 instead of 10 host bytes per parameter) change what is trained: the plan never picks
    them unasked, even for a model that fits no other way; allowed, the largest model grows and its plan asks for
    them."""
    plain = largest(**BOX, allow_bf16_moments=True)
    allowed = largest(**BOX, allow_bf16_masters=True, allow_bf16_moments=True)
    assert allowed.params > plain.params
    assert allowed.plan.config["bf16"]["bf16_master_weights_and_grads"] is True
    assert not plain.plan.config["bf16"].get("bf16_master_weights_and_grads")
    refused = zero_offload.plan(allowed.shape, micro_batch=1, gradient_accumulation=1, activation_checkpointing=True,
                                timed=False, allow_bf16_moments=True, **BOX)
    assert not refused.fits
    row = next(c for c in refused.rows if c.name == "stage 2 + offload opt, bf16 masters+moments")
    assert "--allow-bf16-masters" in row.error
