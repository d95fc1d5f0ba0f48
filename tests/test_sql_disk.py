"""A small, full or unusable disk tier from SQL: the coordinator starts whatever the spill
directory's free space (measured with what fits, or the stated default), shows it in
``tensile.memory``, and a training whose spill does not fit fails alone with SQLSTATE 53100 while
the others go on; a coordinator that cannot start says why in the error; and a dropped, replaced
or redeployed model's layers leave the device weight cache at once.

The small disk tiers are real file systems: tmpfs mounts of a few hundred KiB, owned by the
server's OS user. Mounting needs root (as CI runs); elsewhere those tests are skipped."""

from __future__ import annotations

import os
import pwd
import subprocess
import tempfile

import psycopg
import pytest

from conftest import wait_until
from sql_helpers import assert_nothing_left, train
from tensile_db.cluster import SERVER_USER
from tensile_db.scheduler.cost import DEFAULT_DISK_BYTES_PER_S

pytestmark = pytest.mark.db

#: Device and host bytes of a training whose weights and Adam state (5.7 MB) cannot stay in a
#: host budget of 2 MB: it spills.
SPILLING = '{"layers": [' + ", ".join(['{"dense": 256}'] * 8) + ']}'
SPILLING_OPTIONS = '{"epochs": 1, "optimizer": "adam", "test_size": 0, "replace": true}'
#: A training that fits the device budget: nothing of it leaves the device.
SMALL_OPTIONS = '{"epochs": 1, "test_size": 0, "replace": true}'


