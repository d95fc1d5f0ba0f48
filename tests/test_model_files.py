"""Model files, without PostgreSQL: a served model's weights written once per version to a file
of checksummed layer regions, array by array as they arrive over the socket, atomically (no
half-written file after an error or a crash), named by a hash, and read back layer by layer
with ``O_DIRECT`` (buffered on tmpfs) into any buffer; a corrupted region raises CorruptModel
naming the layer and the file is deleted; a restarted store serves from the file; outputs are
those of the host-served path bit for bit; the store holds none of the layers in host memory."""

from __future__ import annotations

import json
import mmap
import multiprocessing
import os
import stat
import tempfile
import threading
import tracemalloc

import numpy as np
import pytest

from model_helpers import cnn_spec, features, spec_of, weights_of
from tensile_db.coordinator import protocol
from tensile_db.errors import CorruptModel, ProtocolError
from tensile_db.inference import INFERENCE_JOB, files, layered
from tensile_db.inference.files import ALIGN_NBYTES, TEMP_PREFIX, ModelFiles, file_name
from tensile_db.inference.service import InferenceService
from tensile_db.memory.manager import MemoryManager
from tensile_db.memory.spill import SpillDir
from tensile_db.runtime import model as models
from tensile_db.runtime.device import CpuDevice
from tensile_db.runtime.program import Kind


def packed(spec, weights) -> list[np.ndarray]:
    """Each layer's arrays packed as the store packs them: float32, ``Node.weights`` order."""
    return [np.concatenate([weights[k].reshape(-1) for k in node.weights]).astype(np.float32)
            for node in spec.network.layered]


def read_layer(file, i) -> np.ndarray:
    out = np.empty(file.layers[i].nbytes, np.uint8)
    file.read_into(i, out)
    return out.view(np.float32)


def header(path) -> dict:
    with open(path, "rb") as f:
        prefix = f.read(files.PREFIX.size)
        _, _, body_nbytes, _, _ = files.PREFIX.unpack(prefix)
        return json.loads(f.read(body_nbytes))


