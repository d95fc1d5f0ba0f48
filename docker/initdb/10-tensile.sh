#!/usr/bin/env bash
# tensile_db: run by the postgres image's entrypoint (/docker-entrypoint-initdb.d) once, when it
# initialises an empty data directory, while its temporary server runs. Later changes to
# TENSILE_DEVICE and TENSILE_DEVICE_BUDGET take no effect on an existing volume: edit
# tensile.device / tensile.device_budget in $PGDATA/postgresql.conf (ALTER SYSTEM refuses tensile.*
# on PostgreSQL 15), reload, then SELECT tensile.stop_coordinator() so that the next call starts
# the coordinator anew.
set -euo pipefail

budget="${TENSILE_DEVICE_BUDGET:-8GB}"
case "$budget" in
    *"'"* | *\\* | *$'\n'*) echo "10-tensile.sh: bad TENSILE_DEVICE_BUDGET: $budget" >&2; exit 1 ;;
esac
device="${TENSILE_DEVICE:-cpu}"
case "$device" in
    cpu | cuda) ;;
    *) echo "10-tensile.sh: TENSILE_DEVICE must be cpu or cuda, got: $device" >&2; exit 1 ;;
esac

cat >>"$PGDATA/postgresql.conf" <<CONF

# tensile_db (docker/initdb/10-tensile.sh)
tensile.device = '${device}'
tensile.device_budget = '${budget}'
tensile.python = '/opt/tensile/venv/bin/python'
CONF

psql -v ON_ERROR_STOP=1 --no-psqlrc \
    --username "${POSTGRES_USER:-postgres}" --dbname "${POSTGRES_DB:-${POSTGRES_USER:-postgres}}" \
    -c 'CREATE EXTENSION IF NOT EXISTS tensile_db CASCADE'