@pytest.fixture
def tiny_tmpfs(cluster):
    """``tiny_tmpfs(size, fill=False)``: the path of a new tmpfs of ``size`` bytes, mode 0700,
    owned by the server's OS user; with ``fill``, filled to the last byte. Unmounted afterwards
    (request it before ``settings``, so that the coordinator using it has stopped by then). Skips
    where mounting is not allowed."""
    mounts = []

    def make(size: int, fill: bool = False) -> str:
        path = tempfile.mkdtemp(prefix="tensile-disk-")
        os.chmod(path, 0o755)
        user = pwd.getpwnam(SERVER_USER) if cluster.as_root else pwd.getpwuid(os.getuid())
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},uid={user.pw_uid},gid={user.pw_gid},mode=0700",
                               "tmpfs", path], capture_output=True, text=True)
        if done.returncode:
            os.rmdir(path)
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): these tests need root")
        mounts.append(path)
        if fill:
            fd = os.open(os.path.join(path, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                while os.write(fd, b"\0" * 4096):
                    pass
            except OSError:                                 # no space left: full
                pass
            finally:
                os.close(fd)
        return path

    yield make
    for path in mounts:
        subprocess.run(["umount", "-l", path], check=False)
        os.rmdir(path)


@pytest.fixture
def settings(cluster, conn):
    """``settings({...})`` writes server settings and stops the coordinator, so that the next call
    starts one with them; the defaults come back afterwards."""
    def configure(values: dict[str, str]) -> None:
        conn.execute("SELECT tensile.stop_coordinator()")
        cluster.configure(values)

    yield configure
    configure({"tensile.spill_dir": "''", "tensile.host_budget": "'1GB'"})


def coordinator_log(cluster) -> str:
    return (cluster.data_dir / "tensile_coordinator" / "coordinator.log").read_text(errors="replace")


@pytest.mark.parametrize("size, fill", [(512 << 10, False), (64 << 10, True)], ids=["small", "full"])
def test_a_small_or_full_disk_tier_stops_only_the_training_that_spills(tiny_tmpfs, settings, cluster, conn, digits,
                                                                       size, fill):
    spill = tiny_tmpfs(size, fill)
    settings({"tensile.spill_dir": f"'{spill}'", "tensile.host_budget": "'2MB'"})
    train(conn, "t_disk_small", options=SMALL_OPTIONS)
    free, read, write = conn.execute("SELECT disk_free_bytes, disk_read_bytes_per_s, disk_write_bytes_per_s "
                                     "FROM tensile.memory").fetchone()
    assert 0 <= free <= size and (free == 0) == fill
    assert read == write == DEFAULT_DISK_BYTES_PER_S           # too little room to measure
    assert f"disk tier {spill}: not measured" in coordinator_log(cluster)

    with pytest.raises(psycopg.Error) as info:
        train(conn, "t_disk_spilling", architecture=SPILLING, options=SPILLING_OPTIONS)
    assert info.value.sqlstate == "53100"
    message = str(info.value)
    assert "the disk tier is full" in message and f"tensile.spill_dir {spill} has" in message
    assert "bytes free" in message and "tensile.host_budget" in message
    assert conn.execute("SELECT count(*) FROM tensile.models WHERE name = 't_disk_spilling'").fetchone()[0] == 0

    train(conn, "t_disk_small", options=SMALL_OPTIONS)      # the coordinator serves on
    assert_nothing_left(conn)
    assert conn.execute("SELECT disk_bytes FROM tensile.memory").fetchone()[0] == 0


def test_a_disk_tier_with_room_is_measured_with_what_fits(tiny_tmpfs, settings, conn, digits):
    spill = tiny_tmpfs(8 << 20)
    settings({"tensile.spill_dir": f"'{spill}'"})
    train(conn, "t_disk_small", options=SMALL_OPTIONS)
    free, read = conn.execute("SELECT disk_free_bytes, disk_read_bytes_per_s FROM tensile.memory").fetchone()
    assert 0 < free <= 8 << 20 and read != DEFAULT_DISK_BYTES_PER_S


def test_a_coordinator_that_cannot_start_says_why(settings, conn, digits):
    fd, not_a_directory = tempfile.mkstemp(prefix="tensile-not-a-directory-")
    os.close(fd)
    settings({"tensile.spill_dir": f"'{not_a_directory}'"})
    with pytest.raises(psycopg.Error) as info:
        train(conn, "t_disk_small", options=SMALL_OPTIONS)
    assert info.value.sqlstate == "08006"
    assert "could not start the coordinator" in info.value.diag.message_primary
    assert not_a_directory in info.value.diag.message_primary            # the cause, in one line
    assert "\n" not in info.value.diag.message_primary
    assert "coordinator.log" in info.value.diag.message_detail
    os.unlink(not_a_directory)


def weight_cache(conn) -> tuple[int, int]:
    return conn.execute("SELECT in_use_bytes, weight_cache_bytes FROM tensile.memory").fetchone()


def serve(conn, name: str) -> None:
    conn.execute(f"SELECT count(*) FROM tensile.predict_batch('{name}', 'SELECT * FROM digits_test')").fetchone()


def test_dropping_or_deploying_away_from_a_served_model_gives_its_cached_layers_back(conn, digits):
    conn.execute("SELECT tensile.stop_coordinator()")      # a cache of this test's models only
    train(conn, "t_cached", options=SMALL_OPTIONS)
    train(conn, "t_cached_other", options=SMALL_OPTIONS)
    serve(conn, "t_cached_other")
    before = weight_cache(conn)
    serve(conn, "t_cached")
    assert weight_cache(conn)[1] > before[1]
    conn.execute("SELECT tensile.drop_model('t_cached')")
    assert weight_cache(conn) == before                      # at once, not when room is needed

    train(conn, "t_cached_other", options='{"epochs": 1, "test_size": 0}')   # version 2, deployed
    assert weight_cache(conn)[1] == 0                        # version 1's layers went
    serve(conn, "t_cached_other")
    cached = weight_cache(conn)[1]
    assert cached > 0
    conn.execute("SELECT tensile.deploy('t_cached_other', 1)")
    assert weight_cache(conn)[1] == 0
    assert wait_until(lambda: conn.execute("SELECT served_models FROM tensile.memory").fetchone()[0] == 0)
    conn.execute("SELECT tensile.drop_model('t_cached_other')")
