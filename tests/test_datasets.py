"""The data set loaders against a real cluster: the tables they create (rows, column types, the
penguins' real NULLs), their quoting of a table name and refusal to overwrite, and the penguins
trained from SQL with one-hot text columns and imputed gaps, then predicted on rows with NULLs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sqlalchemy import create_engine

from tensile_db import datasets

pytestmark = pytest.mark.db

#: The penguins' NULLs per column, as the palmerpenguins CSV has them ("NA").
PENGUIN_NULLS = {"id": 0, "species": 0, "island": 0, "bill_length_mm": 2, "bill_depth_mm": 2,
                 "flipper_length_mm": 2, "body_mass_g": 2, "sex": 11, "year": 0}
PENGUIN_FEATURES = ["island", "bill_length_mm", "bill_depth_mm", "flipper_length_mm", "body_mass_g", "sex"]


@pytest.fixture(scope="module")
def engine(cluster):
    e = create_engine(cluster.url("tensile_test"))
    yield e
    e.dispose()


@pytest.fixture(scope="module")
def penguins(engine) -> int:
    return datasets.load_penguins(engine, replace=True)


def column_types(conn, table: str) -> dict[str, str]:
    return dict(conn.execute("SELECT column_name, data_type FROM information_schema.columns "
                             "WHERE table_schema = current_schema() AND table_name = %s ORDER BY ordinal_position",
                             (table,)).fetchall())


def test_penguins_table_keeps_the_missing_values_as_nulls(conn, penguins):
    assert penguins == 344
    assert column_types(conn, "penguins") == {
        "id": "integer", "species": "text", "island": "text", "bill_length_mm": "real", "bill_depth_mm": "real",
        "flipper_length_mm": "integer", "body_mass_g": "integer", "sex": "text", "year": "integer"}
    counts = ", ".join(f'count(*) - count("{c}")' for c in PENGUIN_NULLS)
    assert dict(zip(PENGUIN_NULLS, conn.execute(f"SELECT {counts} FROM penguins").fetchone())) == PENGUIN_NULLS
    assert dict(conn.execute("SELECT species, count(*) FROM penguins GROUP BY 1").fetchall()) == {
        "Adelie": 152, "Chinstrap": 68, "Gentoo": 124}
    assert conn.execute("SELECT min(id), max(id), count(DISTINCT id) FROM penguins").fetchone() == (1, 344, 344)
    # the file's first row, as written there
    assert conn.execute("SELECT species, island, bill_length_mm, bill_depth_mm, flipper_length_mm, body_mass_g, sex, "
                        "year FROM penguins WHERE id = 1").fetchone() == (
        "Adelie", "Torgersen", pytest.approx(39.1), pytest.approx(18.7), 181, 3750, "male", 2007)


def test_breast_cancer_table(conn, engine):
    assert datasets.load_breast_cancer(engine, replace=True) == 569
    types = column_types(conn, "breast_cancer")
    assert list(types)[:2] == ["id", "mean_radius"] and list(types)[-1] == "label" and len(types) == 32
    assert types.pop("id") == "integer" and types.pop("label") == "integer"
    assert set(types.values()) == {"double precision"}
    assert dict(conn.execute("SELECT label, count(*) FROM breast_cancer GROUP BY 1").fetchall()) == {0: 212, 1: 357}


def test_diabetes_table(conn, engine):
    assert datasets.load_diabetes(engine, replace=True) == 442
    types = column_types(conn, "diabetes")
    assert list(types) == ["id", "age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6", "target"]
    assert types.pop("id") == "integer" and set(types.values()) == {"double precision"}
    n, nulls, lo, hi = conn.execute("SELECT count(*), count(*) - count(target), min(target), max(target) "
                                    "FROM diabetes").fetchone()
    assert (n, nulls, lo, hi) == (442, 0, 25, 346)


def test_a_table_name_is_quoted_and_an_existing_table_kept(conn, engine):
    name = 'odd "name"; DROP TABLE x'
    assert datasets.load_diabetes(engine, table=name, replace=True) == 442
    assert conn.execute('SELECT count(*) FROM "odd ""name""; DROP TABLE x"').fetchone() == (442,)
    with pytest.raises(Exception, match="already exists"):
        datasets.load_diabetes(engine, table=name)
    assert conn.execute('SELECT count(*) FROM "odd ""name""; DROP TABLE x"').fetchone() == (442,)
    conn.execute('DROP TABLE "odd ""name""; DROP TABLE x"')


def test_on_a_connection_the_load_is_the_callers_to_commit_or_roll_back(conn, engine):
    with engine.connect() as c:
        datasets.load_diabetes(c, table="diabetes_kept", replace=True)
        c.commit()
    with engine.connect() as c:
        datasets.load_diabetes(c, table="diabetes_dropped", replace=True)
        c.rollback()
    assert conn.execute("SELECT to_regclass('diabetes_kept')::text, to_regclass('diabetes_dropped')::text"
                        ).fetchone() == ("diabetes_kept", None)
    conn.execute("DROP TABLE diabetes_kept")


def test_the_penguins_loader_imports_no_pandas():
    code = ("import sys; from tensile_db import datasets; datasets.penguins_csv(); "
            "print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"


def test_penguins_train_from_sql_with_one_hot_and_imputed_gaps(conn, penguins):
    """Species from two text columns (one-hot) and four numeric ones, the numeric gaps filled with
    the training rows' mean and the text columns' with their mode (the default impute applies to
    every column, and "mean" does not suit text); then predicted on the rows with NULLs."""
    options = {"epochs": 60, "batch_size": 32, "lr": 0.01, "seed": 0, "replace": True, "impute": "mean",
               "preprocess": {"island": {"impute": "mode"}, "sex": {"impute": "mode"}}}
    task, metrics, version, _ = conn.execute(
        "CALL tensile.train_model(model_name => 'penguins_mlp', source => 'SELECT * FROM penguins', "
        "label => 'species', features => %s, architecture => '{\"layers\": [{\"dense\": 16}]}', options => %s)",
        (PENGUIN_FEATURES, json.dumps(options))).fetchone()
    assert task == "classification" and version >= 1
    assert (metrics["samples"], metrics["test_samples"]) == (275, 69)      # ceil(0.2 * 344) rows held out
    assert metrics["accuracy"] >= 0.9, metrics
    names, classes = conn.execute("SELECT label_names, label_classes FROM tensile.models "
                                  "WHERE name = 'penguins_mlp' AND deployed").fetchone()
    assert names == ["Adelie", "Chinstrap", "Gentoo"] and [int(c) for c in classes] == [0, 1, 2]
    rows = conn.execute("SELECT tensile.predict_label('penguins_mlp', to_jsonb(p)), "
                        "tensile.predict('penguins_mlp', to_jsonb(p)), species, sex IS NULL, bill_length_mm IS NULL "
                        "FROM penguins p").fetchall()
    assert len(rows) == 344
    with_nulls = [r for r in rows if r[3] or r[4]]
    assert len(with_nulls) == 11                           # 9 without sex, 2 without sex or any measurement
    assert all(label in names and names[int(index)] == label for label, index, *_ in rows)
    assert sum(label == species for label, _, species, *_ in rows) / len(rows) >= 0.9
