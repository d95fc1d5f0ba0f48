"""Small public data sets as PostgreSQL tables, loaded offline from files installed with Python
packages, for the demo, the benchmarks and the tests.

Each loader creates one table (``DROP TABLE IF EXISTS`` first when ``replace``), fills it with one
``COPY ... FROM STDIN`` and returns the number of rows. The tables are plain: an integer ``id``
(1-based, in the file's order, the primary key), the features and the label; which rows are held
out for evaluation is the extension's choice at training time (``options.test_size``, ``seed``).

- :func:`load_penguins`: the Palmer penguins (Gorman, Williams and Fraser 2014; 344 rows) from
  the ``palmerpenguins`` package's bundled ``penguins.csv``, read with :mod:`csv` so that nothing
  here imports pandas. ``species`` (the label), ``island`` and ``sex`` are text; the four
  measurements and ``year`` are numbers. The file's missing values ("NA": 2 rows without
  measurements, 11 without ``sex``) are kept as NULLs.
- :func:`load_breast_cancer`: scikit-learn's Wisconsin diagnostic breast cancer data (569 rows,
  30 numeric features, ``label`` 0 malignant / 1 benign).
- :func:`load_diabetes`: scikit-learn's diabetes data (442 rows, 10 numeric features in their
  original units, ``target`` a measure of disease progression one year later).

Table names are quoted as identifiers (``psycopg.sql.Identifier``); every other name in the SQL
is fixed here. Every loader takes a SQLAlchemy ``Engine`` (the work runs in a transaction of its
own) or ``Connection`` (the work joins the caller's transaction, which the caller commits).
"""

from __future__ import annotations

import csv
import importlib.util
from contextlib import contextmanager
from pathlib import Path

from psycopg import sql
from sqlalchemy import Connection, Engine

#: Columns of the penguins table after ``id``: (name, SQL type), in the CSV's order.
PENGUIN_COLUMNS = (("species", "text"), ("island", "text"), ("bill_length_mm", "real"),
                   ("bill_depth_mm", "real"), ("flipper_length_mm", "integer"), ("body_mass_g", "integer"),
                   ("sex", "text"), ("year", "integer"))
#: How the penguins CSV writes a missing value.
MISSING = "NA"


@contextmanager
def _driver_connection(bind: Engine | Connection):
    """The psycopg connection under ``bind``, inside a transaction: the engine's own (committed on
    leaving), or the caller's connection as it is."""
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            yield conn.connection.driver_connection
    else:
        if not bind.in_transaction():
            # SQLAlchemy's commit() ends only a transaction it knows of; psycopg's own would be
            # rolled back when the connection returns to the pool.
            bind.begin()
        yield bind.connection.driver_connection


def _create_and_copy(bind: Engine | Connection, table: str, columns: list[tuple[str, str]], rows,
                     replace: bool) -> int:
    """Create ``table`` (id integer primary key, then ``columns``: (name, SQL type) pairs, types
    from this module) and COPY ``rows`` into it, each row a sequence of values (None: NULL) with
    the id first. Returns the number of rows copied."""
    name = sql.Identifier(table)
    definitions = sql.SQL(", ").join(sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t)) for c, t in columns)
    n = 0
    with _driver_connection(bind) as raw, raw.cursor() as cur:
        if replace:
            cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(name))
        cur.execute(sql.SQL("CREATE TABLE {} (id integer PRIMARY KEY, {})").format(name, definitions))
        with cur.copy(sql.SQL("COPY {} FROM STDIN").format(name)) as copy:
            for row in rows:
                copy.write_row(row)
                n += 1
    return n


def penguins_csv() -> Path:
    """Path of the ``palmerpenguins`` package's ``data/penguins.csv``, found without importing the
    package (its ``__init__`` imports pandas). Raises ModuleNotFoundError when it is not installed
    (``pip install palmerpenguins``)."""
    spec = importlib.util.find_spec("palmerpenguins")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the penguins data comes from the palmerpenguins package: pip install palmerpenguins",
                                  name="palmerpenguins")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "penguins.csv"


def load_penguins(bind: Engine | Connection, table: str = "penguins", replace: bool = False) -> int:
    """Create ``table`` with the 344 Palmer penguins: ``id`` integer, ``species``, ``island``
    text, ``bill_length_mm``, ``bill_depth_mm`` real, ``flipper_length_mm``, ``body_mass_g``
    integer, ``sex`` text, ``year`` integer; the file's "NA" values as NULL. ``replace`` drops an
    existing table of that name first. Returns the number of rows.

    Raises ModuleNotFoundError without the palmerpenguins package, ValueError when the file's
    header is not the expected one, and the database's errors (e.g. the table exists)."""
    with open(penguins_csv(), newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        expected = [c for c, _ in PENGUIN_COLUMNS]
        if header != expected:
            raise ValueError(f"penguins.csv has the columns {header}, expected {expected}")
        rows = [[i, *(None if v == MISSING else v for v in values)] for i, values in enumerate(reader, start=1)]
    return _create_and_copy(bind, table, list(PENGUIN_COLUMNS), rows, replace)


def _load_sklearn(bind, table: str, bunch, label: str, label_type: str, replace: bool) -> int:
    """A scikit-learn ``Bunch`` as a table: one double precision column per feature (its name in
    lower case, spaces as underscores), then ``label`` of ``label_type``."""
    names = [n.lower().replace(" ", "_") for n in bunch.feature_names]
    columns = [(n, "double precision") for n in names] + [(label, label_type)]
    target = bunch.target.tolist()
    rows = ([i, *x, y] for i, (x, y) in enumerate(zip(bunch.data.tolist(), target), start=1))
    return _create_and_copy(bind, table, columns, rows, replace)


def load_breast_cancer(bind: Engine | Connection, table: str = "breast_cancer", replace: bool = False) -> int:
    """Create ``table`` with scikit-learn's breast cancer data: ``id`` integer, 30 double precision
    features (``mean_radius`` ... ``worst_fractal_dimension``), ``label`` integer (0 malignant, 1
    benign). ``replace`` drops an existing table of that name first. Returns the number of rows
    (569)."""
    from sklearn.datasets import load_breast_cancer as bundled

    return _load_sklearn(bind, table, bundled(), "label", "integer", replace)


def load_diabetes(bind: Engine | Connection, table: str = "diabetes", replace: bool = False) -> int:
    """Create ``table`` with scikit-learn's diabetes data in its original units (``scaled=False``):
    ``id`` integer, 10 double precision features (``age``, ``sex``, ``bmi``, ``bp``, ``s1`` ...
    ``s6``) and ``target`` double precision. ``replace`` drops an existing table of that name
    first. Returns the number of rows (442)."""
    from sklearn.datasets import load_diabetes as bundled

    return _load_sklearn(bind, table, bundled(scaled=False), "target", "double precision", replace)