def flip_byte(path, offset) -> None:
    """Flip the high bits of the byte at ``offset`` (a float32's sign and exponent when it is the
    fourth byte of one: the value changes by orders of magnitude)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x40]))


def entries(directory) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.fixture
def model_dir(tmp_path):
    return str(tmp_path / "models")


@pytest.fixture
def mfiles(model_dir):
    os.makedirs(model_dir, mode=0o700)
    return ModelFiles(model_dir)


# --- writing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("task", ["classification", "regression"])
def test_a_written_file_reads_back_every_layer_and_the_scaling_exactly(mfiles, kind, task):
    spec = spec_of(task) if kind == "mlp" else cnn_spec(task)
    w = weights_of(spec)
    file = mfiles.commit(mfiles.write(7, "1/alice/2024", "m", spec, w), spec)
    assert os.path.basename(file.path) == file_name(7, "1/alice/2024")
    assert [entries(mfiles.directory)] == [[file_name(7, "1/alice/2024")]]
    for i, expected in enumerate(packed(spec, w)):
        assert np.array_equal(read_layer(file, i), expected), i
        assert file.layers[i].offset % ALIGN_NBYTES == 0
    assert set(file.scaling) == {k for k in w if k[0] in "xy"}
    assert all(np.array_equal(file.scaling[k], w[k]) for k in file.scaling)
    assert stat.S_IMODE(os.stat(file.path).st_mode) == 0o600
    head = header(file.path)
    assert (head["model_id"], head["version"], head["layer_count"]) == (7, "1/alice/2024", len(spec.network.layered))
    file.close()


def test_the_file_name_is_a_hash_never_the_version_text(mfiles):
    spec = spec_of()
    hostile = "../../etc/x\n/..\x00"
    file = mfiles.commit(mfiles.write(1, hostile, "m", spec, weights_of(spec)), spec)
    name = os.path.basename(file.path)
    assert os.path.dirname(file.path) == mfiles.directory
    assert name == file_name(1, hostile) and len(name) == 64 + len(".model")
    assert set(name[:64]) <= set("0123456789abcdef")
    assert file_name(1, "v") != file_name(2, "v") != file_name(1, "w")
    file.close()


def test_arrays_arriving_out_of_order_or_in_another_float_dtype_give_the_same_file(mfiles, tmp_path):
    spec = spec_of()
    w = weights_of(spec)
    in_order = mfiles.commit(mfiles.write(1, "v", "m", spec, w), spec)
    shuffled = dict(reversed([(k, v.astype(np.float64)) for k, v in w.items()]))
    other = ModelFiles(str(tmp_path))
    reordered = other.commit(other.write(1, "v", "m", spec, shuffled), spec)
    with open(in_order.path, "rb") as a, open(reordered.path, "rb") as b:
        assert a.read() == b.read()
    in_order.close()
    reordered.close()


@pytest.mark.parametrize("breakage, message", [
    (lambda w: w.pop("W2"), r"weight W2 must be a float array of shape \(64, 128\), got nothing"),
    (lambda w: w.update(W2=w["W2"][:, :3]), r"weight W2 must be a float array of shape \(64, 128\), got float32"),
    (lambda w: w.update(extra=np.zeros(3, np.float32)), r"arrays the architecture has no use for \(extra\)"),
    (lambda w: w.update(W2=w["W2"].astype(np.int32)), r"weight W2 must be a float array"),
    (lambda w: w["b3"].__setitem__(0, np.nan), r"weight b3 has NaN or infinite values"),
    (lambda w: w["x_std"].__setitem__(0, np.inf), r"weight x_std has NaN or infinite values"),
])
def test_weights_that_do_not_fit_the_spec_leave_no_file_behind(mfiles, breakage, message):
    spec = spec_of()
    w = weights_of(spec)
    breakage(w)
    with pytest.raises(CorruptModel, match=message):
        mfiles.write(1, "v", "m", spec, w)
    assert entries(mfiles.directory) == []


def test_a_stream_that_fails_midway_leaves_no_file_behind(mfiles, monkeypatch):
    spec = spec_of()
    w = weights_of(spec)

    class Failing:
        declared = [(k, a.dtype, a.shape) for k, a in w.items()]

        def __iter__(self):
            for n, (k, a) in enumerate(w.items()):
                if n == 5:
                    raise ProtocolError("the connection broke")
                yield k, a

    seen = []
    real_write = files._pwrite_all
    monkeypatch.setattr(files, "_pwrite_all", lambda fd, data, offset: (seen.append(entries(mfiles.directory)),
                                                                        real_write(fd, data, offset)))
    with pytest.raises(ProtocolError):
        mfiles.write(1, "v", "m", spec, Failing())
    assert seen and all(len(e) == 1 and e[0].startswith(TEMP_PREFIX) for e in seen)   # it was being written
    assert entries(mfiles.directory) == []


def test_a_temporary_file_a_crash_left_is_removed_and_committed_files_are_kept(mfiles):
    spec = spec_of()
    kept = mfiles.commit(mfiles.write(1, "v", "m", spec, weights_of(spec)), spec)
    kept.close()
    left = os.path.join(mfiles.directory, TEMP_PREFIX + "abc.model")
    with open(left, "wb") as f:
        f.write(b"half a model")
    again = ModelFiles(mfiles.directory)
    assert entries(again.directory) == [file_name(1, "v")]
    assert [p for p, _ in again.listing()] == [kept.path]


def test_writing_holds_one_array_at_a_time(mfiles):
    """A stream of 8 arrays of 4 MiB: the write's peak of traced allocations stays near one
    array (NumPy reports its buffers to tracemalloc), not the model's 32 MiB."""
    spec = spec_of(hidden=[{"dense": 1024}] * 8, n_features=1024, n_outputs=4)
    shapes = spec.network.weight_shapes()

    class Generated:
        declared = [(k, np.dtype(np.float32), s) for k, s in shapes.items()]

        def __iter__(self):
            rng = np.random.default_rng(0)
            for k, s in shapes.items():
                yield k, rng.standard_normal(s, dtype=np.float32)

    array_nbytes = 1024 * 1024 * 4
    tracemalloc.start()
    try:
        file = mfiles.commit(mfiles.write(1, "v", "m", spec, Generated()), spec)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert file.nbytes > 8 * array_nbytes
    assert array_nbytes <= peak < 2.5 * array_nbytes, f"peak {peak:,} bytes"     # it sees an array, not all
    file.close()


