"""The host-step policies keep their step graph: each policy's simulated-stream step (plain, delayed update,
super_offload, ratio; host memory and NVMe) has the operations and dependencies recorded in
``tests/data/step_graphs.json``, written by ``python tests/step_graphs.py`` before the host step moved into
`zero_offload.hoststep`. A change that reorders a copy, a wait or a host-step chunk fails here; a change meant to
alter a graph rewrites the file, and the diff shows what moved.
"""
from __future__ import annotations

import json

import pytest

import step_graphs
from zero_offload.offload import simulated

EXPECTED = json.loads(step_graphs.FIXTURE.read_text())


@pytest.fixture
def simulated_streams(monkeypatch):
    monkeypatch.setenv(simulated.ENV, "1")
    monkeypatch.delenv(simulated.SKIP_WAITS_ENV, raising=False)
    monkeypatch.setattr(simulated, "random_delay", lambda: 0.002)


@pytest.mark.parametrize("policy", list(step_graphs.POLICIES))
def test_each_policy_records_the_step_graph_it_had_before_the_move(policy, simulated_streams, tmp_path):
    graph = step_graphs.canonical(step_graphs.record_policy(policy, str(tmp_path)))
    expected = EXPECTED[policy]
    assert sorted(graph["lanes"]) == sorted(expected["lanes"])
    for lane, ops in expected["lanes"].items():
        assert graph["lanes"][lane] == ops, lane
    assert graph["edges"] == expected["edges"]


@pytest.mark.parametrize("policy", ["delayed-cpu", "super_offload-cpu", "plain-cpu"])
def test_the_comparison_sees_another_chunking(policy, simulated_streams, tmp_path):
    """Power: the host step walked in chunks twice as long (half the copies up, each after two chunks' work)."""
    graph = step_graphs.canonical(step_graphs.record_policy(policy, str(tmp_path), 2 * step_graphs.CHUNK))
    assert graph != EXPECTED[policy]
