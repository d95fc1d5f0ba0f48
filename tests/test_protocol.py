"""The coordinator wire protocol over an in-process ``multiprocessing`` pipe.

Headers and arrays must round trip exactly; anything malformed or outside the allowed dtypes is
refused with :class:`ProtocolError` before any data is interpreted; errors cross the pipe as
the same :mod:`tensile_db.errors` class. Last, the command line a backend starts a coordinator
with: what ``StartSpec`` holds reaches the ``Coordinator``, and a bad value is refused by name.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import mmap
import os
import socket
import threading
from multiprocessing.connection import Pipe

import numpy as np
import pytest

from tensile_db.coordinator import __main__ as coordinator_main
from tensile_db.coordinator import client as coordinator_client
from tensile_db.coordinator import protocol
from tensile_db.errors import (
    WIRE_ERRORS,
    CoordinatorUnavailable,
    InvalidArgument,
    JobCancelled,
    ModelNotFound,
    ProtocolError,
    TensileError,
)
from tensile_db.scheduler import POLICIES


@pytest.fixture
def pipe():
    a, b = Pipe()
    yield a, b
    a.close()
    b.close()


def test_header_only_round_trip(pipe):
    a, b = pipe
    header = {"type": "ping", "n": 3, "nested": {"x": [1, 2.5, None, "é"]}, "flag": True}
    protocol.send(a, header)
    got, arrays = protocol.recv(b)
    assert got == header and arrays == {}


def test_arrays_round_trip_exactly(pipe):
    a, b = pipe
    rng = np.random.default_rng(0)
    f = rng.standard_normal((7, 3)).astype(np.float32)
    f[0, :3] = [np.nan, -0.0, np.inf]
    arrays = {
        "x": f,
        "y": rng.integers(-5, 5, size=11).astype(np.int32),
        "empty": np.zeros((0, 4), dtype=np.float64),
        "big": np.arange(6, dtype=">f8").reshape(2, 3),          # big-endian input
        "mask": np.array([True, False, True]),
        "u8": np.arange(5, dtype=np.uint8),
        "scalar": np.array(2.5, dtype=np.float32),
        "strided": np.arange(20, dtype=np.int64).reshape(4, 5)[:, ::2],  # not contiguous
    }
    protocol.send(a, {"type": "train", "name": "m"}, arrays)
    header, got = protocol.recv(b)
    assert header == {"type": "train", "name": "m"}             # "arrays" metadata is consumed
    assert list(got) == list(arrays)
    for name, sent in arrays.items():
        assert got[name].dtype == sent.dtype, name
        assert got[name].shape == sent.shape, name
        assert np.array_equal(got[name], sent, equal_nan=sent.dtype.kind == "f"), name
    assert np.array_equal(got["x"].view(np.uint32), f.view(np.uint32))   # bit exact, -0.0 and NaN
    assert got["big"].dtype.byteorder == ">"


def test_several_messages_in_sequence(pipe):
    a, b = pipe
    for i in range(3):
        protocol.send(a, {"type": "progress", "i": i}, {"v": np.full(i, i, dtype=np.int16)})
    for i in range(3):
        header, arrays = protocol.recv(b)
        assert header["i"] == i and np.array_equal(arrays["v"], np.full(i, i, dtype=np.int16))


def _raw(conn, header, *frames: bytes) -> None:
    conn.send_bytes(json.dumps(header).encode())
    for f in frames:
        conn.send_bytes(f)


@pytest.mark.parametrize("dtype", ["|O", "<U4", "|S4", "|V8", "<M8[s]", "<c8"])
def test_refuses_dtypes_outside_bool_int_float(pipe, dtype):
    a, b = pipe
    _raw(a, {"type": "x", "arrays": [{"name": "bad", "dtype": dtype, "shape": [2]}]}, b"\0" * 16)
    with pytest.raises(ProtocolError, match="unsupported dtype"):
        protocol.recv(b)


def test_refuses_object_array(pipe):
    a, b = pipe
    # an object array described as send() would describe it: the receiver must not build it
    obj = np.array([object(), object()], dtype=object)
    _raw(a, {"type": "x", "arrays": [{"name": "o", "dtype": obj.dtype.str, "shape": [2]}]}, b"\0" * 16)
    with pytest.raises(ProtocolError, match="'o'"):
        protocol.recv(b)


@pytest.mark.parametrize("nbytes", [0, 11, 13, 24])
def test_refuses_byte_count_mismatch(pipe, nbytes):
    a, b = pipe
    _raw(a, {"type": "x", "arrays": [{"name": "v", "dtype": "<f4", "shape": [3]}]}, b"\1" * nbytes)
    with pytest.raises(ProtocolError, match="do not match"):
        protocol.recv(b)


@pytest.mark.parametrize("frame", [b"{not json", b"\xff\xfe", b"", b'{"type": 1}', b"[]", b'"ping"', b"{}"])
def test_refuses_malformed_header(pipe, frame):
    a, b = pipe
    a.send_bytes(frame)
    with pytest.raises(ProtocolError):
        protocol.recv(b)


def test_recv_raises_eof_when_peer_closed():
    a, b = Pipe()
    a.close()
    with pytest.raises(EOFError):
        protocol.recv(b)
    b.close()


@pytest.mark.parametrize("cls", [InvalidArgument, ModelNotFound, JobCancelled, CoordinatorUnavailable,
                                 ProtocolError, TensileError])
def test_errors_keep_their_class(pipe, cls):
    a, b = pipe
    protocol.send_error(a, cls("what went wrong: 42"))
    header, arrays = protocol.recv(b)
    assert header["type"] == "error" and header["error"] == cls.__name__ and not arrays
    with pytest.raises(TensileError) as info:
        protocol.raise_if_error(header)
    assert type(info.value) is cls
    assert str(info.value) == "what went wrong: 42"


def test_non_tensile_exception_becomes_internal_error(pipe):
    a, b = pipe
    protocol.send_error(a, ZeroDivisionError("division by zero"))
    header, _ = protocol.recv(b)
    with pytest.raises(TensileError) as info:
        protocol.raise_if_error(header)
    assert type(info.value) is TensileError
    assert "internal error" in str(info.value) and "ZeroDivisionError" in str(info.value)


def test_unknown_error_name_becomes_tensile_error():
    with pytest.raises(TensileError) as info:
        protocol.raise_if_error({"type": "error", "error": "SystemExit", "message": "nope"})
    assert type(info.value) is TensileError and str(info.value) == "nope"


def test_raise_if_error_passes_other_headers_through():
    header = {"type": "result", "metrics": {}}
    assert protocol.raise_if_error(header) is header


def test_wire_errors_are_tensile_errors():
    assert all(issubclass(cls, TensileError) and cls.__name__ == name for name, cls in WIRE_ERRORS.items())


def test_out_of_memory_keeps_its_byte_counts_across_the_wire():
    from tensile_db.errors import DeviceOutOfMemory

    a, b = Pipe()
    protocol.send_error(a, DeviceOutOfMemory(4096, 1024, 2048, "op dense0"))
    header, _ = protocol.recv(b)
    with pytest.raises(DeviceOutOfMemory) as info:
        protocol.raise_if_error(header)
    assert (info.value.requested_nbytes, info.value.in_use_nbytes, info.value.budget_nbytes) == (4096, 1024, 2048)
    assert "requested 4,096 bytes" in str(info.value)


# --- the command line that starts a coordinator ------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_start_command_carries_the_policy_to_the_coordinator(monkeypatch, tmp_path, policy):
    made = {}

    class Recorder:
        def __init__(self, *args, **kwargs):
            made["args"], made["kwargs"] = args, kwargs

        def start(self):
            return None                  # another coordinator holds the lock: nothing to serve

    monkeypatch.setattr(coordinator_main, "Coordinator", Recorder)
    argv = coordinator_client.command(str(tmp_path), coordinator_client.StartSpec(policy=policy, max_active_jobs=3))
    assert coordinator_main.main(argv[argv.index("tensile_db.coordinator") + 1:]) == 0
    assert made["kwargs"]["policy"] == policy
    assert made["args"][0] == str(tmp_path) and made["args"][3] == 3


def test_a_start_that_fails_logs_its_cause_on_one_line_where_the_backend_finds_it(monkeypatch, tmp_path, caplog):
    class Failing:
        def __init__(self, *args, **kwargs):
            pass

        def start(self):
            raise TensileError("cannot use spill directory /nowhere:\n  no such directory")

    monkeypatch.setattr(coordinator_main, "Coordinator", Failing)
    argv = coordinator_client.command(str(tmp_path), coordinator_client.StartSpec())
    with caplog.at_level(logging.ERROR):
        assert coordinator_main.main(argv[argv.index("tensile_db.coordinator") + 1:]) == 1
    log = tmp_path / "coordinator.log"
    log.write_text("an earlier run's line\n" + caplog.text)
    offset = len("an earlier run's line\n")
    assert coordinator_client.start_failure(str(log), offset) == \
        "cannot use spill directory /nowhere: no such directory"
    log.write_text("an earlier run's line\nusage: ...\npython -m tensile_db.coordinator: error: --budget must be ...\n")
    assert coordinator_client.start_failure(str(log), offset) == \
        "python -m tensile_db.coordinator: error: --budget must be ..."          # no cause line: the last line
    assert coordinator_client.start_failure(str(log), log.stat().st_size) is None


def test_default_policy_is_tensile():
    assert POLICIES[0] == "tensile" and coordinator_client.StartSpec().policy == "tensile"


def test_unknown_policy_on_the_command_line_is_refused(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(coordinator_main, "Coordinator", None)     # must not be reached
    with pytest.raises(SystemExit) as info:
        coordinator_main.main(["--socket-dir", str(tmp_path), "--policy", "belady"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--policy: invalid choice: 'belady'" in err
    assert all(repr(p) in err for p in POLICIES)


# --- shared arrays (Note [Shared arrays]) ----------------------------------------------------------


def _mapped(array: np.ndarray) -> bool:
    """Whether ``array`` views a memory mapping (a shared memory file) rather than bytes received."""
    while isinstance(array, np.ndarray):
        array = array.base
    return isinstance(array.obj if isinstance(array, memoryview) else array, mmap.mmap)


def _large(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((70_000, 5)).astype(np.float32)      # 1.4 MB: over the threshold
    x[0, :3] = [np.nan, -0.0, np.inf]
    return {"x": x, "y": rng.integers(0, 3, size=70_001).astype(np.int8), "none": np.zeros((0, 2)),
            "flags": np.array([True, False, True]), "be": np.arange(5, dtype=">i4")}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_large_arrays_arrive_in_a_shared_memory_file_exactly_and_read_only(pipe):
    a, b = pipe
    protocol.accept_shared(a)
    arrays = _large()
    before = _open_fds()
    protocol.send(a, {"type": "train"}, arrays)
    protocol.send(a, {"type": "next"}, {"small": np.arange(3)})   # the connection stays in step
    header, got = protocol.recv(b)
    assert header == {"type": "train"} and list(got) == list(arrays)
    for name, want in arrays.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        assert got[name].tobytes() == np.asarray(want, order="C").tobytes()
        assert _mapped(got[name]) and not got[name].flags.writeable
        assert got[name].ctypes.data % protocol.SHARED_ALIGN == 0 or got[name].size == 0
    header, small = protocol.recv(b)
    assert header == {"type": "next"} and small["small"].tolist() == [0, 1, 2] and not _mapped(small["small"])
    del got                                      # the mapping (and Python's handle on it) goes with the views
    assert _open_fds() == before


def test_arrays_go_in_frames_to_an_end_that_has_not_said_it_takes_them(pipe):
    a, b = pipe
    arrays = _large()
    sender = threading.Thread(target=protocol.send, args=(a, {"type": "train"}, arrays))
    sender.start()
    _, got = protocol.recv(b)
    sender.join()
    assert not any(_mapped(v) for v in got.values()) and got["x"].tobytes() == arrays["x"].tobytes()
    protocol.accept_shared(a)
    protocol.send(a, {"type": "t"}, {"x": np.ones(1000, np.float32)})          # small: frames still
    _, got = protocol.recv(b)
    assert got["x"].sum() == 1000 and not _mapped(got["x"])


def _sealed_rows(nbytes: int = 1 << 30, at: int = 512 << 20) -> tuple[mmap.mmap, np.ndarray]:
    """A sparse memory file of ``nbytes`` with 70,000 x 5 float32 rows written at offset ``at``,
    sealed and mapped through :func:`protocol.map_sealed`, as the backend's scan makes it; the
    rows as a view of the mapping."""
    rows = np.arange(350_000, dtype=np.float32).reshape(70_000, 5)
    fd = os.memfd_create("scan", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        assert os.pwrite(fd, rows.tobytes(), at) == rows.nbytes
        mapping = protocol.map_sealed(fd)
    finally:
        os.close(fd)
    return mapping, np.frombuffer(mapping, np.float32, count=rows.size, offset=at).reshape(rows.shape)


def test_arrays_in_a_sealed_file_go_as_they_lie_to_an_end_that_takes_two_files(pipe):
    a, b = pipe
    before = _open_fds()
    mapping, rows = _sealed_rows()
    protocol.accept_shared(a, files=2)
    arrays = {"y": np.arange(70_000, dtype=np.int32), "x": rows, "empty": rows[:0], "small": np.ones(3)}
    protocol.send(a, {"type": "train"}, arrays)
    raw = json.loads(b.recv_bytes())                   # the header as sent: x and empty by reference
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(b.fileno())) as sock:
        _, fds, _, _ = socket.recv_fds(sock, 1, 4)
    sizes = [os.fstat(fd).st_size for fd in fds]
    for fd in fds:
        os.close(fd)
    shared = raw["shared"]
    assert len(fds) == 2 and sizes[1] == 1 << 30 and shared["nbytes"] == sizes
    assert shared["files"] == [0, 1, 0, 0] and shared["offsets"][1] == 512 << 20    # empty: not in the file
    protocol.send(a, {"type": "train"}, arrays)
    header, got = protocol.recv(b)
    assert header == {"type": "train"} and list(got) == list(arrays)
    for name, want in arrays.items():
        assert got[name].tobytes() == want.tobytes() and got[name].shape == want.shape
        assert _mapped(got[name]) and not got[name].flags.writeable
    del got, rows, mapping, arrays, want              # the sealed file's descriptor goes with its mapping
    assert _open_fds() == before


def test_arrays_in_a_sealed_file_are_copied_to_an_end_that_takes_one_file(pipe):
    a, b = pipe
    mapping, rows = _sealed_rows(nbytes=8 << 20, at=4096)
    protocol.accept_shared(a)
    protocol.send(a, {"type": "train"}, {"x": rows, "y": np.zeros(10, np.int32)})
    raw = json.loads(b.recv_bytes())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(b.fileno())) as sock:
        _, fds, _, _ = socket.recv_fds(sock, 1, 4)
    for fd in fds:
        os.close(fd)
    assert len(fds) == 1 and raw["shared"]["offsets"] == [0, rows.nbytes] and "files" not in raw["shared"]


def test_a_file_that_cannot_be_sealed_is_refused_by_map_sealed():
    fd = os.memfd_create("scan", os.MFD_CLOEXEC)        # made without MFD_ALLOW_SEALING
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(OSError):
            protocol.map_sealed(fd)
    finally:
        os.close(fd)


def _send_file(conn, header: dict, fds: list[int]) -> None:
    conn.send_bytes(json.dumps(header).encode())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno())) as sock:
        socket.send_fds(sock, [b"F"], fds)


def _memfd(nbytes: int, seal: bool = True) -> int:
    fd = os.memfd_create("test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    | fcntl.F_SEAL_WRITE)
    return fd


X4 = [{"name": "x", "dtype": "<f4", "shape": [4]}]


@pytest.mark.parametrize("arrays, nbytes, declared, seal, message", [
    (X4, 16, 16, False, "not a sealed memory file"),       # the sender could still shrink it under our views
    (X4, 16, 4096, True, "not a sealed memory file of 4096 bytes"),
    (X4, 8, 8, True, "outside the shared arrays"),         # 4 float32 do not fit 8 bytes
    ([{"name": "x", "dtype": "<f4", "shape": [2 ** 32, 2 ** 32]}], 16, 16, True, "outside the shared arrays"),
    ([{"name": "x", "dtype": "|O", "shape": [4]}], 16, 16, True, "unsupported dtype"),
])
def test_a_shared_file_that_could_change_or_does_not_hold_the_arrays_is_refused_in_step(
        pipe, arrays, nbytes, declared, seal, message):
    a, b = pipe
    before = _open_fds()
    fd = _memfd(nbytes, seal)
    try:
        _send_file(a, {"type": "t", "arrays": arrays, "shared": {"nbytes": declared, "offsets": [0]}}, [fd])
    finally:
        os.close(fd)
    protocol.send(a, {"type": "next"})
    with pytest.raises(ProtocolError, match=message):
        protocol.recv(b)
    assert protocol.recv(b)[0] == {"type": "next"} and _open_fds() == before


def test_a_shared_message_with_other_files_than_it_names_is_refused_and_closes_them(pipe):
    a, b = pipe
    before = _open_fds()
    read, write = os.pipe()
    try:
        for fds, message in (([_memfd(16), _memfd(16)], "came in 2 files"),
                             ([_memfd(16), _memfd(16), _memfd(16)], "3 descriptors, not one or two"),
                             ([read], "not a sealed memory file")):
            try:
                _send_file(a, {"type": "t", "arrays": X4, "shared": {"nbytes": 16, "offsets": [0]}}, fds)
            finally:
                for fd in fds:
                    if fd != read:
                        os.close(fd)
            with pytest.raises(ProtocolError, match=message):
                protocol.recv(b)
    finally:
        os.close(read)
        os.close(write)
    assert _open_fds() == before


@pytest.mark.parametrize("pong, shared", [({"type": "pong", "accepts_shared": True}, True), ({"type": "pong"}, False)])
def test_a_client_asks_once_whether_the_coordinator_takes_shared_arrays(pipe, pong, shared):
    a, b = pipe
    client = coordinator_client.CoordinatorClient(a, "unused")
    seen = []

    def coordinator() -> None:
        for _ in range(2):                        # two requests, one ping before the first only
            header, arrays = protocol.recv(b)
            if header["type"] == "ping":
                assert header["accepts_shared"] is True
                protocol.send(b, pong)
                header, arrays = protocol.recv(b)
            seen.append((header["type"], header.get("accepts_shared"), _mapped(arrays["x"])))
            protocol.send(b, {"type": "ok"})
    server = threading.Thread(target=coordinator)
    server.start()
    for _ in range(2):
        assert client.request({"type": "train"}, _large())[0] == {"type": "ok"}
    server.join()
    assert seen == [("train", True, shared)] * 2


@pytest.mark.parametrize("pong, rows, two_files", [
    ({"type": "pong", "accepts_shared": True, "shared_files": 2, "rows": True}, True, True),
    ({"type": "pong", "accepts_shared": True}, False, False),          # a coordinator of an earlier version
])
def test_a_client_asks_once_whether_the_coordinator_takes_rows_by_index_and_two_files(pipe, pong, rows, two_files):
    a, b = pipe
    client = coordinator_client.CoordinatorClient(a, "unused")

    def coordinator() -> None:
        header, _ = protocol.recv(b)
        assert header["type"] == "ping"
        protocol.send(b, pong)
    server = threading.Thread(target=coordinator)
    server.start()
    assert client.takes_rows() is rows and client.takes_rows() is rows
    server.join()
    assert not b.poll(0.2)                                                  # one ping only
    assert (a in protocol._TWO_FILES) is two_files


def test_a_closed_mapping_is_no_longer_a_sealed_file_arrays_lie_in():
    mapping, rows = _sealed_rows(nbytes=8 << 20, at=4096)
    address, count = rows.ctypes.data, rows.size
    assert protocol._in_sealed(rows)[1:] == (4096, 8 << 20)
    del rows
    mapping.close()
    # an array at the address the rows had (memory mapped anew there would be another's): only
    # its address is looked at, never its values
    there = np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_float)), shape=(count,))
    assert protocol._in_sealed(there) is None
