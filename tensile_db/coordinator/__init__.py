"""The coordinator process: one per cluster and device, executing the iterations of every job.

- ``protocol.py``: framed messages (JSON header + raw array bytes) over a Unix socket.
- ``jobs.py``: a training job — its data, program, tensors and progress — as a generator of ops.
- ``executor.py``: admission and the round-robin execution of all running jobs on one device.
- ``server.py``: the socket server, one thread per backend connection, and postmaster watching.
- ``client.py``: what a backend uses to reach the coordinator, starting it on demand.
"""
