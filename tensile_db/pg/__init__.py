"""Code that runs inside PL/Python in a PostgreSQL backend.

The SQL functions of the extension are two lines each: they load :mod:`tensile_db.pg.entry` once
per session (through ``tensile._bootstrap()``) and call it. This package never imports CuPy nor
the coordinator's server, memory, scheduler or inference code; it reads rows through SPI as the
calling role, talks to the coordinator, relays progress as NOTICE, and stores models in the
caller's transaction.

- ``entry.py``: what the SQL functions call; errors to SQLSTATEs; the status rows, filtered by role.
- ``session.py``: settings, the coordinator connection and every wait on it, prepared plans.
- ``data.py``: reading training data and features in one scan, as the calling role.
- ``train.py``: ``CALL tensile.train_model``.
- ``predict.py``: ``tensile.predict`` / ``predict_proba``, row by row in the backend.
- ``batch.py``: ``tensile.predict_batch`` / ``CALL tensile.predict_into`` on the coordinator.
- ``registry.py``: the one way rows reach ``tensile.models``.
"""
