"""A small Python client for analysts: the SQL surface over a SQLAlchemy engine (psycopg driver).

    from sqlalchemy import create_engine
    from tensile_db.client import TensileClient

    tc = TensileClient(create_engine("postgresql+psycopg://me@/db?host=/run/postgresql"))
    tc.train("digits_mlp", "SELECT * FROM digits_train", "label",
             architecture={"layers": [{"dense": 256}]}, options={"epochs": 20})
    tc.predict("digits_mlp", [0.0] * 64)
    tc.deploy("digits_mlp", "rollback")          # or a version number, "best_score", "most_recent"

Every method runs the extension's SQL on a connection of the engine; nothing here trains or
predicts by itself. Errors are the database's (``sqlalchemy.exc.DBAPIError`` wrapping psycopg's).
"""

from __future__ import annotations

import json
from typing import Callable

from sqlalchemy import Engine, create_engine, text


class TensileClient:
    """The extension's functions for one database. ``engine``: a SQLAlchemy engine or URL."""

    def __init__(self, engine: Engine | str):
        self.engine = create_engine(engine) if isinstance(engine, str) else engine

    def train(self, model_name: str, source: str, label: str, *, features: list[str] | None = None,
              architecture: dict | None = None, options: dict | None = None,
              on_notice: Callable[[str], None] | None = None) -> dict:
        """``CALL tensile.train_model(...)`` in its own transaction; returns ``{"task", "metrics",
        "version", "deployed"}``: the version it stored and whether predictions now use it.
        ``on_notice`` receives each progress NOTICE as it arrives."""
        with self.engine.connect() as conn:
            raw = conn.connection.driver_connection
            handler = (lambda d: on_notice(d.message_primary)) if on_notice else None
            if handler:
                raw.add_notice_handler(handler)
            try:
                row = conn.execute(text(
                    "CALL tensile.train_model(model_name => :name, source => :source, label => :label, "
                    "features => :features, architecture => coalesce(CAST(:architecture AS jsonb), "
                    "'{\"layers\": [{\"dense\": 64}]}'), options => CAST(:options AS jsonb))"),
                    {"name": model_name, "source": source, "label": label, "features": features,
                     "architecture": json.dumps(architecture) if architecture else None,
                     "options": json.dumps(options or {})}).mappings().one()
                conn.commit()
            finally:
                if handler:
                    raw.remove_notice_handler(handler)
        return {"task": row["task"], "metrics": row["metrics"], "version": row["version"], "deployed": row["deployed"]}

    def predict(self, model_name: str, features: list[float]) -> float:
        """``tensile.predict``: the class label or value for one row of features."""
        with self.engine.connect() as conn:
            return conn.execute(text("SELECT tensile.predict(:m, CAST(:f AS real[]))"),
                                {"m": model_name, "f": list(features)}).scalar_one()

    def predict_batch(self, model_name: str, source: str, key: str | None = None,
                      options: dict | None = None) -> list[dict]:
        """``tensile.predict_batch``: one ``{"id", "prediction", "probabilities"}`` per row of
        ``source`` (a query or table name), computed on the coordinator's device; ``id`` is the
        ``key`` column's value or the row's 1-based ordinal. ``options``: window, batch_size,
        cache, skip_nulls."""
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(text(
                "SELECT * FROM tensile.predict_batch(:m, :source, :key, CAST(:options AS jsonb))"),
                {"m": model_name, "source": source, "key": key, "options": json.dumps(options or {})}).mappings()]

    def _rows(self, sql: str) -> list[dict]:
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(text(sql)).mappings()]

    def deploy(self, model_name: str, version_or_strategy: int | str) -> int:
        """``tensile.deploy``: make a version (a number, or the one ``"best_score"``,
        ``"most_recent"`` or ``"rollback"`` picks) the one predictions use; returns it."""
        kind = "integer" if isinstance(version_or_strategy, int) else "pg_catalog.text"
        with self.engine.begin() as conn:
            return conn.execute(text(f"SELECT tensile.deploy(:m, CAST(:v AS {kind}))"),
                                {"m": model_name, "v": version_or_strategy}).scalar_one()

    def models(self) -> list[dict]:
        """Every version of every model the role sees, by name and version, without the weights:
        ``version``, ``deployed`` and ``score`` (``metrics->'score'``, None without one) next to
        the other columns of ``tensile.models``."""
        return self._rows(
            "SELECT id, name, version, deployed, (metrics OPERATOR(pg_catalog.->>) 'score')::pg_catalog.float8 AS score, "
            "owner, task, architecture, options, feature_names, label_name, label_classes, label_names, metrics, "
            "created_at FROM tensile.models ORDER BY name, version")

    def jobs(self) -> list[dict]:
        """Rows of ``tensile.jobs``: the live jobs of every backend."""
        return self._rows("SELECT * FROM tensile.jobs ORDER BY job_id")

    def memory(self) -> dict | None:
        """The row of ``tensile.memory`` of the first device,
        or None when no coordinator runs."""
        rows = self.devices()
        return rows[0] if rows else None

    def devices(self) -> list[dict]:
        """Every row of ``tensile.memory``: one per device the coordinator drives, in the order of
        ``tensile.devices``; none when no coordinator runs."""
        return self._rows("SELECT * FROM tensile.memory")

    def drop(self, model_name: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(text("SELECT tensile.drop_model(:m)"), {"m": model_name})
