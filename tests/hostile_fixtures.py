"""Shared set-up of the tests of hostile users (a pytest plugin, registered in ``conftest.py``):
the role maker, the trojans planted on a superuser's search_path (the ``trojans`` fixture and
what fired), and the catalog query that compares two installations of the extension."""

from __future__ import annotations

import pytest


def fresh_role(conn, role: str, *grants: str) -> None:
    if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
        conn.execute(f"DROP OWNED BY {role}")
        conn.execute(f"DROP ROLE {role}")
    conn.execute(f"CREATE ROLE {role} LOGIN")
    for g in grants:
        conn.execute(g)


#: Objects a role that may create in a schema on a superuser's search_path plants there: every
#: function, aggregate, operator and type name the extension's SQL uses, each logging its name
#: into evil.fired when it runs. Placed before pg_catalog on the path, they win every call that is
#: not schema-qualified (an exact type match wins over pg_catalog's polymorphic functions anyway).
TROJANS = r"""
CREATE SCHEMA evil AUTHORIZATION mallory;
SET ROLE mallory;
CREATE TABLE evil.fired (what text);
GRANT INSERT, SELECT ON evil.fired TO PUBLIC;
CREATE FUNCTION evil.fire(what text) RETURNS void LANGUAGE sql AS 'INSERT INTO evil.fired VALUES (what)';
CREATE FUNCTION evil.count_step(bigint, real) RETURNS bigint LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('count(real)'); RETURN $1 OPERATOR(pg_catalog.+) 1; END $$;
CREATE AGGREGATE evil.count(real) (SFUNC = evil.count_step, STYPE = bigint, INITCOND = '0');
CREATE FUNCTION evil.bytea_step(bytea, bytea, bytea) RETURNS bytea LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('string_agg(bytea, bytea)'); RETURN $2; END $$;
CREATE AGGREGATE evil.string_agg(bytea, bytea) (SFUNC = evil.bytea_step, STYPE = bytea);
CREATE FUNCTION evil.float4send(real) RETURNS bytea LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('float4send'); RETURN pg_catalog.float4send($1); END $$;
CREATE FUNCTION evil.float8send(double precision) RETURNS bytea LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('float8send'); RETURN pg_catalog.float8send($1); END $$;
CREATE FUNCTION evil.int8send(bigint) RETURNS bytea LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('int8send'); RETURN pg_catalog.int8send($1); END $$;
CREATE FUNCTION evil.set_config(text, text, boolean) RETURNS text LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('set_config'); RETURN pg_catalog.set_config($1, $2, $3); END $$;
CREATE FUNCTION evil.current_setting(text) RETURNS text LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('current_setting'); RETURN pg_catalog.current_setting($1); END $$;
CREATE FUNCTION evil.current_setting(text, boolean) RETURNS text LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('current_setting'); RETURN pg_catalog.current_setting($1, $2); END $$;
CREATE FUNCTION evil.pg_size_bytes(text) RETURNS bigint LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('pg_size_bytes'); RETURN pg_catalog.pg_size_bytes($1); END $$;
CREATE FUNCTION evil.pg_backend_pid() RETURNS integer LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('pg_backend_pid'); RETURN pg_catalog.pg_backend_pid(); END $$;
CREATE FUNCTION evil.hashtext(text) RETURNS integer LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('hashtext'); RETURN pg_catalog.hashtext($1); END $$;
CREATE FUNCTION evil.to_regclass(text) RETURNS regclass LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('to_regclass'); RETURN pg_catalog.to_regclass($1); END $$;
CREATE FUNCTION evil.format_type(oid, integer) RETURNS text LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('format_type'); RETURN pg_catalog.format_type($1, $2); END $$;
CREATE FUNCTION evil.pg_has_role(name, text) RETURNS boolean LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('pg_has_role'); RETURN pg_catalog.pg_has_role($1, $2); END $$;
CREATE FUNCTION evil.text_eq(text, text) RETURNS boolean LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('text = text'); RETURN $1 OPERATOR(pg_catalog.=) $2; END $$;
CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.text_eq);
CREATE FUNCTION evil.name_eq(name, name) RETURNS boolean LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('name = name'); RETURN $1 OPERATOR(pg_catalog.=) $2; END $$;
CREATE OPERATOR evil.= (LEFTARG = name, RIGHTARG = name, FUNCTION = evil.name_eq);
CREATE FUNCTION evil.int8_eq(bigint, bigint) RETURNS boolean LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('bigint = bigint'); RETURN $1 OPERATOR(pg_catalog.=) $2; END $$;
CREATE OPERATOR evil.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = evil.int8_eq);
CREATE FUNCTION evil.int4_gt(integer, integer) RETURNS boolean LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('integer > integer'); RETURN $1 OPERATOR(pg_catalog.>) $2; END $$;
CREATE OPERATOR evil.> (LEFTARG = integer, RIGHTARG = integer, FUNCTION = evil.int4_gt);
CREATE FUNCTION evil.text_check(text) RETURNS boolean LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('domain text'); RETURN true; END $$;
CREATE DOMAIN evil.text AS pg_catalog.text CHECK (evil.text_check(VALUE));
RESET ROLE;
"""


@pytest.fixture
def trojans(conn):
    """The TROJANS schema, owned by the unprivileged role mallory; dropped afterwards."""
    fresh_role(conn, "mallory")
    conn.execute("DROP SCHEMA IF EXISTS evil CASCADE")
    conn.execute(TROJANS)
    yield
    conn.execute("RESET search_path")
    conn.execute("DROP SCHEMA evil CASCADE")


def fired(conn) -> list[str]:
    return [r[0] for r in conn.execute("SELECT DISTINCT what FROM evil.fired ORDER BY 1")]


#: The extension's objects as the catalog holds them: functions (definition, security, settings,
#: volatility, grants, comment), aggregates (their functions, grants, comment), relations (grants),
#: policies (expressions).
CATALOG = """
SELECT 'function', p.oid::regprocedure::text,
       pg_get_functiondef(p.oid) || p.prosecdef || coalesce(p.proconfig::text, '') || p.provolatile::text
       || p.proparallel::text || coalesce(p.proacl::text, '') || coalesce(obj_description(p.oid, 'pg_proc'), '')
FROM pg_proc p WHERE p.pronamespace = 'tensile'::regnamespace AND p.prokind <> 'a'
UNION ALL
SELECT 'aggregate', p.oid::regprocedure::text,
       a.aggtransfn::regprocedure::text || a.aggfinalfn::regprocedure::text || a.aggtranstype::regtype::text
       || p.proparallel::text || coalesce(p.proacl::text, '') || coalesce(obj_description(p.oid, 'pg_proc'), '')
FROM pg_proc p JOIN pg_aggregate a ON a.aggfnoid = p.oid WHERE p.pronamespace = 'tensile'::regnamespace
UNION ALL
SELECT 'relation', c.relname::text, c.relkind::text || coalesce(c.relacl::text, '') FROM pg_class c
WHERE c.relnamespace = 'tensile'::regnamespace
UNION ALL
SELECT 'policy', policyname::text, cmd || coalesce(qual, '') || coalesce(with_check, '') FROM pg_policies
WHERE schemaname = 'tensile'
ORDER BY 1, 2"""