def test_a_message_received_as_a_stream_is_written_frame_by_frame(mfiles):
    spec = spec_of()
    w = weights_of(spec)
    a, b = multiprocessing.Pipe()
    sender = threading.Thread(target=lambda: (protocol.send(a, {"type": "weights"}, w),
                                              protocol.send(a, {"type": "next"})))
    sender.start()
    head, stream = protocol.recv_stream(b)
    assert head["type"] == "weights" and [k for k, _, _ in stream.declared] == list(w)
    with stream:
        file = mfiles.commit(mfiles.write(1, "v", "m", spec, stream), spec)
    assert protocol.recv(b)[0]["type"] == "next"                      # the connection is in step
    assert all(np.array_equal(read_layer(file, i), p) for i, p in enumerate(packed(spec, w)))
    file.close()
    sender.join(5)


def test_a_stream_refused_midway_is_drained_so_the_connection_stays_in_step(mfiles):
    spec = spec_of()
    w = weights_of(spec)
    w["b3"][0] = np.inf
    a, b = multiprocessing.Pipe()
    sender = threading.Thread(target=lambda: (protocol.send(a, {"type": "weights"}, w),
                                              protocol.send(a, {"type": "next"})))
    sender.start()
    _, stream = protocol.recv_stream(b)
    with pytest.raises(CorruptModel, match="b3"), stream:
        mfiles.write(1, "v", "m", spec, stream)
    assert protocol.recv(b)[0]["type"] == "next"
    assert entries(mfiles.directory) == []
    sender.join(5)


# --- reading -----------------------------------------------------------------------------------


def test_a_corrupted_region_raises_corrupt_model_naming_the_layer_and_the_file_is_deleted(mfiles):
    spec = spec_of()
    w = weights_of(spec)
    file = mfiles.commit(mfiles.write(3, "1/bob/2024", "clf", spec, w), spec)
    flip_byte(file.path, file.layers[2].offset + 3)
    assert np.array_equal(read_layer(file, 1), packed(spec, w)[1])        # other layers still read
    with pytest.raises(CorruptModel, match=r"model 'clf' \(version 1/bob/2024\): layer 2 in its file "
                                           rf"{file.path} is corrupt: its checksum is [0-9a-f]{{8}}, the header says"):
        read_layer(file, 2)
    assert file.corrupt and entries(mfiles.directory) == []
    file.close()


def test_a_file_cut_short_raises_corrupt_model(mfiles):
    spec = spec_of()
    file = mfiles.commit(mfiles.write(3, "v", "m", spec, weights_of(spec)), spec)
    os.truncate(file.path, file.layers[-1].offset + 100)
    with pytest.raises(CorruptModel, match=rf"layer {len(file.layers) - 1} in its file .* cannot be read"):
        read_layer(file, len(file.layers) - 1)
    file.close()


@pytest.mark.parametrize("damage", ["magic", "header", "scaling", "other version", "other spec"])
def test_a_file_whose_header_does_not_hold_is_deleted_and_not_served(mfiles, damage):
    spec = spec_of()
    file = mfiles.commit(mfiles.write(3, "v", "m", spec, weights_of(spec)), spec)
    file.close()
    body = header(file.path)
    if damage == "magic":
        flip_byte(file.path, 0)
    elif damage == "header":
        flip_byte(file.path, files.PREFIX.size + 5)
    elif damage == "scaling":
        flip_byte(file.path, body["scaling"]["offset"] + 1)
    elif damage == "other version":              # a file under another version's name
        os.rename(file.path, mfiles.path(3, "w"))
        assert mfiles.open(3, "w", "m", spec) is None
        assert entries(mfiles.directory) == []
        return
    opened_spec = spec_of(hidden=[{"dense": 5}]) if damage == "other spec" else spec
    assert mfiles.open(3, "v", "m", opened_spec) is None
    assert entries(mfiles.directory) == []


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_reads_into_unaligned_buffers_direct_on_disk_and_buffered_on_tmpfs(tmp_path, where):
    if where == "tmpfs" and not os.path.isdir("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    spec = spec_of(hidden=[{"dense": 300}, {"dense": 77}])
    w = weights_of(spec)
    expected = packed(spec, w)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if where == "tmpfs" else str(tmp_path)) as directory:
        mf = ModelFiles(directory)
        file = mf.commit(mf.write(1, "v", "m", spec, w), spec)
        assert file.direct is _direct_ok(directory)
        for i, p in enumerate(expected):
            raw = np.empty(p.nbytes + 7, np.uint8)
            out = raw[3:3 + p.nbytes]                         # neither 512- nor 4-byte aligned
            file.read_into(i, out)
            assert np.array_equal(out.view(np.float32), p)
            aligned = np.frombuffer(mmap.mmap(-1, p.nbytes), np.uint8)     # page-aligned, as an arena block
            file.read_into(i, aligned)
            assert np.array_equal(aligned.view(np.float32), p)
        file.close()


