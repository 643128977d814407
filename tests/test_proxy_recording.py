"""The step model's recording subprocess (`zero_offload.estimate.proxy_recording`): where the proxy may not train in
this process (CUDA visible, or a rank of a distributed job), one subprocess records every structure a plan asks for,
reports a failed recording with its traceback, and is started afresh when it has died."""
from __future__ import annotations

import os
import signal
import subprocess

import pytest

from zero_offload.estimate import proxy_recording
from zero_offload.estimate.proxy_recording import Structure, recording
from zero_offload.estimate.recording_cache import DIR_ENV


@pytest.fixture(autouse=True)
def _recorded_afresh(monkeypatch):
    """Recordings made here, not read from disk: these tests change the engine or count the recordings."""
    monkeypatch.setenv(DIR_ENV, "off")


STRUCTURES = [Structure(stage=2, offload_param=False, delayed=d, accumulates=a, fp32=False)
              for d in (False, True) for a in (False, True)]


@pytest.fixture
def elsewhere(monkeypatch):
    """Recordings in the subprocess (as in a rank of a distributed job), each made afresh; the recorder ended after."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    starts = []
    popen = subprocess.Popen

    def counted(*args, **kwargs):
        starts.append(popen(*args, **kwargs))
        return starts[-1]
    monkeypatch.setattr(proxy_recording.subprocess, "Popen", counted)
    recording.cache_clear()
    yield starts
    recording.cache_clear()
    proxy_recording.close_recorder()


def test_one_subprocess_records_every_structure_as_this_process_would(elsewhere):
    there = [recording(s) for s in STRUCTURES]
    assert len(elsewhere) == 1                    # power: a subprocess per recording (as before) starts 4
    os.environ.pop("WORLD_SIZE")
    recording.cache_clear()
    here = [recording(s) for s in STRUCTURES]
    for (tl_there, marks_there), (tl_here, marks_here) in zip(there, here):
        kinds = lambda tl: sorted({(o.lane.split("_")[0], o.kind) for o in tl.ops})   # noqa: E731
        # op ids differ with thread timing; the kinds of op and the micro-steps recorded do not
        assert kinds(tl_there) == kinds(tl_here) and len(marks_there) == len(marks_here)


def test_a_failed_recording_names_the_structure_and_the_recorder_goes_on(elsewhere):
    bad = Structure(stage=7, offload_param=False, delayed=False, accumulates=False, fp32=False)
    with pytest.raises(RuntimeError,
                       match=r"(?s)recording the step graph of Structure\(stage=7.*zero_optimization\.stage"):
        recording(bad)
    recording(STRUCTURES[0])
    assert len(elsewhere) == 1


def test_a_recorder_that_died_is_started_again(elsewhere):
    recording(STRUCTURES[0])
    elsewhere[0].send_signal(signal.SIGKILL)      # as the kernel's OOM killer would
    elsewhere[0].wait()
    recording(STRUCTURES[1])
    assert len(elsewhere) == 2
