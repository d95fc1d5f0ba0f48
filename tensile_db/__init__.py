"""tensile_db: in-database machine learning for PostgreSQL with one shared device memory coordinator.

Folders, one concern each, in layer order (each imports only from the ones above it):

- ``runtime/``     arrays on the device, kernels with forward and backward, the model description
                   (layers, options, weights, size limits), and the training program (the ordered
                   operators of one iteration, which is its access sequence).
- ``memory/``      the device arena and its allocators, the tensor registry and residency (device,
                   host, dropped), the swap engine, the planned pool and the lifetime planner.
- ``scheduler/``   access sequences, the cost model, the combined timeline of all jobs and the fair
                   pace of each, the swap / recompute planners (TENSILE, arXiv 1903.06631, vDNN) and
                   the farthest-next-use fallback.
- ``inference/``   demand-layered batch inference (arXiv 2210.04024): served models, the layered
                   forward pass with a prefetch window, admission of calls.
- ``coordinator/`` the coordinator process: protocol, server, executor, jobs, the rows it reports,
                   and the client and socket rules that backends use.
- ``pg/``          code that runs inside PL/Python in a PostgreSQL backend.

Beside them: ``settings.py`` (the server settings' valid values and defaults), ``errors.py`` (one
error root), ``client.py`` (the analysts' Python client over SQLAlchemy), ``cluster.py`` (an
embedded PostgreSQL cluster for the demo and the tests), ``demo.py`` and ``cli.py``.
"""

from importlib.metadata import PackageNotFoundError, version

#: The package's version, as installed (``pyproject.toml``); the extension's default version
#: (``extension/tensile_db.control``) is the same, which ``tests/test_versions.py`` checks.
try:
    __version__ = version("tensile_db")
except PackageNotFoundError:        # imported from a checkout that is not installed
    __version__ = "unknown"
