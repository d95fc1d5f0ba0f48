#!/usr/bin/env bash
# The docker-compose setup, checked for real on a host with a Docker engine (root or the docker
# group) and Docker Compose (`docker compose` or `docker-compose`); `make compose-check` runs it.
# Not part of `make test`: it needs the engine, and about 10 minutes and 5 GB of disk.
#
#   1. builds the CPU image (tensile_db:latest) and checks it is at most CPU_IMAGE_LIMIT bytes;
#   2. starts the database on a free host port (TENSILE_PORT) with a device budget below the
#      demo's models' peaks, so that they must share it, and reaches it from the host on that port;
#   3. runs the demo service (`compose run --rm demo`), which must exit 0;
#   4. makes a second database hold an older tensile_db (0.3.0), restarts the database, and checks
#      that the entrypoint brought it to the image's version and that the demo's models are still
#      there and served;
#   5. builds the GPU variant (tensile_db:cuda, the build argument VARIANT=cuda) and imports CuPy in it;
#   6. removes what it made: the project's containers, network and volume (`down -v`), and the
#      images that were not there before it ran, the build stage's untagged images included
#      (KEEP_IMAGES=1 keeps the images).
#
# Builds use the classic builder on the host's network, so that a host whose engine has no outbound
# NAT still reaches the package registries; the base image postgres:15-bookworm is used as found
# locally, or pulled. Exit status 0 when every step passed.
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT=${PROJECT:-tensile_db_check}
CPU_IMAGE_LIMIT=${CPU_IMAGE_LIMIT:-1200000000}     # bytes
DEMO_BUDGET=${DEMO_BUDGET:-6MB}                    # about half the sum of the demo's models' unscheduled peaks
export POSTGRES_PASSWORD=${POSTGRES_PASSWORD:-tensile-check}
export TENSILE_DEVICE_BUDGET=$DEMO_BUDGET
export DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0

if docker compose version >/dev/null 2>&1; then
    compose=(docker compose -p "$PROJECT")
elif command -v docker-compose >/dev/null; then
    compose=(docker-compose -p "$PROJECT")
else
    echo "compose-check: neither 'docker compose' nor 'docker-compose' is installed" >&2
    exit 2
fi
docker info >/dev/null 2>&1 || { echo "compose-check: no Docker engine answers (start dockerd)" >&2; exit 2; }

step() { printf '\n== %s\n' "$*"; }
fail() { echo "compose-check: FAILED: $*" >&2; exit 1; }
sql() { "${compose[@]}" exec -T db psql -v ON_ERROR_STOP=1 --no-psqlrc -U postgres -At "$@"; }

# What is here before the check, so that it removes only what it made: the two images, and the
# untagged images of the build stage that the classic builder leaves (its cache).
made_images=()
for image in tensile_db:latest tensile_db:cuda; do
    docker image inspect "$image" >/dev/null 2>&1 || made_images+=("$image")
done
untagged_before=$(docker images -q -f dangling=true | sort)
cleanup() {
    step "removing the project's containers, network and volume, and the images made here"
    "${compose[@]}" --profile demo down -v --remove-orphans || true
    [ -z "${KEEP_IMAGES:-}" ] || return 0
    if [ ${#made_images[@]} -gt 0 ]; then
        docker image rm "${made_images[@]}" >/dev/null 2>&1 || true
    fi
    comm -13 <(echo "$untagged_before") <(docker images -q -f dangling=true | sort) | xargs -r docker image rm >/dev/null 2>&1 || true
}
trap cleanup EXIT

# A free port on the host's loopback, unless TENSILE_PORT names one.
if [ -z "${TENSILE_PORT:-}" ]; then
    TENSILE_PORT=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
export TENSILE_PORT

wait_healthy() {
    local id status
    id=$("${compose[@]}" ps -q db)
    for _ in $(seq 120); do
        status=$(docker inspect -f '{{.State.Health.Status}}' "$id")
        [ "$status" = healthy ] && return 0
        sleep 1
    done
    docker logs "$id" | tail -n 30 >&2
    fail "the database is not healthy after 120 s (last status: $status)"
}

step "building the CPU image tensile_db:latest"
docker build -q --network=host -t tensile_db:latest . >/dev/null
size=$(docker image inspect -f '{{.Size}}' tensile_db:latest)
echo "tensile_db:latest is $size bytes (limit $CPU_IMAGE_LIMIT)"
[ "$size" -le "$CPU_IMAGE_LIMIT" ] || fail "the CPU image is $size bytes, over $CPU_IMAGE_LIMIT"
docker run --rm --entrypoint /opt/tensile/venv/bin/python tensile_db:latest -c 'import cupy' 2>/dev/null \
    && fail "the CPU image has CuPy"

step "starting the database (host port $TENSILE_PORT, device budget $DEMO_BUDGET)"
"${compose[@]}" config -q
"${compose[@]}" up -d --no-build db
wait_healthy
exec 3<>"/dev/tcp/127.0.0.1/$TENSILE_PORT" || fail "nothing listens on 127.0.0.1:$TENSILE_PORT"
exec 3>&-
[ "$(sql -c "SELECT extversion FROM pg_extension WHERE extname = 'tensile_db'")" != "" ] \
    || fail "the init script did not create the extension"

step "running the demo service"
"${compose[@]}" run --rm demo || fail "the demo service exited with status $?"

step "a database with an older tensile_db, then a restart"
sql -c "CREATE DATABASE tensile_old"
sql -d tensile_old -c "CREATE EXTENSION tensile_db VERSION '0.3.0' CASCADE"
wanted=$(sql -c "SELECT default_version FROM pg_available_extensions WHERE name = 'tensile_db'")
"${compose[@]}" restart db
wait_healthy
got=$(sql -d tensile_old -c "SELECT extversion FROM pg_extension WHERE extname = 'tensile_db'")
[ "$got" = "$wanted" ] || fail "after a restart tensile_old has tensile_db $got, not the image's $wanted"
"${compose[@]}" logs db | grep -q "database tensile_old: tensile_db 0.3.0 -> $wanted" \
    || fail "the entrypoint's log does not say it updated tensile_old"
echo "tensile_old: tensile_db 0.3.0 -> $got on restart"
models=$(sql -c "SELECT count(*) FROM tensile.models WHERE deployed AND name LIKE 'digits_%'")
[ "$models" = 4 ] || fail "after a restart $models of the demo's 4 digits models are deployed"
agree=$(sql -c "SELECT count(*) FILTER (WHERE tensile.predict_label('digits_cnn', t)::int = t.label), count(*)
                FROM digits_test t")
echo "after the restart digits_cnn predicts digits_test (right, rows): $agree"
[ "${agree%%|*}" -gt $(( ${agree##*|} * 9 / 10 )) ] || fail "digits_cnn is not served after the restart: $agree"

step "building the GPU variant tensile_db:cuda"
docker build -q --network=host --build-arg VARIANT=cuda -t tensile_db:cuda . >/dev/null
docker run --rm --entrypoint /opt/tensile/venv/bin/python tensile_db:cuda -c 'import cupy; print("CuPy", cupy.__version__)'
echo "tensile_db:cuda is $(docker image inspect -f '{{.Size}}' tensile_db:cuda) bytes"
"${compose[@]}" -f docker-compose.yml -f docker-compose.gpu.yml config -q

step "compose-check: every step passed"
