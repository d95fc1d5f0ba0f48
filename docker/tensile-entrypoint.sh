#!/usr/bin/env bash
# The image's entrypoint: the postgres image's own (docker-entrypoint.sh), after one step of
# tensile_db's on a data directory that already exists. A volume made by an earlier image keeps the
# extension's version it was created with, while the image carries a newer package and install
# script; so before the server starts, every database whose tensile_db is older than the image's
# is brought to the image's version (ALTER EXTENSION tensile_db UPDATE, through the upgrade
# scripts), on a temporary server that listens on no TCP port, the way the postgres image runs its
# init scripts. An empty data directory is left to the image's initialisation
# (docker/initdb/10-tensile.sh creates the extension at the image's version).
#
# The postgres image's entrypoint may be sourced for its functions (docker_setup_env,
# docker_temp_server_start, docker_temp_server_stop); it runs nothing when sourced.
set -Eeo pipefail
# shellcheck source=/dev/null
source /usr/local/bin/docker-entrypoint.sh

# Print each database's update and make it; $1... are the server's arguments.
update_tensile_db() {
	local wanted database installed
	docker_setup_env
	docker_temp_server_start "$@"
	local psql=(psql -v ON_ERROR_STOP=1 --no-psqlrc --no-password --username "$POSTGRES_USER" -At)
	wanted=$("${psql[@]}" --dbname postgres -c \
		"SELECT default_version FROM pg_catalog.pg_available_extensions WHERE name = 'tensile_db'")
	while IFS= read -r database; do
		installed=$("${psql[@]}" --dbname "$database" -c \
			"SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'tensile_db'")
		if [ -n "$installed" ] && [ "$installed" != "$wanted" ]; then
			echo "tensile-entrypoint.sh: database $database: tensile_db $installed -> $wanted"
			"${psql[@]}" --dbname "$database" -c 'ALTER EXTENSION tensile_db UPDATE'
		fi
	done < <("${psql[@]}" --dbname postgres -c \
		"SELECT datname FROM pg_catalog.pg_database WHERE datallowconn ORDER BY datname")
	docker_temp_server_stop
}

if [ "${1:0:1}" = '-' ]; then
	set -- postgres "$@"
fi
if [ "$1" = postgres ] && ! _pg_want_help "$@" && [ -s "$PGDATA/PG_VERSION" ]; then
	if [ "$(id -u)" = 0 ]; then
		exec gosu postgres "${BASH_SOURCE[0]}" "$@"
	fi
	update_tensile_db "$@"
fi
exec docker-entrypoint.sh "$@"
