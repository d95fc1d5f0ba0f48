"""Code that runs inside PL/Python in a PostgreSQL backend.

The SQL functions of the extension are two lines each: they load :mod:`tensile_db.pg.entry` once
per session (through ``tensile._bootstrap()``) and call it. This package never imports CuPy;
it reads rows through SPI as the calling role, talks to the coordinator, relays progress as
NOTICE, and stores models in the caller's transaction.
"""
