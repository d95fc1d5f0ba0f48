"""How to read a served model's layers from its file: the I/O method and the checksum.

A model file (:mod:`tensile_db.inference.files`) holds one region per layer, each starting at a
multiple of 4096 bytes. A call reads its layers one after another, each into memory of its own
(the arena block the layer is loaded into), and verifies each layer's checksum. This benchmark
writes such a file (``--layers`` regions of ``--layer-mib`` MiB of random bytes, by default 20 x
32 MiB = 640 MiB, the size of ``bench/disk_layering.py``'s model) and reads all of its layers in
one run with each method:

- ``buffered``: ``os.preadv`` at the region's offset into one reusable buffer (the page cache
  in between);
- ``direct``: the same with ``O_DIRECT`` into a page-aligned buffer (``mmap.mmap(-1, n)``): the
  disk straight into the buffer, the page cache bypassed;
- ``mmap``: the file mapped, ``madvise(MADV_SEQUENTIAL)`` on the map and ``MADV_WILLNEED`` on the
  next layer's range while the current one is copied out of the map into the reusable buffer;

each with the checksum ``crc32`` (``zlib.crc32``), ``blake2b`` (``hashlib.blake2b``, 8-byte
digest) or ``none`` (the I/O alone), computed over the buffer after the read.

*Cold*: the page cache is dropped before the run (``sync; echo 1 > /proc/sys/vm/drop_caches``,
as root only; without root the cold rows are left out and the output says so). *Warm*: the file
was read just before, so ``buffered`` and ``mmap`` read the page cache (``direct`` never does).
Runs are interleaved (every method, checksum and state once per repeat) and repeated; the table
prints medians with [min, max]. Also printed: each checksum alone on bytes in memory.

    python bench/layer_io.py [--dir DIR] [--layers 20] [--layer-mib 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import mmap
import os
import tempfile
import time
import zlib

import numpy as np
from tabulate import tabulate

from common import median_and_range

#: Regions start at multiples of this, bytes (as in a model file).
ALIGN_NBYTES = 4096
DROP_CACHES = "/proc/sys/vm/drop_caches"

CHECKSUMS = {
    "crc32": zlib.crc32,
    "blake2b": lambda buf: hashlib.blake2b(buf, digest_size=8).digest(),
    "none": lambda buf: None,
}


def write_file(path: str, layers: int, layer_nbytes: int) -> list[tuple[int, int]]:
    """A file of ``layers`` regions of ``layer_nbytes`` random bytes, each at a multiple of
    :data:`ALIGN_NBYTES` after one header block, fsynced; returns each region's (offset, nbytes)."""
    rng = np.random.default_rng(0)
    stride = -(-layer_nbytes // ALIGN_NBYTES) * ALIGN_NBYTES
    regions = [(ALIGN_NBYTES + i * stride, layer_nbytes) for i in range(layers)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for offset, nbytes in regions:
            os.pwrite(fd, rng.integers(0, 256, nbytes, dtype=np.uint8), offset)
        os.ftruncate(fd, regions[-1][0] + stride)
        os.fsync(fd)
    finally:
        os.close(fd)
    return regions


def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache; False where not allowed (not root)."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def read_all(method: str, path: str, regions, buffer: memoryview, checksum) -> None:
    """Read every region of ``path`` in order into ``buffer`` (page-aligned, as large as the
    largest region) with ``method``, computing ``checksum`` over each."""
    if method == "mmap":
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
                m.madvise(mmap.MADV_SEQUENTIAL)
                source = np.frombuffer(m, np.uint8)
                out = np.frombuffer(buffer, np.uint8)
                for i, (offset, nbytes) in enumerate(regions):
                    if i + 1 < len(regions):
                        m.madvise(mmap.MADV_WILLNEED, regions[i + 1][0], regions[i + 1][1])
                    np.copyto(out[:nbytes], source[offset:offset + nbytes])
                    checksum(buffer[:nbytes])
                del source
        finally:
            os.close(fd)
        return
    flags = os.O_RDONLY | (os.O_DIRECT if method == "direct" else 0)
    fd = os.open(path, flags)
    try:
        for offset, nbytes in regions:
            length = -(-nbytes // ALIGN_NBYTES) * ALIGN_NBYTES if method == "direct" else nbytes
            done = 0
            while done < nbytes:
                n = os.preadv(fd, [buffer[done:length]], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"short read at {offset + done}")
                done += n
            checksum(buffer[:nbytes])
    finally:
        os.close(fd)


def checksum_speeds(nbytes: int, repeats: int) -> list[list]:
    """Each checksum alone on ``nbytes`` random bytes in memory: bytes per second, median and range."""
    data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    rows = []
    for name, fn in CHECKSUMS.items():
        if name == "none":
            continue
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(data)
            times.append(time.perf_counter() - start)
        rows.append([name, *median_and_range([nbytes / t * 1e-9 for t in times], ".2f")])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="directory of the test file (default: the system's temporary "
                                                    "directory; it must be on the disk to measure, not tmpfs)")
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--layer-mib", type=float, default=32.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--methods", default="buffered,direct,mmap")
    parser.add_argument("--checksums", default="crc32,blake2b,none")
    args = parser.parse_args()

    layer_nbytes = int(args.layer_mib * (1 << 20))
    methods, checksums = args.methods.split(","), args.checksums.split(",")
    with tempfile.TemporaryDirectory(prefix="tensile-layer-io-", dir=args.dir) as directory:
        path = os.path.join(directory, "model.layers")
        regions = write_file(path, args.layers, layer_nbytes)
        total = sum(n for _, n in regions)
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            methods = [m for m in methods if m != "direct"]
            print(f"O_DIRECT refused on {directory} (EINVAL): no direct rows")
        cold = drop_caches()
        states = ["cold", "warm"] if cold else ["warm"]
        buffer = memoryview(mmap.mmap(-1, -(-layer_nbytes // ALIGN_NBYTES) * ALIGN_NBYTES))
        samples: dict[tuple, list[float]] = {}
        read_all("buffered", path, regions, buffer, CHECKSUMS["none"])              # warm-up
        for _ in range(args.repeats):          # interleaved, so drift hits every configuration alike
            for method in methods:
                for name in checksums:
                    for state in states:
                        if state == "cold":
                            drop_caches()
                        else:
                            read_all("buffered", path, regions, buffer, CHECKSUMS["none"])    # in the cache
                        start = time.perf_counter()
                        read_all(method, path, regions, buffer, CHECKSUMS[name])
                        samples.setdefault((state, method, name), []).append(time.perf_counter() - start)
    print(f"{args.layers} layers of {layer_nbytes:,} bytes ({total:,} bytes) read in order, each verified; "
          f"{args.repeats} interleaved runs, medians [min, max]; file in {args.dir or tempfile.gettempdir()}"
          + ("" if cold else "; not root: no cold runs (the page cache could not be dropped)"))
    rows = [[state, method, name, *median_and_range([total / t * 1e-9 for t in times], ".2f"),
             *median_and_range([t / args.layers * 1e3 for t in times], ".1f")]
            for (state, method, name), times in sorted(samples.items())]
    print(tabulate(rows, headers=["page cache", "method", "checksum", "GB/s", "range", "ms / layer", "range"],
                   colalign=("left", "left", "left", "right", "left", "right", "left")))
    print(f"\nchecksums alone on {layer_nbytes:,} bytes in memory:")
    print(tabulate(checksum_speeds(layer_nbytes, args.repeats), headers=["checksum", "GB/s", "range"],
                   colalign=("left", "right", "left")))


if __name__ == "__main__":
    main()
