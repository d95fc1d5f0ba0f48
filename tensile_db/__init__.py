"""tensile_db: in-database machine learning for PostgreSQL with one shared device memory coordinator.

Folders, one concern each:

- ``runtime/``     arrays, kernels with forward and backward, layers, losses, optimizers, and the
                   training program (the ordered operators of one iteration).
- ``memory/``      the device arena, its allocator, and the tensor registry that swaps tensors
                   between the arena and host memory.
- ``scheduler/``   access sequences and the eviction policy that keeps every job inside the budget.
- ``coordinator/`` the coordinator process: protocol, server, executor, jobs, and the client that
                   backends use.
- ``pg/``          code that runs inside PL/Python in a PostgreSQL backend.
- ``cluster.py``   an embedded PostgreSQL cluster for the demo and the tests.
"""

__version__ = "0.1.0"
