"""Checkpoint faults in one process (killed save, corrupted, truncated or missing files, mismatched
shapes, another model): each fails with an error naming the tensor and the file, before any
parameter changes; a save dying at any point leaves the previous checkpoint loadable."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from mindspore import nn

from hyper_parallel_ms import checkpoint as dcp

from tests._checkpoint_models import MLP, _trained

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _saved(tmp_path):
    model, opt = _trained(0)
    path = str(tmp_path / "c")
    dcp.save({"model": dcp.get_model_state_dict(model)}, checkpoint_id=path)
    fresh = MLP()
    before = {n: p.asnumpy().copy() for n, p in fresh.parameters_and_names()}
    return path, fresh, before


def _unchanged(fresh, before):
    for n, p in fresh.parameters_and_names():
        np.testing.assert_array_equal(p.asnumpy(), before[n], err_msg=f"{n} changed by a failed load")


def test_corrupted_truncated_or_missing_file_fails_before_any_change(tmp_path):
    path, fresh, before = _saved(tmp_path)
    data = os.path.join(path, "rank_0.safetensors")
    raw = bytearray(open(data, "rb").read())
    raw[-3] ^= 0xFF                                         # a flipped byte in the last tensor (up.weight)
    open(data, "wb").write(bytes(raw))
    with pytest.raises(dcp.CheckpointError,
                       match=r"tensor 'model\.up\.weight'.*rank_0\.safetensors fails its checksum"):
        dcp.load({"model": dcp.get_model_state_dict(fresh)}, checkpoint_id=path)
    _unchanged(fresh, before)
    open(data, "wb").write(bytes(raw[:len(raw) // 2]))
    with pytest.raises(dcp.CheckpointError, match="rank_0.safetensors is truncated"):
        dcp.load({"model": dcp.get_model_state_dict(fresh)}, checkpoint_id=path)
    os.remove(data)
    with pytest.raises(dcp.CheckpointError, match=r"'model\.\w+\.\w+': its data file .*rank_0\.safetensors is missing"):
        dcp.load({"model": dcp.get_model_state_dict(fresh)}, checkpoint_id=path)
    _unchanged(fresh, before)


def test_shape_mismatch_or_another_model_fails_before_any_change(tmp_path):
    path, _, _ = _saved(tmp_path)
    wider = MLP(hidden=16)
    before = {n: p.asnumpy().copy() for n, p in wider.parameters_and_names()}
    with pytest.raises(dcp.CheckpointError, match=r"'model\.down\.bias'|'model\.up\.weight'.*holds shape \(12, 6\)"):
        dcp.load({"model": dcp.get_model_state_dict(wider)}, checkpoint_id=path)
    _unchanged(wider, before)
    other = nn.Dense(3, 3)
    with pytest.raises(dcp.CheckpointError, match="not in checkpoint .*'model.weight'.*another model"):
        dcp.load({"model": dcp.get_model_state_dict(other)}, checkpoint_id=path)


_KILL_SCRIPT = """
import sys, numpy as np
from hyper_parallel_ms import checkpoint as dcp
path, i = sys.argv[1], 0
while True:
    i += 1
    dcp.save({"w": np.full((1 << 20,), float(i), np.float32), "i": i}, checkpoint_id=path)
    print(i, flush=True)
