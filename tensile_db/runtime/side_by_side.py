"""Feature columns that lie side by side in one row-major block.

The scan of a source (:mod:`tensile_db.pg.scan`) writes a row's numeric features next to each
other, so each numeric column is a strided view, (N,) float32, of one (N, F) block. A test or a
gather made column by column reads every cache line of the block once per column (16 columns of
a million rows: 0.12 s to test each for non-finite values, 0.009 s for the block at once);
:func:`runs` finds the columns that form a block, so that callers work on it as a whole. Columns
that are not views of one block (separate arrays, a predict call's values) are runs of one.
"""

from __future__ import annotations

import numpy as np


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def runs(columns: list[np.ndarray]) -> list[tuple[int, int, np.ndarray]]:
    """Consecutive ``columns`` (each (N,) of one dtype) in runs ``(start, stop, block)``:
    ``block`` is an (N, stop - start) view whose column k is ``columns[start + k]``; the columns
    of a run of several are views of one base array, each one element after the previous in
    every row (the same length, dtype and row stride). Every column is in exactly one run."""
    out: list[tuple[int, int, np.ndarray]] = []
    start = 0
    for i in range(1, len(columns) + 1):
        if i < len(columns) and _next_to(columns[i - 1], columns[i]):
            continue
        first = columns[start]
        if i - start == 1:
            block = first.reshape(-1, 1)
        else:
            block = np.lib.stride_tricks.as_strided(first, shape=(len(first), i - start),
                                                    strides=(first.strides[0], first.itemsize), writeable=False)
        out.append((start, i, block))
        start = i
    return out


def _next_to(a, b) -> bool:
    """Whether column ``b`` lies one element after column ``a`` in every row of one base array."""
    return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.ndim == b.ndim == 1
            and a.base is not None and a.base is b.base and a.dtype == b.dtype and len(a) == len(b)
            and a.strides == b.strides and a.strides[0] >= 2 * a.itemsize
            and _address(b) == _address(a) + a.itemsize)


def finite(columns: list[np.ndarray]) -> np.ndarray:
    """(len(columns),) bool: whether each float column holds only finite values (no NaN, no
    infinity). A run of columns side by side is tested at once; only a run that holds a
    non-finite value is tested again column by column."""
    ok = np.ones(len(columns), dtype=bool)
    for start, stop, block in runs(columns):
        if len(block) and not np.isfinite(block).all():
            ok[start:stop] = np.isfinite(block).all(axis=0)
    return ok
