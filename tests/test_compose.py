"""Check the container setup (``docker-compose.yml``, its GPU override ``docker-compose.gpu.yml``,
``Dockerfile``, the init script) by its structure.

No Docker engine runs here, so nothing is built: the compose tool validates the compose files
(``docker-compose config``, Debian's package), PyYAML parses them, the Dockerfile and init script
are read as text, and the tests assert what a deployment relies on (CPU by default, the GPU
reservation in the override, loopback-only port, persistent volume, PL/Python, the venv on Python
3.11, the PGXS install, and the init script's settings and CREATE EXTENSION).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "docker-compose.gpu.yml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def gpu_db() -> dict:
    """The GPU override's settings of the service db."""
    return yaml.safe_load(GPU_OVERRIDE.read_text())["services"]["db"]


def _environment(service: dict) -> dict:
    env = service.get("environment", {})
    return dict(item.partition("=")[::2] for item in env) if isinstance(env, list) else env


@pytest.fixture(scope="module")
def db(compose) -> dict:
    assert "db" in compose.get("services", {}), "docker-compose.yml has no service 'db'"
    return compose["services"]["db"]


def _dockerfile_path(db: dict) -> Path:
    build = db["build"]
    if isinstance(build, str):
        return (ROOT / build / "Dockerfile").resolve()
    return (ROOT / build.get("context", ".") / build.get("dockerfile", "Dockerfile")).resolve()


