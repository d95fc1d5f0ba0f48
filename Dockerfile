# PostgreSQL 15 with the tensile_db extension, training on the CPU or on the GPU through CuPy
# (tensile.device, set from TENSILE_DEVICE by docker/initdb/10-tensile.sh).
#
#   docker compose -p tensile_db up -d --build      # see docker-compose.yml (volume, port, the demo)
#                                                    # and docker-compose.gpu.yml (the GPU variant)
#
# The build argument VARIANT picks the image: cpu (the default: no CuPy, no CUDA libraries) or
# cuda (CuPy with the CUDA runtime libraries from PyPI, about 2.8 GB more). Both carry the demo's
# data packages, so that `tensile-db demo --dsn ...` runs in a container of the image.
# No `# syntax=` line: it would make BuildKit pull a frontend image, which an offline host cannot.
#
# Two stages: "build" has the compilers PGXS pulls in (postgresql-server-dev-15 depends on clang and
# llvm) and builds the virtual environment; the final image keeps only the venv, the extension's
# files and PL/Python. Both stages start from the same image, so the venv's interpreter
# (/usr/bin/python3.11) is the one PL/Python embeds in the final image.
#
# Run it with an init process as PID 1 (`init: true` in compose, `docker run --init`): the
# coordinator a backend starts is reparented to PID 1 when that backend exits, and a postmaster
# that is PID 1 takes any such child exiting abnormally for a crashed backend and restarts them all.

FROM postgres:15-bookworm AS build

RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends make gcc libc6-dev python3-venv postgresql-server-dev-15; \
    rm -rf /var/lib/apt/lists/*

# The Python package, installed (not editable) into the venv with the demo's extra, and for the cuda
# variant the CUDA extra: cupy-cuda12x needs the CUDA runtime libraries (cuBLAS, NVRTC, cuRAND,
# ...), which the base image does not have; its `ctk` extra (CuPy 14 and later) installs them from
# PyPI. Only the GPU driver comes from the host, through the NVIDIA Container Toolkit.
# The installers (pip, setuptools) and the packages' own test suites (`tests` directories, which
# nothing imports at run time) are left out of the venv: 135 MB of the CPU image. The oneDNN wheel
# installs its library three times over (a wheel has no symbolic links): two become links, 109 MB.
WORKDIR /src
COPY pyproject.toml setup.py README* ./
COPY tensile_db ./tensile_db
ARG VARIANT=cpu
RUN set -eux; \
    /usr/bin/python3.11 -m venv /opt/tensile/venv; \
    case "$VARIANT" in \
        cpu) /opt/tensile/venv/bin/pip install --no-cache-dir ".[demo]" ;; \
        cuda) /opt/tensile/venv/bin/pip install --no-cache-dir ".[cuda,demo]" "cupy-cuda12x[ctk]>=14" ;; \
        *) echo "VARIANT must be cpu or cuda, got $VARIANT" >&2; exit 1 ;; \
    esac; \
    /opt/tensile/venv/bin/python -m pip uninstall -q -y pip setuptools wheel; \
    cd /opt/tensile/venv/lib && for f in libdnnl.so libdnnl.so.3; do ln -sf libdnnl.so.3.2 "$f"; done && cd /src; \
    find /opt/tensile/venv/lib/python3.11/site-packages -depth -type d -name tests -exec rm -rf {} +; \
    /opt/tensile/venv/bin/python -c "import tensile_db, scipy.optimize, sklearn.datasets, palmerpenguins; \
        from tensile_db.runtime import fused; assert fused.enabled(), 'the fused optimiser steps were not built'"

# The extension (its C module, control file and install script), staged under /staging for the
# final image.
COPY extension/Makefile extension/tensile_db.control extension/tensile_db.c extension/reader.c ./extension/
COPY sql ./sql
RUN make -C extension install DESTDIR=/staging \
        PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config

FROM postgres:15-bookworm

# PL/Python 3 for PostgreSQL 15 (embeds Debian's libpython3.11), the interpreter the coordinator
# runs in (the venv's bin/python links to /usr/bin/python3.11), and GNU OpenMP, which oneDNN's
# convolutions run their threads on.
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends postgresql-plpython3-15 python3.11 libgomp1; \
    rm -rf /var/lib/apt/lists/*

COPY --from=build /opt/tensile/venv /opt/tensile/venv
COPY --from=build /staging/ /

# The postmaster, and so PL/Python in every backend and the coordinator it starts, imports
# tensile_db (and NumPy, CuPy) from the venv.
ENV PYTHONPATH=/opt/tensile/venv/lib/python3.11/site-packages \
    PATH=$PATH:/opt/tensile/venv/bin \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# Run once, on an empty data directory: tensile.* settings and CREATE EXTENSION.
COPY docker/initdb/10-tensile.sh /docker-entrypoint-initdb.d/10-tensile.sh
RUN chmod 0755 /docker-entrypoint-initdb.d/10-tensile.sh

# The postgres image's entrypoint, after bringing an existing volume's tensile_db to this image's
# version (docker/tensile-entrypoint.sh). A new ENTRYPOINT clears the base image's CMD: set again.
COPY docker/tensile-entrypoint.sh /usr/local/bin/tensile-entrypoint.sh
RUN chmod 0755 /usr/local/bin/tensile-entrypoint.sh
ENTRYPOINT ["tensile-entrypoint.sh"]
CMD ["postgres"]

# STOPSIGNAL, VOLUME and EXPOSE are the postgres image's.
