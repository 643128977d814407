"""Sharded, atomic checkpoints that reshard on load, in safetensors files with a JSON manifest.

Layout of ``save_dir/tag/``:
  ``rank00000.safetensors`` ...  one per rank: its partition of every group's fp32 master weights, exp_avg and
                                 exp_avg_sq (``group{g}.{kind}``; stage 0 has one partition, in rank 0's file),
                                 and its RNG states; the optimizer step count is in the file's metadata.
  ``client_state.pt``            the user's ``client_state`` (torch.save).
  ``module_state.safetensors``   persistent buffers and frozen parameters (what no optimizer holds).
  ``manifest.json``              world size, stage, precision, every parameter's name, shape and flat offset,
                                 each group's partition size, the config, the engine's ``state_dict()``, and a
                                 SHA-256 of every file.
  ``manifest.sha256``            the SHA-256 of ``manifest.json``, checked before anything is read.
``save_dir/latest`` names the newest tag (a plain name, as in DeepSpeed).

One writer at a time: rank 0 holds ``save_dir/.lock`` (`lock`) for the whole save, and a second
process saving into the same directory fails at once naming the holder's pid. Crash safety: everything is
written into ``save_dir/.tmp-tag-pid-random``, flushed to disk, and renamed to ``tag`` only when complete;
``latest`` is replaced last, atomically. A process killed at any moment leaves the previous checkpoint
loadable; its leftover temporary folder is removed by the next save. Loading checks the manifest's hash and
structure, every checksum, name and shape, and reads everything into fresh tensors before it changes
anything; it maps parameters by name from the saved flat layout into the engine's, so a checkpoint written by
N ranks at any stage loads into M ranks at any stage (DeepSpeed needs its universal-checkpoint conversion).
The engine is reached only through `zero_offload.runtime.state.CheckpointTarget`: its ``state_dict()`` and its
optimizer partitions' chunked state.

The modules: `save` (lock, temporary folder, publication, pruning), `load` (and its checks), `reshard` (saved
layout to this engine's, streamed), `manifest`, `io` (names, checksums, write errors), `lock`, `stream` (a
safetensors file written piece by piece) and `consolidate` (one state dict or file from the shards). Other
frameworks' checkpoints, both ways: `dcp` (FSDP2) with `dcp_layout` (where its model and optimizer sit),
`deepspeed_read` with `deepspeed_states`, `deepspeed_zero` and `deepspeed_universal` (DeepSpeed's ZeRO and
universal checkpoints in), `deepspeed_write` (universal out),
`foreign` (what those loads share), `foreign_pickle` (DeepSpeed's pickles without DeepSpeed), `dcp_stream` (DCP
written a tensor at a time), `formats` (which reader or writer a checkpoint goes through) and `convert` with
`convert_target` (``zero-offload convert``, streamed).
"""
from zero_offload.checkpoint.consolidate import consolidate, export_safetensors
from zero_offload.checkpoint.io import MODULE_STATE, CheckpointError, DiskFullError
from zero_offload.checkpoint.load import full_parameters, load_checkpoint, read_manifest, resolve_tag
from zero_offload.checkpoint.lock import DirectoryLock, LockedError
from zero_offload.checkpoint.manifest import ManifestError
from zero_offload.checkpoint.save import list_tags, prune_checkpoints, save_checkpoint, tied_aliases

__all__ = ["CheckpointError", "DiskFullError", "ManifestError", "LockedError", "DirectoryLock", "save_checkpoint",
           "load_checkpoint", "read_manifest", "resolve_tag", "full_parameters", "list_tags", "prune_checkpoints",
           "tied_aliases", "consolidate", "export_safetensors", "MODULE_STATE"]