@pytest.fixture(scope="module")
def dockerfile(db) -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (INSTRUCTION, arguments), continuation lines joined."""
    text = _dockerfile_path(db).read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, args = line.partition(" ")
            out.append((keyword.upper(), " ".join(args.split())))
    return out


def _runs(dockerfile) -> str:
    return "\n".join(args for keyword, args in dockerfile if keyword == "RUN")


def _final_stage(dockerfile) -> list[tuple[str, str]]:
    starts = [i for i, (keyword, _) in enumerate(dockerfile) if keyword == "FROM"]
    assert starts, "the Dockerfile has no FROM"
    return dockerfile[starts[-1]:]


def _init_scripts(dockerfile) -> list[Path]:
    """Repository files the final stage copies into /docker-entrypoint-initdb.d/."""
    scripts = []
    for keyword, args in _final_stage(dockerfile):
        if keyword not in ("COPY", "ADD"):
            continue
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        *sources, dest = words
        if dest.startswith("/docker-entrypoint-initdb.d"):
            for source in sources:
                path = ROOT / source
                scripts += sorted(path.glob("*.sh")) if path.is_dir() else [path]
    return scripts


# -- docker-compose.yml ------------------------------------------------------------------------


def test_db_builds_from_the_repository_dockerfile(db):
    assert "build" in db, "service db is not built from a Dockerfile"
    path = _dockerfile_path(db)
    assert path == ROOT / "Dockerfile"
    assert path.is_file()


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, GPU_OVERRIDE]], ids=["cpu", "gpu"])
def test_the_compose_tool_accepts_the_files(files):
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install docker-compose)")
    args = [a for f in files for a in ("-f", str(f))]
    result = subprocess.run(["docker-compose", *args, "config", "-q"], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, POSTGRES_PASSWORD="x"), timeout=60)
    assert result.returncode == 0, result.stderr


def test_db_runs_on_the_cpu_by_default(db):
    assert "deploy" not in db, "the base file must not reserve a GPU: a machine without one could not start it"
    assert _environment(db)["TENSILE_DEVICE"] == "${TENSILE_DEVICE:-cpu}"


def test_the_gpu_override_reserves_an_nvidia_gpu_and_sets_the_device(gpu_db):
    devices = gpu_db["deploy"]["resources"]["reservations"]["devices"]
    gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
    assert gpus, f"no nvidia device reservation with capability gpu: {devices}"
    assert gpus[0].get("count") == 1 or gpus[0].get("device_ids")
    env = _environment(gpu_db)
    assert env["TENSILE_DEVICE"] == "cuda" and "NVIDIA_VISIBLE_DEVICES" in env


def test_db_environment(db):
    env = _environment(db)
    assert "POSTGRES_PASSWORD" in env
    assert "TENSILE_DEVICE_BUDGET" in env


def test_db_healthcheck_uses_pg_isready(db):
    test = db["healthcheck"]["test"]
    command = test if isinstance(test, str) else " ".join(test)
    assert re.search(r"\bpg_isready\b", command), command


def test_db_host_port_is_tensile_port_defaulting_to_5432(db):
    assert db["ports"] == ["127.0.0.1:${TENSILE_PORT:-5432}:5432"]


def test_demo_service_runs_the_demo_against_db_once_it_is_healthy(compose, db):
    demo = compose["services"]["demo"]
    assert demo["image"] == db["image"], "the demo runs in the database's image"
    assert demo["profiles"] == ["demo"], "only `run demo` / `up demo` starts it, not a plain `up`"
    assert demo["depends_on"] == {"db": {"condition": "service_healthy"}}
    assert demo["restart"] == "no"
    argv = demo["entrypoint"] + demo["command"]
    assert argv[:3] == ["/opt/tensile/venv/bin/tensile-db", "demo", "--dsn"]
    conninfo = dict(item.split("=") for item in argv[3].split())
    assert conninfo["host"] == "db" and conninfo["user"] == "postgres"
    assert _environment(demo)["PGPASSWORD"] == _environment(db)["POSTGRES_PASSWORD"]


def test_the_gpu_override_builds_the_cuda_variant_for_db_and_demo(compose):
    override = yaml.safe_load(GPU_OVERRIDE.read_text())["services"]
    assert override["db"]["build"]["args"] == {"VARIANT": "cuda"}
    assert compose["services"]["db"]["build"]["args"] == {"VARIANT": "cpu"}
    assert override["db"]["image"] == override["demo"]["image"] != compose["services"]["db"]["image"]


def test_the_compose_check_is_a_make_target_outside_make_test():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^compose-check:.*\n\tbash docker/compose-check\.sh$", makefile, re.M)
    assert "compose-check" not in re.search(r"^test:.*$", makefile, re.M).group(0)
    script = (ROOT / "docker" / "compose-check.sh").read_text()
    for step in ("run --rm demo", "restart db", "VARIANT=cuda", "down -v", "CPU_IMAGE_LIMIT:-1200000000"):
        assert step in script, step


def test_db_port_is_published_on_loopback_only(db):
    ports = db["ports"]
    assert ports
    for port in ports:
        if isinstance(port, dict):
            assert port.get("host_ip") == "127.0.0.1", port
            assert int(port["target"]) == 5432
        else:
            host_ip, _, rest = str(port).partition(":")
            assert host_ip == "127.0.0.1", port
            assert rest.split(":")[-1].split("/")[0] == "5432", port


def test_db_data_directory_is_a_declared_named_volume(compose, db):
    mounts = {}
    for volume in db["volumes"]:
        if isinstance(volume, dict):
            mounts[volume["target"]] = volume["source"]
        else:
            source, target = volume.split(":")[:2]
            mounts[target] = source
    source = mounts.get("/var/lib/postgresql/data")
    assert source, f"/var/lib/postgresql/data is not mounted: {db['volumes']}"
    assert source in (compose.get("volumes") or {}), f"volume {source!r} is not declared"


# -- Dockerfile --------------------------------------------------------------------------------


def test_dockerfile_is_postgres_15_bookworm_and_its_entrypoint_runs_the_images_after_the_update(dockerfile):
    froms = [args for keyword, args in dockerfile if keyword == "FROM"]
    assert froms[-1].split()[0] == "postgres:15-bookworm"
    final = _final_stage(dockerfile)
    assert [args for keyword, args in final if keyword == "ENTRYPOINT"] == ['["tensile-entrypoint.sh"]']
    # a new ENTRYPOINT clears the base image's CMD
    assert [args for keyword, args in final if keyword == "CMD"] == ['["postgres"]']
    assert "docker/tensile-entrypoint.sh /usr/local/bin/tensile-entrypoint.sh" in [
        args for keyword, args in final if keyword == "COPY"]
    script = (ROOT / "docker" / "tensile-entrypoint.sh").read_text()
    assert script.rstrip().endswith('exec docker-entrypoint.sh "$@"')
    assert "ALTER EXTENSION tensile_db UPDATE" in script and "docker_temp_server_start" in script


def test_dockerfile_installs_plpython_in_the_final_image(dockerfile):
    runs = "\n".join(args for keyword, args in _final_stage(dockerfile) if keyword == "RUN")
    assert re.search(r"apt-get install\b[^\n]*\bpostgresql-plpython3-15\b", runs), runs
    assert "--no-install-recommends" in runs


def test_dockerfile_creates_the_venv_with_python311_and_the_variants_extras(dockerfile):
    runs = _runs(dockerfile)
    assert re.search(r"/usr/bin/python3\.11 -m venv /opt/tensile/venv\b", runs), runs
    assert ("ARG", "VARIANT=cpu") in dockerfile
    installs = dict(re.findall(r"(\w+)\) /opt/tensile/venv/bin/pip install ([^;]*);", runs))
    assert set(installs) == {"cpu", "cuda"}, runs
    assert '".[demo]"' in installs["cpu"] and "cupy" not in installs["cpu"] and "cuda" not in installs["cpu"]
    assert '".[cuda,demo]"' in installs["cuda"] and '"cupy-cuda12x[ctk]' in installs["cuda"]


def test_dockerfile_installs_the_extension_with_pgxs(dockerfile):
    assert re.search(r"\bmake -C extension install\b", _runs(dockerfile))


def test_dockerfile_puts_the_venv_on_the_postmasters_pythonpath(dockerfile):
    env = " ".join(args for keyword, args in _final_stage(dockerfile) if keyword == "ENV")
    assert re.search(r"\bPYTHONPATH=/opt/tensile/venv/lib/python3\.11/site-packages\b", env), env


def test_dockerfile_copies_the_init_script(dockerfile):
    scripts = _init_scripts(dockerfile)
    assert scripts, "nothing is copied into /docker-entrypoint-initdb.d/"
    for script in scripts:
        assert script.is_file(), f"{script} is copied by the Dockerfile but is not in the repository"


# -- the init script ---------------------------------------------------------------------------


def test_init_script_sets_the_device_and_creates_the_extension(dockerfile):
    text = "\n".join(script.read_text() for script in _init_scripts(dockerfile))
    assert "postgresql.conf" in text
    assert re.search(r"^tensile\.device = '\$\{device\}'$", text, re.M), text
    assert '"${TENSILE_DEVICE:-cpu}"' in text and "cpu | cuda)" in text
    assert re.search(r"^tensile\.device_budget = '\$\{\w+(:-[^}]*)?\}'$", text, re.M), text
    assert re.search(r"^tensile\.python = '/opt/tensile/venv/bin/python'$", text, re.M), text
    assert "${TENSILE_DEVICE_BUDGET:-8GB}" in text
    assert re.search(r"CREATE EXTENSION (IF NOT EXISTS )?tensile_db CASCADE", text), text