def _direct_ok(directory) -> bool:
    path = os.path.join(directory, "probe")
    open(path, "wb").close()
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        os.unlink(path)


# --- the store -----------------------------------------------------------------------------------


def service(model_dir, budget=1 << 22, **manager_kw) -> InferenceService:
    os.makedirs(model_dir, mode=0o700, exist_ok=True)
    return InferenceService(MemoryManager(CpuDevice(), budget, **manager_kw), models_dir=model_dir)


def host_served(svc, spec, w):
    """The model as the store served it before model files: each layer a read-only tensor over
    its packed host buffer (``adopt(..., readonly=True)``)."""
    m = svc.store.add(99, "host", "host", spec, w)
    for i, p in enumerate(packed(spec, w)):
        svc.manager.free(m.layers[i])
        m.layers[i] = svc.manager.adopt(INFERENCE_JOB, f"host/layer{i}", Kind.WEIGHT, p, readonly=True)
    return m


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_file_served_outputs_are_the_host_served_outputs_bit_for_bit(model_dir, kind):
    spec = spec_of() if kind == "mlp" else cnn_spec()
    w, x = weights_of(spec), features(spec)
    svc = service(model_dir)
    host = host_served(svc, spec, w)
    expected, _ = layered.run(svc.manager, host, x, 2, 64, cache=False)
    for window in (1, 3):
        model = svc.store.checkout(1, "v") or svc.store.add(1, "v", "m", spec, w)
        out, stats = svc.predict(model, x, window, 64, cache=False)
        assert np.array_equal(out, expected), window
    np.testing.assert_allclose(expected, models.forward(spec, w, x), rtol=1e-5, atol=1e-6)
    svc.store.checkin(host)
    svc.manager.close()


def test_a_restarted_store_serves_from_the_file_without_the_weights(model_dir):
    spec = spec_of("regression")
    w, x = weights_of(spec), features(spec)
    svc = service(model_dir)
    model = svc.store.add(5, "v", "m", spec, w, database=3)
    expected, _ = svc.predict(model, x, 1, 64)
    path = model.file.path
    svc.manager.close()
    del svc, model

    again = service(model_dir)
    assert again.store.checkout(5, "v") is None                       # not open: needs its spec
    assert again.describe()["served_file_nbytes"] == os.path.getsize(path)
    model = again.store.checkout(5, "v", "m", spec, database=3)
    assert model is not None and model.file.path == path
    out, _ = again.predict(model, x, 2, 64)
    assert np.array_equal(out, expected)
    assert again.store.checkout(6, "v", "m", spec) is None               # another id: no file
    again.manager.close()


def test_a_corrupt_layer_ends_the_call_and_the_model_is_read_again(model_dir):
    spec = spec_of()
    w, x = weights_of(spec), features(spec)
    svc = service(model_dir)
    model = svc.store.add(1, "v", "m", spec, w)
    expected, _ = svc.predict(model, x, 1, 64, cache=False)
    svc.manager.close()

    # A new store (a restarted coordinator: no layer is cached anywhere) on the damaged file.
    flip_byte(model.file.path, model.file.layers[3].offset + 7)
    svc = service(model_dir)
    model = svc.store.checkout(1, "v", "m", spec)
    with pytest.raises(CorruptModel, match=r"layer 3 in its file .* is corrupt"):
        svc.predict(model, x, 1, 64, cache=False)
    assert model.corrupt and svc.store.get(1, "v") is None and entries(model_dir) == []
    assert all(t not in svc.manager.tensors() for t in model.layers)        # forgotten
    assert svc.manager.in_use_nbytes == 0 and not svc.describe()["inference_calls"]
    svc.manager.check()
    assert svc.store.checkout(1, "v", "m", spec) is None                 # so the caller sends the weights
    model = svc.store.add(1, "v", "m", spec, w)
    out, _ = svc.predict(model, x, 1, 64, cache=False)
    assert np.array_equal(out, expected) and entries(model_dir) == [file_name(1, "v")]
    svc.manager.close()


