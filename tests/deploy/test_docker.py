"""docker/ validated statically (no Docker engine here or in CI): the gateway Dockerfile's stages,
user, healthcheck and entrypoint, the compose stack's files and commands, Grafana provisioning.
The entrypoint must be the command `make run` runs (`dflash-gateway serve`)."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from app.__main__ import build_parser
from tests.deploy.conftest import ROOT

DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "gateway.Dockerfile"
COMPOSE = DOCKER / "compose.yaml"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", path.read_text())
    result = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def make_run_command() -> list[str]:
    """The recipe of `make run`, with $(BIN)/ dropped and its variants' flags left out (PD=1's
    `$(if $(PD),--pd-disaggregation)`): the command a developer runs."""
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^run:.*\n\t(.+)$", text, re.M)
    assert recipe, "Makefile has no run target"
    words = shlex.split(re.sub(r"\$\(if \$\(\w+\),[^)]*\)", "", recipe.group(1)))
    return [words[0].rsplit("/", 1)[-1], *words[1:]]


def test_entrypoint_is_the_command_make_run_runs() -> None:
    [entrypoint] = [json.loads(a) for i, a in instructions(DOCKERFILE) if i == "ENTRYPOINT"]
    assert entrypoint == ["dflash-gateway", "serve"]
    assert make_run_command() == entrypoint
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["dflash-gateway"] == "app.__main__:main"
    [cmd] = [json.loads(a) for i, a in instructions(DOCKERFILE) if i == "CMD"]
    args = build_parser().parse_args(["serve", *cmd])
    assert (args.host, args.port) == ("0.0.0.0", 8000)


def test_multi_stage_slim_python_non_root() -> None:
    steps = instructions(DOCKERFILE)
    stages = [a for i, a in steps if i == "FROM"]
    assert stages == ["python:3.11-slim AS build", "python:3.11-slim AS runtime"]
    runtime = steps[[i for i, (ins, _) in enumerate(steps) if ins == "FROM"][-1] :]
    [user] = [a for i, a in runtime if i == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) >= 10000
    assert any(i == "COPY" and a.startswith("--from=build") for i, a in runtime)
    assert [a for i, a in runtime if i == "EXPOSE"] == ["8000"]


def test_healthcheck_probes_livez() -> None:
    [check] = [a for i, a in instructions(DOCKERFILE) if i == "HEALTHCHECK"]
    assert "/livez" in check and "CMD" in check


def test_image_has_no_torch() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = " ".join(project["dependencies"]).lower()
    assert "torch" not in deps and "sglang" not in deps
    text = DOCKERFILE.read_text()
    assert "torch" not in re.sub(r"#.*", "", text)
    # The runtime dependencies plus the otel extra (tracing), no other extra such as [worker].
    assert "pip install --no-index --find-links=/wheels 'dflash-gateway[otel]'" in text
    otel = " ".join(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
            "otel"
        ]
    ).lower()
    assert "torch" not in otel and "sglang" not in otel


def test_copied_sources_exist_and_pass_the_dockerignore() -> None:
    ignore = (DOCKER / "gateway.Dockerfile.dockerignore").read_text().splitlines()
    allowed = [p[1:] for p in ignore if p.startswith("!")]
    for ins, args in instructions(DOCKERFILE):
        if ins != "COPY" or args.startswith("--from"):
            continue
        *sources, _dest = args.split()
        for src in sources:
            assert (ROOT / src).exists(), src
            assert any(a == src or a.startswith(f"{src}/") for a in allowed), (
                f"{src} is dockerignored"
            )


def test_compose_parses_and_its_files_exist() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"worker-0", "worker-1", "gateway", "prometheus", "grafana"}
    for name, svc in services.items():
        build = svc.get("build")
        if build:
            context = (DOCKER / build["context"]).resolve()
            assert context == ROOT
            assert (context / build["dockerfile"]).resolve() == DOCKERFILE
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name}: {source}"
        assert ":latest" not in svc.get("image", ""), name
        if "image" in svc and "build" not in svc:
            assert re.search(r":v?\d+\.\d+", svc["image"]), f"{name}: pin the image version"


def test_compose_gateway_and_emulator_commands_parse() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    parser = build_parser()
    gateway = services["gateway"]
    assert "entrypoint" not in gateway  # the image's: dflash-gateway serve
    args = parser.parse_args(["serve", *gateway["command"]])
    assert args.worker_urls == ["http://worker-0:30000", "http://worker-1:30000"]
    assert args.host == "0.0.0.0"
    for worker in ("worker-0", "worker-1"):
        svc = services[worker]
        assert svc["entrypoint"] == ["dflash-gateway", "emulate"]
        emu = parser.parse_args(["emulate", *svc["command"]])
        assert (emu.host, emu.port) == ("0.0.0.0", 30000)
        assert "/health" in " ".join(svc["healthcheck"]["test"])
    assert gateway["depends_on"] == {
        "worker-0": {"condition": "service_healthy"},
        "worker-1": {"condition": "service_healthy"},
    }


def test_compose_prometheus_scrapes_the_stack() -> None:
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = {
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    assert targets == {"gateway:8000", "worker-0:30000", "worker-1:30000"}
    prometheus = yaml.safe_load(COMPOSE.read_text())["services"]["prometheus"]
    mounts = dict(v.split(":")[:2] for v in prometheus["volumes"] if v.startswith("."))
    assert mounts["../deploy/prometheus/rules.yaml"] in config["rule_files"]


@pytest.mark.parametrize(
    "path", sorted((DOCKER / "grafana" / "provisioning").rglob("*.yaml")), ids=lambda p: p.name
)
def test_grafana_provisioning_parses(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    assert data["apiVersion"] == 1


def test_grafana_gets_the_dashboard_and_the_datasource() -> None:
    grafana = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    provisioning = DOCKER / "grafana" / "provisioning"
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "dflash-gateway.yaml").read_text())[
        "providers"
    ]
    dashboards_dir = provider["options"]["path"]
    assert mounts["../deploy/grafana"] == dashboards_dir
    assert (ROOT / "deploy" / "grafana" / "dflash-gateway.json").exists()
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"


def test_deploy_docs_say_docker_is_validated_statically() -> None:
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    assert "helm install" in deploy
    assert re.search(r"validated statically|static(ally)? validat", deploy)


def test_build_stage_context_builds_the_gateway_wheel(tools: Path, tmp_path: Path) -> None:
    """Replay the build stage without Docker: copy exactly what its COPY lines copy (through the
    .dockerignore) into an empty directory and build the wheel there. The wheel must carry the
    `dflash-gateway` console script the runtime stage's ENTRYPOINT runs."""
    import shutil
    import subprocess
    import zipfile

    context = tmp_path / "context"
    context.mkdir()
    for ins, args in instructions(DOCKERFILE):
        if ins != "COPY" or args.startswith("--from"):
            continue
        *sources, _dest = args.split()
        for src in sources:
            if (ROOT / src).is_dir():
                shutil.copytree(
                    ROOT / src, context / src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
                )
            else:
                shutil.copy2(ROOT / src, context / src)
    out = tmp_path / "wheels"
    done = subprocess.run(
        [tools / "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", out, "."],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [wheel] = out.glob("dflash_gateway-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        [entry_points] = [n for n in names if n.endswith("entry_points.txt")]
        scripts = zf.read(entry_points).decode()
    assert "dflash-gateway = app.__main__:main" in scripts
    assert "app/__main__.py" in names
    assert not [n for n in names if n.startswith("tests/")]
    # The benchmarks stay out of the image: its CLI has no `bench` (its entry point finds no
    # module and is left out).
    assert not [n for n in names if n.startswith("loadtest/")]