"""


def test_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    path = str(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, path], stdout=subprocess.PIPE, env=env, text=True)
    try:
        for _ in range(3):                  # let a few saves commit, then kill during a later one
            assert proc.stdout.readline(), "the saving process died"
        time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    state = {"w": np.zeros((1 << 20,), np.float32), "i": 0}
    dcp.load(state, checkpoint_id=path)
    assert state["i"] >= 3 and np.all(state["w"] == float(state["i"]))
    with pytest.raises(dcp.CheckpointError, match="was never committed"):
        os.makedirs(str(tmp_path / "never.partial"))
        dcp.load(state, checkpoint_id=str(tmp_path / "never"))
    meta = json.load(open(os.path.join(path, "metadata.json")))
    assert meta["values"]["i"] == state["i"]


def test_a_save_dying_between_the_renames_leaves_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "c")
    dcp.save({"w": np.ones(3, np.float32)}, checkpoint_id=path)
    os.replace(path, path + ".old")                     # the state between commit's two renames
    state = {"w": np.zeros(3, np.float32)}
    dcp.load(state, checkpoint_id=path)
    assert state["w"].tolist() == [1, 1, 1]
    dcp.save({"w": np.full(3, 2, np.float32)}, checkpoint_id=path)
    dcp.load(state, checkpoint_id=path)
    assert state["w"].tolist() == [2, 2, 2] and not os.path.exists(path + ".old")


def test_a_save_over_an_existing_checkpoint_replaces_it_atomically(tmp_path):
    path = str(tmp_path / "c")
    dcp.save({"w": np.ones(3, np.float32), "a": np.full(2, 7, np.int64)}, checkpoint_id=path)
    reading = dcp.open_checkpoint(path)                 # a reader that has opened the data file
    assert reading.read_box("w", (0,), (3,)).tolist() == [1, 1, 1]
    late = dcp.open_checkpoint(path)                    # a reader that has read the metadata only
    dcp.save({"w": np.full(3, 2, np.float32), "b": np.zeros(1, np.float32)}, checkpoint_id=path)
    assert sorted(os.listdir(tmp_path)) == ["c"]        # no .old, no .partial left
    assert sorted(os.listdir(path)) == ["metadata.json", "rank_0.safetensors"]
    state = {"w": np.zeros(3, np.float32), "b": np.ones(1, np.float32)}
    dcp.load(state, checkpoint_id=path)
    assert state["w"].tolist() == [2, 2, 2] and state["b"].tolist() == [0]
    with pytest.raises(dcp.CheckpointError, match="not in checkpoint .*: 'a'"):
        dcp.load({"a": np.zeros(2, np.int64)}, checkpoint_id=path)       # nothing of the old one left
    # the first reader still reads the old checkpoint whole; the second is refused, not mixed
    assert reading.read_box("a", (0,), (2,)).tolist() == [7, 7] and reading.read_box("w", (0,), (3,)).tolist() == [1] * 3
    with pytest.raises(dcp.CheckpointError, match="'w'.*was replaced by another save while it was being read"):
        late.read_box("w", (0,), (3,))


def test_a_save_failing_midway_leaves_the_old_checkpoint_whole(tmp_path):
    path = str(tmp_path / "c")
    dcp.save({"w": np.ones(3, np.float32), "step": 1}, checkpoint_id=path)

    class DiesWriting(dcp.FileSystemWriter):
        def write_data(self, rank, arrays, checksums):
            with open(os.path.join(path + ".partial", "rank_0.safetensors"), "wb") as f:
                f.write(b"\0" * 100)                    # half a file, then the disk fills up
            raise OSError("No space left on device")

    class DiesCommitting(dcp.FileSystemWriter):
        def finish(self, metadata):
            os.replace(path, path + ".old")              # dies between the two renames of the commit
            raise OSError("killed")
    for writer, cause in ((DiesWriting(), "No space left"), (DiesCommitting(), "killed")):
        with pytest.raises(dcp.CheckpointError, match=cause):
            dcp.save({"w": np.full(3, 2, np.float32), "step": 2}, checkpoint_id=path, storage_writer=writer)
        state = {"w": np.zeros(3, np.float32), "step": 0}
        dcp.load(state, checkpoint_id=path)
        assert state["w"].tolist() == [1, 1, 1] and state["step"] == 1
    dcp.save({"w": np.full(3, 3, np.float32), "step": 3}, checkpoint_id=path)        # the next save recovers
    dcp.load(state, checkpoint_id=path)
    assert state["step"] == 3 and sorted(os.listdir(tmp_path)) == ["c"]
