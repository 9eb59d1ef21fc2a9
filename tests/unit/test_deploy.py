"""deploy/ parses, and every file names the real entrypoint (checked against the CLI), one image, the
pool's ports and the versions pyproject.toml pins. Docker is not here, so the image is not built."""

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from draftwire_cli.parser import parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
IMAGE = "ghcr.io/draftwire/verifier:0.1.0"
FRONT_PORT = 50051


def pins() -> dict[str, str]:
    """name -> version of every `name==version` dependency in pyproject.toml, extras included."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = [
        *project["dependencies"],
        *(d for extra in project["optional-dependencies"].values() for d in extra),
    ]
    return {m[1]: m[2] for d in deps if (m := re.fullmatch(r"([\w-]+)(?:\[[\w,]+\])?==([\w.]+)", d))}


def check_entrypoint(argv: list[str]) -> None:
    """A `draftwire serve --ray` command line that the CLI accepts, serving the front on its port."""
    assert argv[0] == "draftwire"
    args = parser().parse_args(argv[1:])
    assert args.command == "serve" and args.ray
    assert (args.host, args.port) == ("0.0.0.0", FRONT_PORT)
    assert str(args.target) == "/models/target"
    assert args.gpus_per_replica == 1
    # It listens on every address: only over TLS, and only for clients with a token.
    assert args.tls_cert and args.tls_key and args.auth_tokens
    assert all(str(f).startswith("/etc/draftwire/") for f in (args.tls_cert, args.tls_key, args.auth_tokens))


def test_dockerfile_builds_on_the_pinned_ray_and_runs_the_pool():
    text = (DEPLOY / "Dockerfile").read_text()
    versions = pins()
    assert re.search(rf"^FROM rayproject/ray:{re.escape(versions['ray'])}-py311-gpu$", text, re.M)
    for name in ("torch", "transformers", "tokenizers", "grpcio", "grpcio-health-checking"):
        assert f"{name}=={versions[name]}" in text, name
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for package in (p.rstrip("*") for p in packages["include"]):
        assert re.search(rf"^COPY .* {package} \./{package}$", text, re.M), package
    assert set(re.search(r"^EXPOSE (.+)$", text, re.M)[1].split()) == {str(FRONT_PORT), "6379", "8265"}
    check_entrypoint(json.loads(re.search(r"^CMD (\[.+\])$", text, re.M)[1]))
    assert IMAGE in text  # the build command in the header names the image the manifests use


def test_ray_cluster_config_for_ray_up():
    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    assert config["docker"]["image"] == IMAGE
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"] == {"CPU": 0}
    gpu = types["gpu_worker"]
    assert gpu["node_config"]["InstanceType"].startswith("g") and gpu["max_workers"] <= config["max_workers"]
    start = " ".join(config["head_start_ray_commands"] + config["worker_start_ray_commands"])
    assert start.count("RAY_AUTH_MODE=token ray start") == 2 and "--dashboard-port=8265" in start
    assert "~/.ray/auth_token" in config["file_mounts"]
    # The header's `ray job submit` command (comment lines, joined where they end in a backslash).
    comments = "\n".join(
        line[2:] for line in (DEPLOY / "ray-cluster.yaml").read_text().splitlines() if line[:1] == "#"
    )
    [submit] = [line for line in comments.replace("\\\n", " ").splitlines() if "ray job submit" in line]
    check_entrypoint(shlex.split(submit.split(" -- ", 1)[1]))


def test_kuberay_rayjob_and_service():
    job, service = yaml.safe_load_all((DEPLOY / "kuberay-rayjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    check_entrypoint(shlex.split(job["spec"]["entrypoint"]))
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == pins()["ray"] and cluster["authOptions"] == {"mode": "token"}
    head = cluster["headGroupSpec"]["template"]
    workers = [g["template"] for g in cluster["workerGroupSpecs"]]
    containers = [c for t in (head, *workers) for c in t["spec"]["containers"]]
    assert {c["image"] for c in containers} == {IMAGE}
    head_ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    assert head_ports == {"gcs-server": 6379, "dashboard": 8265, "draftwire": FRONT_PORT}
    for worker in workers:
        assert worker["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"

    assert service["kind"] == "Service"
    assert service["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    [port] = service["spec"]["ports"]
    assert (port["port"], port["targetPort"]) == (FRONT_PORT, "draftwire")


@pytest.mark.parametrize("name", ["Dockerfile", "ray-cluster.yaml", "kuberay-rayjob.yaml"])
def test_deploy_readme_lists_each_file(name):
    assert f"`{name}`" in (DEPLOY / "README.md").read_text()
