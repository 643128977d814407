"""Checkpoints that cannot be mixed or silently wrong: one writer per directory, a manifest that proves itself,
loads that change nothing until everything is checked, plain tag names, and write errors that name the file."""
import fcntl
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import zero_offload
from reference import engine_config
from tmpfs_utils import small_tmpfs
from toy_model import batch, make_model
from zero_offload.checkpoint import CheckpointError, DiskFullError
from zero_offload.checkpoint.lock import LOCK_FILE, DirectoryLock, LockedError
from zero_offload.checkpoint.manifest import manifest_digest

HERE = os.path.dirname(__file__)
CFG = engine_config(2, "cpu", 1)


def _trained(steps=1, seed=0):
    engine = zero_offload.initialize(make_model(seed=seed), CFG)
    for s in range(steps):
        x, y = batch(s, 2)
        engine.backward(engine(x, y))
        engine.step()
    return engine


def _snapshot(engine):
    return engine.full_state_dict(), engine.state_dict()


def _unchanged(engine, snap):
    params, state = snap
    now = engine.full_state_dict()
    return all(torch.equal(now[n], params[n]) for n in params) and engine.state_dict() == state


def _edit_manifest(directory, edit, rehash):
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    data = json.dumps(manifest, indent=1).encode()
    path.write_bytes(data)
    if rehash:     # a consistent forgery: only the structural checks can catch it
        (directory / "manifest.sha256").write_text(manifest_digest(data) + "\n")


# -- one writer ----------------------------------------------------------------------------------------
def test_a_second_writer_fails_at_once_naming_the_holder(tmp_path):
    engine = _trained()
    with DirectoryLock(tmp_path):                    # another process saving into the same directory
        with pytest.raises(CheckpointError, match=rf"being saved into by another process \(pid {os.getpid()}\)"):
            engine.save_checkpoint(tmp_path, tag="a")
    assert not (tmp_path / "a").exists() and not (tmp_path / "latest").exists()
    engine.save_checkpoint(tmp_path, tag="a")       # the lock is gone with its holder
    assert (tmp_path / "latest").read_text() == "a"


def _held_without_a_pid(directory):
    """A holder caught between taking the lock and writing its pid: the lock file locked, and empty."""
    directory.mkdir(exist_ok=True)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_writer_refused_before_the_holder_wrote_its_pid_still_names_it(tmp_path):
    """The CI run of 17e9258 (under load) saw 'pid unknown': the refused writer read the lock file in the instant
    between the holder's lock and its pid. The refusal waits for the pid (`PID_WAIT_S`) and names it."""
    fd = _held_without_a_pid(tmp_path)
    writer = threading.Timer(0.3, os.pwrite, (fd, b"4242\n", 0))
    writer.start()
    try:
        with pytest.raises(LockedError, match=r"by another process \(pid 4242\)"):
            DirectoryLock(tmp_path).acquire()
    finally:
        writer.join()
        os.close(fd)


