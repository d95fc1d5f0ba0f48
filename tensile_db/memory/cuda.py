"""Routing CuPy's allocator into the arena (``cuda`` only).

After :func:`route_cupy_allocator`, every allocation CuPy makes — kernel temporaries, reduction
buffers, cuBLAS outputs not written with ``out=`` — is a workspace tensor in the manager's arena,
so the budget counts them and eviction can make room for them. The arena buffer itself is
allocated before the routing, from CuPy's default pool. A workspace block returns to the arena
when CuPy drops its last reference to the memory. CuPy holds each block's address as a raw
pointer, so the blocks are acquired ``fixed``: compaction and the planned pool never move them.
"""

from __future__ import annotations

import weakref

from ..runtime.program import Kind, Slot

#: Job id under which library temporaries are counted.
WORKSPACE_JOB = 0


def route_cupy_allocator(manager) -> None:  # pragma: no cover - needs a GPU
    import cupy

    manager.register_job(WORKSPACE_JOB)
    base = manager.buffer.data.ptr

    def malloc(nbytes: int) -> "cupy.cuda.MemoryPointer":
        (t,) = manager.acquire(WORKSPACE_JOB, [], [Slot("cupy_workspace", Kind.WORKSPACE, (max(nbytes, 1),), "uint8")],
                               what=f"a CuPy temporary of {nbytes:,} bytes", fixed=True)
        owner = _Owner()
        mem = cupy.cuda.UnownedMemory(base + t.offset, nbytes, owner)
        weakref.finalize(owner, _release, manager, t)
        return cupy.cuda.MemoryPointer(mem, 0)

    cupy.cuda.set_allocator(malloc)


class _Owner:
    """Lives as long as CuPy holds the memory."""


def _release(manager, t) -> None:  # pragma: no cover - needs a GPU
    manager.unpin([t])
    manager.free(t)