def test_the_store_holds_no_layer_in_host_memory(model_dir, tmp_path):
    """With no host budget for the manager's cache, a call's layers live in the arena while its
    window holds them and in the file otherwise: ``tensile.memory``'s served host bytes are the
    scaling arrays and the read buffers, its file bytes the file's size."""
    spec = spec_of(hidden=[{"dense": 256}] * 6, n_features=256)
    w, x = weights_of(spec), features(spec, n=300)
    svc = service(model_dir, budget=1 << 24, host_budget_nbytes=0, spill=SpillDir(str(tmp_path / "spill")))
    model = svc.store.add(1, "v", "m", spec, w)
    out, stats = svc.predict(model, x, 1, 64, cache=False)
    assert stats.weight_loads == len(model.layers) * stats.batches           # every batch read every layer
    np.testing.assert_allclose(out, models.forward(spec, w, x), rtol=1e-5, atol=1e-6)
    assert all(t.host is None and t.offset is None for t in model.layers)
    assert svc.manager.host_tier.cache_nbytes == 0
    d = svc.describe()
    scaling = sum(w[k].nbytes for k in ("x_mean", "x_std"))
    assert scaling <= d["served_host_nbytes"] <= scaling + files.bounce_nbytes()
    assert d["served_host_nbytes"] < min(p.nbytes for p in packed(spec, w))
    assert d["served_file_nbytes"] == os.path.getsize(model.file.path) >= sum(p.nbytes for p in packed(spec, w))
    svc.manager.close()


def test_a_call_served_from_a_file_never_holds_the_model_in_host_memory(model_dir, tmp_path):
    """Python's and NumPy's allocations (traced) while a restarted store opens a model from its
    file and a call streams every layer through a window of one stay far below the model's size:
    only a layer in flight and a batch are ever on the host (the arena is a mapping of its own)."""
    spec = spec_of(hidden=[{"dense": 512}] * 12, n_features=64)
    w, x = weights_of(spec), features(spec, n=256)
    model_nbytes = sum(p.nbytes for p in packed(spec, w))                      # about 12 MB
    first = service(model_dir, budget=1 << 24)
    first.store.checkin(first.store.add(1, "v", "m", spec, w))
    first.manager.close()
    del w
    svc = service(model_dir, budget=1 << 24, host_budget_nbytes=0, spill=SpillDir(str(tmp_path / "spill")))
    tracemalloc.start()
    try:
        model = svc.store.checkout(1, "v", "m", spec)
        svc.predict(model, x, 1, 64, cache=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    largest = max(p.nbytes for p in packed(spec, weights_of(spec)))
    assert peak < 3 * largest < model_nbytes / 3, (peak, largest, model_nbytes)
    svc.store.checkin(model)
    svc.manager.close()


def test_a_retired_version_s_file_is_deleted_once_no_call_uses_it(model_dir):
    spec = spec_of()
    svc = service(model_dir)
    old = svc.store.add(1, "v", "m", spec, weights_of(spec, 0))
    svc.store.checkin(old)
    new = svc.store.add(2, "v", "m", spec, weights_of(spec, 1))
    assert entries(model_dir) == [file_name(2, "v")] and svc.store.get(1, "v") is None
    svc.store.checkin(new)
    svc.manager.close()


def test_files_beyond_the_limit_go_least_recently_used_first_and_open_models_beyond_theirs_are_closed(model_dir):
    spec = spec_of()
    svc = service(model_dir)
    store = svc.store
    for k in range(3):
        store.checkin(store.add(k, "v", f"m{k}", spec, weights_of(spec, k)))
    one = os.path.getsize(store.files.path(0, "v"))
    store.max_open_models = 1
    store.checkin(store.checkout(0, "v"))                # model 0 used last: 1 and 2 are closed, files kept
    assert [store.get(k, "v") is not None for k in range(3)] == [True, False, False]
    assert len(entries(model_dir)) == 3 and store.describe()["served_file_nbytes"] == 3 * one
    store.files_limit_nbytes = 2 * one
    store.checkin(store.checkout(0, "v"))
    assert entries(model_dir) == sorted([file_name(0, "v"), file_name(2, "v")])   # 1 was least recently used
    assert store.describe()["served_file_nbytes"] == 2 * one
    svc.manager.close()
