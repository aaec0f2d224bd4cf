"""Kubernetes manifests: parsed, structure checked, ports and probes equal to what the CLI serves."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.cli_options import env_name
from tests.deploy.helpers import DEPLOY, ROOT, default_ports, port_of, run_default, stop_budget

K8S = DEPLOY / "k8s"
ENGINES = ["vllm", "sglang", "trtllm"]
MODES = ["agg", "disagg"]
FILES = sorted(K8S.glob("*/*.yaml"))
ENGINE_NAMES = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm"}


def load(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, path
    return docs


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def engine_pods(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(role, pod spec) of every engine pod: DGD worker/prefill/decode components or Deployments."""
    pods = []
    for doc in docs:
        if doc["kind"] == "DynamoGraphDeployment":
            for comp in doc["spec"]["components"]:
                if comp["type"] != "frontend":
                    pods.append((comp["type"], comp["podTemplate"]["spec"]))
        elif doc["kind"] == "Deployment":
            role = doc["spec"]["template"]["metadata"]["labels"]["openengine.dev/role"]
            pods.append(("worker" if role == "aggregated" else role, doc["spec"]["template"]["spec"]))
    return pods


def named_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def test_every_engine_and_mode_has_both_flavours() -> None:
    expected = {K8S / kind / f"{e}-{m}.yaml" for kind in ("dynamo", "plain") for e in ENGINES for m in MODES}
    expected |= {K8S / "gie" / f"{e}-agg.yaml" for e in ENGINES}  # GIE: aggregated engines
    assert set(FILES) == expected


