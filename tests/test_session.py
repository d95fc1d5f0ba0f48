"""The backend's waits on the coordinator (``tensile_db.pg.session.exchange``) let PostgreSQL deliver
a cancel at least once a wait slice, even where every exchange ends at once (a search's progress
messages arriving faster than a slice). PostgreSQL's side, a cancel delivered at the next call
into SPI, is stood in for by a recorder of those calls; the cancel of a real search from SQL is
``tests/test_sql_analyst.py``'s."""

from __future__ import annotations

import time

import pytest

from tensile_db.pg import session


class Canceled(Exception):
    pass


class Backend:
    """Records each call into SPI; once ``cancel_at`` (time.monotonic()) has passed, the next one
    raises as PostgreSQL raises a pending cancel."""

    def __init__(self, cancel_at: float):
        self.cancel_at = cancel_at
        self.calls: list[float] = []

    def prepare(self, sql, types):
        return sql

    def execute(self, plan):
        self.calls.append(time.monotonic())
        if time.monotonic() >= self.cancel_at:
            raise Canceled("canceling statement due to user request")


class Client:
    def abort(self):
        pass

    def leave_open(self):
        pass


def test_a_cancel_reaches_exchanges_that_each_end_at_once():
    backend = Backend(cancel_at=time.monotonic() + 0.3)
    started = time.monotonic()
    with pytest.raises(Canceled):
        for _ in range(20_000):                          # messages that are there at once
            session.exchange(backend, {}, Client(), lambda: {"type": "progress"}, "a search", None)
    assert time.monotonic() - started < 0.3 + 3 * session.WAIT_SLICE_S
    gaps = [b - a for a, b in zip(backend.calls, backend.calls[1:])]
    assert backend.calls and max(gaps, default=0.0) < 2 * session.WAIT_SLICE_S


def test_an_exchange_that_waits_checks_once_a_slice_and_one_that_ends_at_once_not_every_time():
    backend = Backend(cancel_at=float("inf"))
    session.exchange(backend, {}, Client(), lambda: time.sleep(3.5 * session.WAIT_SLICE_S), "a wait", None)
    assert len(backend.calls) >= 3
    before = len(backend.calls)
    for _ in range(50):
        session.exchange(backend, {}, Client(), lambda: None, "quick", None)
    assert len(backend.calls) - before <= 2             # within one slice of the last check: none more