def test_a_lock_being_let_go_is_taken_not_refused(tmp_path):
    """The holder empties the lock file just before unlocking: a writer that comes in between gets the lock."""
    fd = _held_without_a_pid(tmp_path)
    releaser = threading.Timer(0.3, os.close, (fd,))
    releaser.start()
    lock = DirectoryLock(tmp_path).acquire()
    try:
        assert lock.held and (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    finally:
        lock.release()
        releaser.join()


WRITER = textwrap.dedent("""
    import json, os, sys, time, torch
    sys.path.insert(0, {here!r})
    import zero_offload
    import zero_offload.checkpoint.save as checkpoint_save
    from zero_offload.checkpoint import CheckpointError
    from zero_offload.checkpoint.lock import DirectoryLock, LockedError
    from reference import engine_config
    from toy_model import batch, make_model
    me, peer, root, meet = {seed}, {peer}, {root!r}, {meet!r}

    class MeetingTimeout(RuntimeError):    # not an OSError: the save must not mistake it for a refusal
        pass

    def mark(name, text=""):               # written whole, then renamed: the peer never reads half a file
        part = os.path.join(meet, f".{{name}}.part")
        with open(part, "w") as f:
            f.write(text)
        os.replace(part, os.path.join(meet, name))

    def wait_for(name, limit=120.0):
        path, deadline = os.path.join(meet, name), time.monotonic() + limit
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise MeetingTimeout(f"writer {{me}}: writer {{peer}} did not write '{{name}}' within {{limit}} s")
            time.sleep(0.01)
        with open(path) as f:
            return f.read()

    class HeldUntilRefused(DirectoryLock):
        # The first save that takes the lock holds it until the other writer's save has been refused:
        # the two saves overlap for certain, whichever of them wins the lock.
        first = True

        def acquire(self):
            first, HeldUntilRefused.first = HeldUntilRefused.first, False
            try:
                super().acquire()
            except LockedError as e:
                if first:
                    mark(f"refused{{me}}", str(e))
                raise
            if first:
                wait_for(f"refused{{peer}}")
            return self

    checkpoint_save.DirectoryLock = HeldUntilRefused
    engine = zero_offload.initialize(make_model(seed=me), engine_config(2, "cpu", 1))
    x, y = batch(me, 2)
    engine.backward(engine(x, y))
    engine.step()
    torch.save(engine.full_state_dict(), os.path.join(meet, f"writer{{me}}.pt"))
    mark(f"ready{{me}}")
    wait_for(f"ready{{peer}}")                # both are trained: save at once
    result = {{"pid": os.getpid(), "refusal": None}}
    try:
        engine.save_checkpoint(root, tag="shared", client_state={{"writer": me}})
        mark(f"saved{{me}}")
    except CheckpointError as e:
        result["refusal"] = str(e)
        wait_for(f"saved{{peer}}")
        engine.save_checkpoint(root, tag="retry", client_state={{"writer": me}})   # the lock is free now
    print(json.dumps(result))
""")


def test_concurrent_writers_never_mix_a_checkpoint(tmp_path):
    """Two trained writers save into one directory at once; the one that wins the lock holds it until the
    other has tried, so the refusal is certain. The refused one saves again afterwards, under another tag."""
    root, meet = tmp_path / "ckpt", tmp_path / "meet"
    meet.mkdir()
    earlier = _trained(2, seed=5)
    earlier.save_checkpoint(root, tag="earlier")     # already saved: neither writer may lose it
    earlier_state = earlier.full_state_dict()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER.format(here=HERE, root=str(root), meet=str(meet),
                                                                   seed=s, peer=3 - s)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in (1, 2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    results = {s: json.loads(o[0].strip().splitlines()[-1]) for s, o in zip((1, 2), outs)}
    refused = [s for s in results if results[s]["refusal"] is not None]
    assert len(refused) == 1, f"the saves did not collide: {results}"
    loser, winner = refused[0], 3 - refused[0]
    message = results[loser]["refusal"]
    assert f"'{root}' is being saved into by another process (pid {results[winner]['pid']})" in message

    assert (root / "latest").read_text() == "retry"  # the refused writer saved last, once the lock was free
    assert sorted(p.name for p in root.iterdir()) == [".lock", "earlier", "latest", "retry", "shared"]  # no .tmp-
    writers = {s: torch.load(meet / f"writer{s}.pt") for s in (1, 2)}
    writers[5] = earlier_state
    assert any(not torch.equal(writers[1][n], writers[2][n]) for n in writers[1])   # a mix would show
    engine = _trained(0, seed=3)
    for tag, writer in (("shared", winner), ("retry", loser), ("earlier", 5)):
        client = engine.load_checkpoint(root, tag=tag)     # every checksum and the manifest hash pass
        assert tag == "earlier" or client == {"writer": writer}, (tag, client)
        loaded = engine.full_state_dict()
        assert all(torch.equal(loaded[n], writers[writer][n]) for n in loaded), f"{tag}: a mix of writers"


def test_stale_temporary_folders_are_removed_by_the_next_save(tmp_path):
    stale = tmp_path / ".tmp-global_step9-4242-deadbeef"
    stale.mkdir(parents=True)
    (stale / "rank00000.safetensors").write_bytes(b"partial")
    _trained().save_checkpoint(tmp_path)
    assert not stale.exists()


# -- a manifest that proves itself ----------------------------------------------------------------------
def _edit_global_step(m):
    m["engine"]["global_step"] = 99


def _edit_lrs(m):
    m["engine"]["lrs"] = [1.0]


def _edit_piece_offset(m):
    m["groups"][0]["params"][1]["pieces"][0][1] += 1


@pytest.mark.parametrize("edit", [_edit_global_step, _edit_lrs, _edit_piece_offset], ids=["step", "lrs", "offset"])
def test_an_edited_manifest_is_refused_and_nothing_changes(tmp_path, edit):
    _trained(2).save_checkpoint(tmp_path, tag="t")
    _edit_manifest(tmp_path / "t", edit, rehash=False)
    engine = _trained(1, seed=4)
    snap = _snapshot(engine)
    with pytest.raises(CheckpointError, match="modified after saving"):
        engine.load_checkpoint(tmp_path)
    assert _unchanged(engine, snap)
    with pytest.raises(CheckpointError, match="modified after saving"):
        zero_offload.consolidate(tmp_path)


def _drop_engine(m):
    del m["engine"]["loss_scaler"]


def _offset_past_partition(m):
    m["groups"][0]["params"][-1]["pieces"][-1][1] = m["groups"][0]["partition_numel"]


def _not_a_list(m):
    m["groups"][0]["params"] = {"a": 1}


@pytest.mark.parametrize("edit,message", [
    (_drop_engine, "'engine.loss_scaler' is missing"),
    (_offset_past_partition, r"pieces\[\d+\]\[[13]\] \((part_offset|length)\)"),
    (_not_a_list, "'groups\\[0\\].params' must be list"),
], ids=["missing-section", "offset-outside-file", "malformed"])
def test_a_malformed_manifest_fails_before_the_engine_changes(tmp_path, edit, message):
    _trained(2).save_checkpoint(tmp_path, tag="t")
    _edit_manifest(tmp_path / "t", edit, rehash=True)
    engine = _trained(1, seed=4)
    snap = _snapshot(engine)
    with pytest.raises(CheckpointError, match=message):
        engine.load_checkpoint(tmp_path)
    assert _unchanged(engine, snap)


def _forge_rank_file(directory, fault):
    """Rewrite rank 0's file without group 1's exp_avg or with it cut short, and re-sign the manifest (group 1:
    a load that streamed group 0 before checking group 1 would already have changed the engine)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from zero_offload.checkpoint.io import sha256_file
    path = directory / "rank00000.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    key = "group1.exp_avg"
    if fault == "missing":
        del tensors[key]
    else:
        tensors[key] = tensors[key][:-1].clone()
    save_file(tensors, str(path), metadata=metadata)
    _edit_manifest(directory, lambda m: m["files"].update({path.name: sha256_file(path)}), rehash=True)
    return path


def _two_groups(stage, seed):
    """The toy model with its 1-D parameters in a second param group (no weight decay)."""
    model = make_model(seed=seed)
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1]},
              {"params": [p for p in model.parameters() if p.dim() == 1], "weight_decay": 0.0}]
    return zero_offload.initialize(model, engine_config(stage, "cpu", 1), model_parameters=groups)


@pytest.mark.parametrize("fault,message", [("missing", r"lacks tensor 'group1.exp_avg'"),
                                           ("short", r"holds 'group1.exp_avg' of shape \[\d+\], its manifest says")])
@pytest.mark.parametrize("stage", [2, 3], ids=["same-layout", "reshard"])
def test_a_rank_file_without_a_partition_fails_before_the_engine_changes(tmp_path, stage, fault, message):
    """A consistently signed rank file that lacks a saved partition (or holds it short) is refused naming the file
    and the tensor, before anything changes (group 0, intact, is not loaded either): when loaded as it was saved
    and when resharded (stage 2 -> 3)."""
    saver = _two_groups(2, 0)
    x, y = batch(0, 2)
    saver.backward(saver(x, y))
    saver.step()
    saver.save_checkpoint(tmp_path, tag="t")
    path = _forge_rank_file(tmp_path / "t", fault)
    engine = _two_groups(stage, 4)
    snap = _snapshot(engine)
    with pytest.raises(CheckpointError, match=message) as info:
        engine.load_checkpoint(tmp_path)
    assert str(path) in str(info.value)
    assert _unchanged(engine, snap)


def test_a_missing_manifest_hash_is_refused(tmp_path):
    _trained().save_checkpoint(tmp_path, tag="t")
    (tmp_path / "t" / "manifest.sha256").unlink()
    with pytest.raises(CheckpointError, match="manifest.sha256' is missing"):
        _trained(0).load_checkpoint(tmp_path)


@pytest.mark.parametrize("latest", ["..", "../t", "/etc", ".hidden", ""])
def test_latest_must_name_a_tag_inside_the_directory(tmp_path, latest):
    (tmp_path / "inner").mkdir()
    _trained().save_checkpoint(tmp_path / "inner", tag="t")
    (tmp_path / "inner" / "latest").write_text(latest)
    with pytest.raises(CheckpointError, match="plain name"):
        _trained(0).load_checkpoint(tmp_path / "inner")


@pytest.mark.parametrize("tag", ["..", "../x", "a/b", ".tmp-x"])
def test_tags_must_be_plain_names(tmp_path, tag):
    engine = _trained()
    with pytest.raises(CheckpointError, match="plain name"):
        engine.save_checkpoint(tmp_path, tag=tag)
    with pytest.raises(CheckpointError, match="plain name"):
        engine.load_checkpoint(tmp_path, tag=tag)


@pytest.mark.parametrize("path", ["", "  "])
def test_an_empty_save_path_is_an_error(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="needs a directory"):
        _trained().save_checkpoint(path)
    assert list(tmp_path.iterdir()) == []


# -- write errors a person can act on ------------------------------------------------------------------
@pytest.fixture
def small_mount(tmp_path):
    with small_tmpfs(tmp_path / "small", "96k") as mnt:
        yield mnt


def test_disk_full_names_the_file_and_the_bytes_needed_and_keeps_the_previous_checkpoint(small_mount):
    small_tmpfs = small_mount
    engine = _trained()
    small = zero_offload.initialize(torch.nn.Linear(4, 4), {"train_batch_size": 1, **{
        k: v for k, v in CFG.items() if k in ("optimizer", "zero_optimization")}})
    small.save_checkpoint(small_tmpfs, tag="small")  # fits
    with pytest.raises(DiskFullError, match=r"rank00000.safetensors': it needs about \d+ bytes .* bytes are free"):
        engine.save_checkpoint(small_tmpfs, tag="big")   # the toy model's optimizer state does not
    assert (small_tmpfs / "latest").read_text() == "small"
    assert sorted(p.name for p in small_tmpfs.iterdir()) == [".lock", "latest", "small"]   # no .tmp-* left
    fresh = zero_offload.initialize(torch.nn.Linear(4, 4), {"train_batch_size": 1, **{
        k: v for k, v in CFG.items() if k in ("optimizer", "zero_optimization")}})
    fresh.load_checkpoint(small_tmpfs)


def test_a_failed_write_leaves_no_temporary_folder(tmp_path, monkeypatch):
    import zero_offload.checkpoint.save as ckpt
    engine = _trained()
    engine.save_checkpoint(tmp_path, tag="good")

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ckpt, "StreamedSafetensors", fail)   # the rank file's writer
    with pytest.raises(DiskFullError, match="rank00000.safetensors"):
        engine.save_checkpoint(tmp_path, tag="bad")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "good", "latest"]