def test_generated_files_are_fresh() -> None:
    result = subprocess.run(
        [sys.executable, str(K8S / "generate.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", [p for p in FILES if p.parent.name == "dynamo"], ids=lambda p: p.name)
def test_dynamo_graph_deployment(path: Path) -> None:
    docs = load(path)
    graphs = [d for d in docs if d["kind"] == "DynamoGraphDeployment"]
    assert len(graphs) == 1 and {d["kind"] for d in docs} <= {"DynamoGraphDeployment", "ConfigMap"}
    graph = graphs[0]
    assert graph["apiVersion"] == "nvidia.com/v1beta1"
    assert "services" not in graph["spec"], "v1alpha1's spec.services map is deprecated"
    components = graph["spec"]["components"]
    for comp in components:
        assert {"name", "type", "replicas", "podTemplate"} <= comp.keys()
        assert comp["type"] in {"frontend", "worker", "prefill", "decode"}
        assert isinstance(comp["replicas"], int) and comp["replicas"] >= 1
        assert any(c["name"] == "main" for c in comp["podTemplate"]["spec"]["containers"])
    assert len({c["name"] for c in components}) == len(components)
    types = sorted(c["type"] for c in components)
    assert types == (
        ["frontend", "worker"] if path.stem.endswith("-agg") else ["decode", "frontend", "prefill"]
    )
    assert graph["spec"]["backendFramework"] == path.stem.split("-")[0]


@pytest.mark.parametrize("path", [p for p in FILES if p.parent.name == "gie"], ids=lambda p: p.name)
def test_gie_inference_pool_selects_the_sidecar_pods(path: Path) -> None:
    """GIE's InferencePool (inference.networking.k8s.io/v1) selects the Deployment's pods on the
    OpenAI front's port, names its endpoint picker, and an HTTPRoute sends a Gateway's traffic to it."""
    docs = load(path)
    assert {d["kind"] for d in docs} <= {"Deployment", "Service", "ConfigMap", "InferencePool", "HTTPRoute"}
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    (pool,) = [d for d in docs if d["kind"] == "InferencePool"]
    (route,) = [d for d in docs if d["kind"] == "HTTPRoute"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"] and spec["selector"]["matchLabels"].items() <= labels.items()
    (main,) = dep["spec"]["template"]["spec"]["containers"]
    assert [p["number"] for p in spec["targetPorts"]] == [named_port(main, "openai")]
    epp = spec["endpointPickerRef"]
    assert (
        epp["name"]
        and 1 <= epp["port"]["number"] <= 65535
        and epp["failureMode"] in ("FailOpen", "FailClose")
    )
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    refs = [r for rule in route["spec"]["rules"] for r in rule["backendRefs"]]
    assert refs == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"


@pytest.mark.parametrize("path", [p for p in FILES if p.parent.name == "plain"], ids=lambda p: p.name)
def test_plain_deployments_and_services(path: Path) -> None:
    docs = load(path)
    assert {d["kind"] for d in docs} <= {"Deployment", "Service", "ConfigMap"}
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert len(deployments) == (1 if path.stem.endswith("-agg") else 2)
    for dep in deployments:
        assert dep["apiVersion"] == "apps/v1"
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
        svc = services[dep["metadata"]["name"]]
        assert svc["spec"]["selector"].items() <= labels.items()
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == default_ports()


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_engine_pod(path: Path) -> None:
    engine_key = path.stem.split("-")[0]
    docs = load(path)
    pods = engine_pods(docs)
    assert sorted(r for r, _ in pods) == (["worker"] if path.stem.endswith("-agg") else ["decode", "prefill"])
    config_maps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    extra = {"openai": GIE_PORT} if path.parent.name == "gie" else {}
    for role, pod in pods:
        check_pod(engine_key, role, pod, config_maps, extra)


#: The OpenAI front's port in the GIE manifests.
GIE_PORT = 8000


def check_pod(
    engine_key: str, role: str, pod: dict[str, Any], config_maps: set[str], extra_ports: dict[str, int]
) -> None:
    (engine,) = pod["initContainers"]
    (main,) = pod["containers"]
    assert engine["name"] == "engine" and main["name"] == "main"
    # The GPU engine: a native sidecar with a startup probe, holding the GPU.
    assert engine["restartPolicy"] == "Always"
    assert engine["startupProbe"]["failureThreshold"] * engine["startupProbe"]["periodSeconds"] >= 600
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in main.get("resources", {}).get("limits", {})
    # The sidecar: the CLI's entry point, its default ports, probes on what `run` serves.
    assert main["command"] == ["openengine-sidecar"] and main["args"] == ["run"]
    env = env_of(main)
    ports = default_ports()
    assert port_of(env[env_name("--listen")]) == ports["ws"]
    assert port_of(env[env_name("--http-listen")]) == ports["http"]
    assert port_of(env[env_name("--kv-publish")]) == ports["kv-pub"]
    assert port_of(env[env_name("--kv-replay")]) == ports["kv-replay"]
    assert env[env_name("--expected-engine")] == ENGINE_NAMES[engine_key]
    assert env[env_name("--kv-advertise-host")] == {"fieldRef": {"fieldPath": "status.podIP"}}
    for probe, path in (
        ("readinessProbe", "/ready"),
        ("livenessProbe", "/health"),
        ("startupProbe", "/health"),
    ):
        get = main[probe]["httpGet"]
        assert get["path"] == path and named_port(main, get["port"]) == ports["http"], probe
    assert {p["name"]: p["containerPort"] for p in main["ports"]} == {**ports, **extra_ports}
    if "openai" in extra_ports:
        assert port_of(env[env_name("--openai-listen")]) == extra_ports["openai"]
    # Drain fits in the grace period.
    drain = float(env.get(env_name("--drain-timeout"), run_default("drain_timeout")))
    dynamo = env.get(env_name("--dynamo")) == "true"
    assert pod["terminationGracePeriodSeconds"] > stop_budget(drain, dynamo=dynamo)
    # The engine's Unix socket, shared through an emptyDir mounted in both containers.
    socket = env[env_name("--engine")]
    assert socket.startswith("unix:///")
    socket_path = socket.removeprefix("unix://")
    args = engine["args"]
    assert args[args.index("--openengine-socket") + 1] == socket_path
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (engine, main)}
    socket_dir = str(Path(socket_path).parent)
    shared = mounts["engine"][socket_dir]
    assert mounts["main"][socket_dir] == shared and "emptyDir" in volumes[shared]
    # Model/tokenizer and LoRA caches at the same paths in both containers (paths in the card agree).
    for name in ("model-cache", "lora-cache"):
        (path,) = [p for p, v in mounts["engine"].items() if v == name]
        assert mounts["main"].get(path) == name, name
    # Socket permissions: non-root sidecar in the group that owns the socket directory.
    assert main["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["fsGroup"] == main["securityContext"]["runAsGroup"]
    assert engine["command"][:3] == ["/bin/sh", "-c", 'umask 0002 && exec "$@"']
    # No two listeners of the pod on one port.
    all_ports = [p["containerPort"] for c in (engine, main) for p in c.get("ports", [])]
    assert len(all_ports) == len(set(all_ports))
    engine_env = env_of(engine)
    for value in engine_env.values():
        if isinstance(value, str) and value.isdigit():
            assert int(value) not in ports.values(), f"engine setting {value} collides with a sidecar port"
    for vol in pod["volumes"]:
        if "configMap" in vol:
            assert vol["configMap"]["name"] in config_maps
    if engine_key == "sglang" and role == "prefill":
        assert engine_env["OPENENGINE_ADVERTISED_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert {"name": "bootstrap", "containerPort": 8998} in engine["ports"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_assumed_flags_are_marked(path: Path) -> None:
    for line in path.read_text().splitlines():
        if "--openengine-socket" in line and not line.lstrip().startswith("#"):
            assert "# ASSUMPTION" in line, line


def _dynamo_pin() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["dynamo"]
    return next(d for d in extra if d.startswith("ai-dynamo-runtime==")).split("==", 1)[1]


def all_containers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every container and init container of every pod, the DGD frontend included."""
    specs = [pod for _, pod in engine_pods(docs)]
    for doc in docs:
        if doc["kind"] == "DynamoGraphDeployment":
            specs += [c["podTemplate"]["spec"] for c in doc["spec"]["components"] if c["type"] == "frontend"]
    return [c for spec in specs for c in [*spec.get("initContainers", []), *spec["containers"]]]


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_operator_rules(path: Path) -> None:
    """Applicable as they are: pinned images, CPU and memory requests and a memory limit on every
    container, the Dynamo runtime version stated on every DGD component."""
    docs = load(path)
    containers = all_containers(docs)
    assert len(containers) == len(engine_pods(docs)) * 2 + (1 if path.parent.name == "dynamo" else 0)
    for c in containers:
        _repository, sep, tag = c["image"].rpartition(":")
        assert sep and "/" not in tag and tag != "latest", f"{c['name']}: unpinned image {c['image']}"
        resources = c["resources"]
        assert {"cpu", "memory"} <= resources["requests"].keys(), c["name"]
        assert "memory" in resources["limits"], c["name"]
    for doc in docs:
        if doc["kind"] == "DynamoGraphDeployment":
            for comp in doc["spec"]["components"]:
                assert comp["runtimeVersionOverride"] == _dynamo_pin(), comp["name"]
