"""The step model's recordings on disk (`zero_offload.estimate.recording_cache`): a second process reads a
structure's recording instead of recording it again, a changed engine records afresh, and a damaged file or a
directory that cannot be written never fails a plan."""
from __future__ import annotations

import json

import pytest

from zero_offload.estimate import proxy_recording, recording_cache
from zero_offload.estimate.proxy_recording import Structure, recording
from zero_offload.estimate.recording_cache import DIR_ENV

PLAIN = Structure(stage=2, offload_param=False, delayed=False, accumulates=False, fp32=False)


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """Recordings kept in a fresh directory; returns (the directory, the recordings made so far)."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "recordings"))
    made = []
    record_here = proxy_recording._record_here

    def counted(s):
        made.append(s)
        return record_here(s)
    monkeypatch.setattr(proxy_recording, "_record_here", counted)
    recording.cache_clear()                     # as a new process starts
    yield tmp_path / "recordings", made
    recording.cache_clear()


def test_a_new_process_reads_the_recording_instead_of_recording_again(recorded):
    where, made = recorded
    first = recording(PLAIN)
    assert len(made) == 1 and len(list(where.glob("*.json"))) == 1
    recording.cache_clear()
    again = recording(PLAIN)
    assert len(made) == 1                       # power: without the cache it records a second time
    assert again[0].to_list() == first[0].to_list() and again[1] == first[1]
    other = Structure(stage=2, offload_param=False, delayed=True, accumulates=False, fp32=False)
    recording(other)
    assert made == [PLAIN, other] and len(list(where.glob("*.json"))) == 2


def test_a_changed_engine_records_afresh(recorded, monkeypatch):
    where, made = recorded
    recording(PLAIN)
    recording.cache_clear()
    monkeypatch.setattr(recording_cache, "_code_digest", lambda: "another engine's code")
    recording(PLAIN)
    assert len(made) == 2 and len(list(where.glob("*.json"))) == 2


@pytest.mark.parametrize("damage", ["not json {", json.dumps({"key": {"stage": 3}, "recording": {}}), "[]"])
def test_a_damaged_file_is_recorded_again_and_replaced(recorded, damage):
    where, made = recorded
    recording(PLAIN)
    (path,) = where.glob("*.json")
    path.write_text(damage)
    recording.cache_clear()
    recording(PLAIN)
    assert len(made) == 2 and json.loads(path.read_text())["key"]["stage"] == 2


def test_a_directory_that_cannot_be_written_is_passed_over(recorded, monkeypatch, tmp_path):
    _, made = recorded
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "a-file" / "recordings"))     # under a file: mkdir fails
    tl, marks = recording(PLAIN)
    assert len(made) == 1 and tl.ops and marks
    assert not list(tmp_path.glob("*.tmp"))


def test_off_keeps_nothing(recorded, monkeypatch):
    where, made = recorded
    monkeypatch.setenv(DIR_ENV, "off")
    assert recording_cache.recordings_dir() is None
    recording(PLAIN)
    recording.cache_clear()
    recording(PLAIN)
    assert len(made) == 2 and not where.exists()


def test_only_the_last_engines_recordings_are_kept(recorded, monkeypatch):
    where, made = recorded
    for k in range(recording_cache.KEEP_ENGINES + 2):         # a developer's edits, or upgrades
        monkeypatch.setattr(recording_cache, "_code_digest", lambda k=k: f"{k:016d}")
        recording.cache_clear()
        recording(PLAIN)
    engines = sorted({p.name.split("-")[0] for p in where.glob("*.json")})
    assert engines == [f"{k:016d}" for k in range(2, recording_cache.KEEP_ENGINES + 2)]
