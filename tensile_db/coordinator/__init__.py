"""The coordinator process: one per cluster and device, executing the iterations of every job.

- ``protocol.py``: framed messages (JSON header + raw array bytes) over a Unix socket.
- ``address.py``: where a cluster's coordinator listens (a 0700 directory in the data directory)
  and how a caller reads its process state; a leaf the backends import.
- ``reports.py``: the typed rows of ``tensile.jobs`` and ``tensile.memory``; a leaf too.
- ``jobs.py``: a training job — its data, program, tensors and progress — as a generator of ops.
- ``executor.py``: admission and the fair, periodic execution of all running jobs on one device.
- ``server.py``: the socket server, one thread per backend connection, and postmaster watching.
- ``client.py``: what a backend uses to reach the coordinator, starting it on demand.
- ``__main__.py``: ``python -m tensile_db.coordinator``, the process a backend starts.
"""
