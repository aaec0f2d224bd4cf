"""Generate the Kubernetes manifests of deploy/k8s/ (run after changing this file or the CLI).

    .venv/bin/python deploy/k8s/generate.py          # rewrite deploy/k8s/{dynamo,plain,gie}/*.yaml
    .venv/bin/python deploy/k8s/generate.py --check  # exit 1 if a file is stale (tests run this)

One pod shape serves every engine and role: the GPU engine runs as a native sidecar (an
``initContainers`` entry with ``restartPolicy: Always`` and a startup probe), the sidecar is
the pod's ``main`` container, and the two share the engine's Unix socket through an
``emptyDir``. Ports, probe paths and the drain grace come from ``openengine-sidecar run``'s own
defaults, so the manifests cannot drift from the CLI.
"""

from __future__ import annotations

import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sidecar.cli_options import env_name
from sidecar.core.shutdown import stop_timeout
from sidecar.dynamo.plane import LEAVE_TIMEOUT
from sidecar.openengine.releases import SCHEMA_RELEASE
from sidecar.run_command import run as run_command

HERE = Path(__file__).resolve().parent


def _dynamo_version() -> str:
    with open(HERE.parent.parent / "pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["dynamo"]
    pin = next(d for d in extra if d.startswith("ai-dynamo-runtime=="))
    return pin.split("==", 1)[1]


MODEL = "Qwen/Qwen3-0.6B"
MODEL_DIR = f"/models/{MODEL}"  # pre-populated on the model-cache volume (see deploy/README.md)
#: Images are pinned, never ``:latest``: change these (and regenerate) to deploy other builds.
#: The sidecar image is this project's (deploy/container/Containerfile), tagged with its version.
SIDECAR_IMAGE = "registry.example.com/openengine-sidecar:0.1.0"
#: Tag of the engines' OpenEngine images (``<engine>-openengine``, built from the engine forks).
ENGINE_IMAGE_TAG = "openengine-v1-r3"
#: The Dynamo release the sidecar's Dynamo plane is built against (pyproject.toml's pin of
#: ai-dynamo-runtime): the DGD frontend image and every component's ``runtimeVersionOverride``
#: (the operator would otherwise read the runtime version from the ``main`` image tag, which is
#: the sidecar's own version).
DYNAMO_VERSION = _dynamo_version()
FRONTEND_IMAGE = f"nvcr.io/nvidia/ai-dynamo/dynamo-frontend:{DYNAMO_VERSION}"
#: CPU and memory of every container. No CPU limit on the engine (throttling stalls decoding).
ENGINE_RESOURCES = {
    "requests": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"},
    "limits": {"memory": "48Gi", "nvidia.com/gpu": "1"},
}
SIDECAR_RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}}
FRONTEND_RESOURCES = {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}}
SOCKET_DIR = "/run/openengine"
SOCKET = f"{SOCKET_DIR}/engine.sock"
SIDECAR_UID = 10001  # the container image's user (deploy/container/Containerfile)
GRACE_SECONDS = 60
DRAIN_TIMEOUT = 20  # set explicitly in every pod; GRACE_SECONDS must exceed the stop timeout


def _default(name: str) -> Any:
    return next(p.default for p in run_command.params if p.name == name)


def _port(address: str) -> int:
    return int(str(address).rpartition(":")[2])


PORTS = {
    "ws": _port(_default("listen")),
    "http": _port(_default("http_listen")),
    "kv-pub": _port(_default("kv_publish")),
    "kv-replay": _port(_default("kv_replay")),
}
#: The longest stop of a sidecar in these pods (with the Dynamo plane leaving first).
STOP_TIMEOUT = stop_timeout(
    DRAIN_TIMEOUT, _default("abort_timeout"), LEAVE_TIMEOUT + _default("dynamo_unregister_grace")
)
assert STOP_TIMEOUT < GRACE_SECONDS

#: Comments appended to generated lines containing the key (the YAML emitter drops comments).
LINE_COMMENTS = {
    "- --openengine-socket": "ASSUMPTION: fork flag for a Unix-socket listener (see header)",
    "name: OPENENGINE_SCHEMA_RELEASE": "OpenEngine fork: schema release the engine reports",
    "name: OPENENGINE_ADVERTISED_HOST": "OpenEngine fork: host advertised as the bootstrap endpoint",
    "name: SGLANG_HOST_IP": "upstream SGLang: local IP of its disaggregation endpoints",
    "name: VLLM_NIXL_SIDE_CHANNEL_PORT": "off vLLM's default 5600, the sidecar's KV publish port",
    "restartPolicy: Always": "native sidecar: starts first, stops after main",
    "terminationGracePeriodSeconds:": f"> drain timeout {DRAIN_TIMEOUT} s + abort timeout + engine shutdown",
    "runtimeVersionOverride:": "the Dynamo release the sidecar's runtime is built against (not the image tag)",
}


@dataclass(frozen=True)
class Engine:
    key: str  # file name prefix
    title: str
    name: str  # engine_name the engine reports (OPENENGINE_SIDECAR_EXPECTED_ENGINE)
    backend: str  # DGD spec.backendFramework
    image: str
    header: str
    roles: dict[str, list[str]] = field(default_factory=dict)  # role -> extra engine args
    env: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # role -> extra engine env
    ports: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # role -> extra engine ports
    config: dict[str, str] = field(default_factory=dict)  # role -> LLM-API options file (TensorRT-LLM)

    def command(self, role: str) -> list[str]:
        """The engine's argv (after the umask wrapper)."""
        return _ENGINE_COMMANDS[self.key](self, role)


def _pod_ip(name: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def _kv_events_vllm() -> str:
    return '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557","topic":"kv-events"}'


def _vllm(engine: Engine, role: str) -> list[str]:
    args = ["vllm", "serve", MODEL_DIR, "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", "8001"]
    args += ["--openengine-socket", SOCKET, "--enable-lora", "--max-loras", "4"]
    args += ["--kv-events-config", _kv_events_vllm()]
    return args + engine.roles.get(role, [])


def _sglang(engine: Engine, role: str) -> list[str]:
    args = ["python3", "-m", "sglang.launch_server", "--model-path", MODEL_DIR, "--served-model-name", MODEL]
    # Disaggregated: SGLang's --host also binds the bootstrap server decode pods dial, so not loopback.
    host = "127.0.0.1" if role == "worker" else "0.0.0.0"
    args += [
        "--host",
        host,
        "--port",
        "8001",
        "--openengine-socket",
        SOCKET,
        "--page-size",
        "16",
        "--enable-lora",
    ]
    args += ["--kv-events-config", '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557","topic":""}']
    return args + engine.roles.get(role, [])


def _trtllm(engine: Engine, role: str) -> list[str]:
    args = ["trtllm-serve", MODEL_DIR, "--backend", "pytorch", "--host", "127.0.0.1", "--port", "8001"]
    args += ["--config", "/etc/trtllm/engine.yaml", "--openengine-socket", SOCKET]
    return args + engine.roles.get(role, [])


_ENGINE_COMMANDS = {"vllm": _vllm, "sglang": _sglang, "trtllm": _trtllm}

_ASSUMED = """#
# ASSUMPTION (marked "ASSUMPTION" below): the OpenEngine forks of the engines, as Dynamo's
# OpenEngine examples launch them, document a TCP listener only (--openengine-host H
# --openengine-port P). This pod shares the engine's Unix socket through an emptyDir, so it
# passes `--openengine-socket /run/openengine/engine.sock`; if your engine build lacks a Unix
# listener, replace that flag with `--openengine-host 127.0.0.1 --openengine-port 50051` and set
# OPENENGINE_SIDECAR_ENGINE=127.0.0.1:50051 in the main container (pods share loopback).
"""

ENGINES = [
    Engine(
        key="vllm",
        title="vLLM",
        name="vllm",
        backend="vllm",
        image=f"registry.example.com/vllm-openengine:{ENGINE_IMAGE_TAG}",
        header="vLLM: upstream `vllm serve` flags (docs.vllm.ai; NixlConnector for prefill/decode) plus the\n"
        "# OpenEngine fork's server (OPENENGINE_SCHEMA_RELEASE, the OpenEngine listener flag).",
        roles={
            "prefill": ["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'],
            "decode": ["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'],
        },
        env={
            "prefill": [
                _pod_ip("VLLM_NIXL_SIDE_CHANNEL_HOST"),
                {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": "5800"},
            ],
            "decode": [
                _pod_ip("VLLM_NIXL_SIDE_CHANNEL_HOST"),
                {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": "5800"},
            ],
        },
        ports={
            "prefill": [{"name": "nixl", "containerPort": 5800}],
            "decode": [{"name": "nixl", "containerPort": 5800}],
        },
    ),
    Engine(
        key="sglang",
        title="SGLang",
        name="sglang",
        backend="sglang",
        image=f"registry.example.com/sglang-openengine:{ENGINE_IMAGE_TAG}",
        header="SGLang: upstream `python3 -m sglang.launch_server` flags (docs.sglang.ai; PD disaggregation over\n"
        "# NIXL) plus the OpenEngine fork's server (OPENENGINE_SCHEMA_RELEASE, OPENENGINE_ADVERTISED_HOST, the\n"
        "# OpenEngine listener flag). The prefill pod advertises its pod IP (downward API) as the\n"
        "# bootstrap host: the engine reports it in kv_connector.local_endpoints, the client puts it in\n"
        "# KvBootstrap, the decode pod dials it.",
        roles={
            "prefill": [
                "--disaggregation-mode",
                "prefill",
                "--disaggregation-transfer-backend",
                "nixl",
                "--disaggregation-bootstrap-port",
                "8998",
            ],
            "decode": ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl"],
        },
        env={
            "prefill": [_pod_ip("OPENENGINE_ADVERTISED_HOST"), _pod_ip("SGLANG_HOST_IP")],
            "decode": [_pod_ip("SGLANG_HOST_IP")],
        },
        ports={"prefill": [{"name": "bootstrap", "containerPort": 8998}]},
    ),
    Engine(
        key="trtllm",
        title="TensorRT-LLM",
        name="tensorrt_llm",
        backend="trtllm",
        image=f"registry.example.com/tensorrtllm-openengine:{ENGINE_IMAGE_TAG}",
        header="TensorRT-LLM: upstream `trtllm-serve MODEL --backend pytorch` with LLM-API options from a ConfigMap\n"
        "# (--config; --server_role CONTEXT|GENERATION and cache_transceiver_config for prefill/decode,\n"
        "# TensorRT-LLM's disaggregated serving docs) plus the OpenEngine fork's server\n"
        "# (OPENENGINE_SCHEMA_RELEASE, the OpenEngine listener flag).",
        roles={
            "prefill": ["--server_role", "CONTEXT"],
            "decode": ["--server_role", "GENERATION"],
        },
        config={
            "worker": "kv_cache_config:\n  enable_block_reuse: true\n  free_gpu_memory_fraction: 0.85\n",
            "prefill": "disable_overlap_scheduler: true\ncache_transceiver_config:\n  backend: DEFAULT\n"
            "kv_cache_config:\n  enable_block_reuse: true\n  free_gpu_memory_fraction: 0.85\n",
            "decode": "cache_transceiver_config:\n  backend: DEFAULT\n"
            "kv_cache_config:\n  enable_block_reuse: true\n  free_gpu_memory_fraction: 0.85\n",
        },
    ),
]


def _health_probe_exec() -> list[str]:
    """OpenEngine Control.Health over the Unix socket (the engine images ship python3 and grpcio)."""
    code = (
        "import grpc; grpc.insecure_channel('unix://" + SOCKET + "')"
        ".unary_unary('/openengine.v1.Control/Health')(b'', timeout=5)"
    )
    return ["python3", "-c", code]


def engine_container(engine: Engine, role: str, config_map: str | None) -> dict[str, Any]:
    env = [
        {"name": "HF_HOME", "value": "/models/.hf-home"},
        {"name": "OPENENGINE_SCHEMA_RELEASE", "value": SCHEMA_RELEASE},
        *engine.env.get(role, []),
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "engine-socket", "mountPath": SOCKET_DIR},
        {"name": "model-cache", "mountPath": "/models"},
        {"name": "lora-cache", "mountPath": "/lora-cache"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if config_map:
        mounts.append({"name": "engine-config", "mountPath": "/etc/trtllm", "readOnly": True})
    container: dict[str, Any] = {
        "name": "engine",
        "image": engine.image,
        "restartPolicy": "Always",
        # umask 0002: the socket is created group-writable; its directory is group-owned by the
        # pod's fsGroup, the non-root sidecar's group, so the sidecar may connect.
        "command": ["/bin/sh", "-c", 'umask 0002 && exec "$@"', "--"],
        "args": engine.command(role),
        "env": env,
        "startupProbe": {
            "exec": {"command": _health_probe_exec()},
            "periodSeconds": 10,
            "timeoutSeconds": 8,
            "failureThreshold": 180,  # up to 30 min to download and load the model
        },
        "resources": ENGINE_RESOURCES,
        "volumeMounts": mounts,
    }
    if engine.ports.get(role):
        container["ports"] = engine.ports[role]
    return container


def sidecar_container(engine: Engine) -> dict[str, Any]:
    def env(flag: str, value: str) -> dict[str, Any]:
        return {"name": env_name(flag), "value": value}

    return {
        "name": "main",
        "image": SIDECAR_IMAGE,
        "command": ["openengine-sidecar"],  # explicit: Dynamo's operator would otherwise inject its own
        "args": ["run"],
        "env": [
            env("--engine", f"unix://{SOCKET}"),
            env("--listen", f"0.0.0.0:{PORTS['ws']}"),
            env("--http-listen", f"0.0.0.0:{PORTS['http']}"),
            env("--kv-publish", f"tcp://0.0.0.0:{PORTS['kv-pub']}"),
            env("--kv-replay", f"tcp://0.0.0.0:{PORTS['kv-replay']}"),
            _pod_ip(env_name("--kv-advertise-host")),
            env("--drain-timeout", str(DRAIN_TIMEOUT)),
            env("--expected-engine", engine.name),
        ],
        "ports": [
            {"name": "ws", "containerPort": PORTS["ws"]},
            {"name": "http", "containerPort": PORTS["http"]},
            {"name": "kv-pub", "containerPort": PORTS["kv-pub"]},
            {"name": "kv-replay", "containerPort": PORTS["kv-replay"]},
        ],
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 2,
            "failureThreshold": 150,
        },
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": SIDECAR_RESOURCES,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": SIDECAR_UID,
            "runAsGroup": SIDECAR_UID,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "engine-socket", "mountPath": SOCKET_DIR},
            {"name": "model-cache", "mountPath": "/models", "readOnly": True},  # tokenizer files, same paths
            {"name": "lora-cache", "mountPath": "/lora-cache", "readOnly": True},  # LoRA source paths agree
        ],
    }


def config_map_name(engine: Engine, mode: str, role: str) -> str | None:
    return f"{engine.key}-{mode}-{role}-engine-config" if engine.config.get(role) else None


def pod_spec(engine: Engine, mode: str, role: str) -> dict[str, Any]:
    cm = config_map_name(engine, mode, role)
    volumes: list[dict[str, Any]] = [
        {"name": "engine-socket", "emptyDir": {}},
        {"name": "model-cache", "persistentVolumeClaim": {"claimName": "openengine-model-cache"}},
        {"name": "lora-cache", "persistentVolumeClaim": {"claimName": "openengine-lora-cache"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
    ]
    if cm:
        volumes.append({"name": "engine-config", "configMap": {"name": cm}})
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": GRACE_SECONDS,
        "securityContext": {"fsGroup": SIDECAR_UID, "fsGroupChangePolicy": "OnRootMismatch"},
        "initContainers": [engine_container(engine, role, cm)],
        "containers": [sidecar_container(engine)],
        "volumes": volumes,
    }
    return spec


def config_maps(engine: Engine, mode: str, roles: list[str]) -> list[dict[str, Any]]:
    out = []
    for role in roles:
        name = config_map_name(engine, mode, role)
        if name:
            out.append(
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": name},
                    "data": {"engine.yaml": engine.config[role]},
                }
            )
    return out


def roles_of(mode: str) -> list[str]:
    return ["worker"] if mode == "agg" else ["prefill", "decode"]


def dgd(engine: Engine, mode: str) -> list[dict[str, Any]]:
    components: list[dict[str, Any]] = [
        {
            "name": "Frontend",
            "type": "frontend",
            "replicas": 1,
            "runtimeVersionOverride": DYNAMO_VERSION,
            "podTemplate": {
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": FRONTEND_IMAGE,
                            "command": ["python3", "-m", "dynamo.frontend"],
                            "args": ["--http-port", "8000", "--router-mode", "kv"],
                            "resources": FRONTEND_RESOURCES,
                        }
                    ]
                }
            },
        }
    ]
    for role in roles_of(mode):
        spec = pod_spec(engine, mode, role)
        main = spec["containers"][0]
        # Serve through Dynamo too (the worker plane, docs/DYNAMO.md): the operator injects DYN_NAMESPACE.
        main["env"].append({"name": "OPENENGINE_SIDECAR_DYNAMO", "value": "true"})
        name = {"worker": "Worker", "prefill": "PrefillWorker", "decode": "DecodeWorker"}[role]
        # sharedMemorySize "0": no operator /dev/shm for `main`; the engine mounts its own (dshm).
        components.append(
            {
                "name": name,
                "type": role,
                "replicas": 1,
                "runtimeVersionOverride": DYNAMO_VERSION,
                "sharedMemorySize": "0",
                "podTemplate": {"spec": spec},
            }
        )
    graph = {
        "apiVersion": "nvidia.com/v1beta1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": f"{engine.key}-openengine-sidecar-{mode}"},
        "spec": {"backendFramework": engine.backend, "components": components},
    }
    return [*config_maps(engine, mode, roles_of(mode)), graph]


def plain(engine: Engine, mode: str) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = list(config_maps(engine, mode, roles_of(mode)))
    for role in roles_of(mode):
        name = f"{engine.key}-{'agg' if role == 'worker' else role}"
        labels = {
            "app.kubernetes.io/name": "openengine-sidecar",
            "app.kubernetes.io/instance": name,
            "openengine.dev/role": "aggregated" if role == "worker" else role,
        }
        docs.append(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": name, "labels": labels},
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": {"app.kubernetes.io/instance": name}},
                    "template": {"metadata": {"labels": labels}, "spec": pod_spec(engine, mode, role)},
                },
            }
        )
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "labels": labels},
                "spec": {
                    "selector": {"app.kubernetes.io/instance": name},
                    "ports": [
                        {"name": p, "port": PORTS[p], "targetPort": p}
                        for p in ("ws", "http", "kv-pub", "kv-replay")
                    ],
                },
            }
        )
    return docs


#: The OpenAI front's port in the GIE manifests (``run --openai-listen``; vLLM's own default).
GIE_PORT = 8000
#: The endpoint picker's Service port (GIE's default).
EPP_PORT = 9002


def gie(engine: Engine) -> list[dict[str, Any]]:
    """The aggregated pod of :func:`plain` with the OpenAI front on :data:`GIE_PORT`, an
    InferencePool selecting its pods, and an HTTPRoute sending a Gateway's traffic to the pool."""
    docs = plain(engine, "agg")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    (main,) = deployment["spec"]["template"]["spec"]["containers"]
    main["env"].append({"name": env_name("--openai-listen"), "value": f"0.0.0.0:{GIE_PORT}"})
    main["ports"].append({"name": "openai", "containerPort": GIE_PORT})
    pool = f"{engine.key}-pool"
    docs.append(
        {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": pool},
            "spec": {
                "selector": {"matchLabels": dict(deployment["spec"]["selector"]["matchLabels"])},
                "targetPorts": [{"number": GIE_PORT}],
                "endpointPickerRef": {
                    "name": f"{pool}-epp",
                    "port": {"number": EPP_PORT},
                    "failureMode": "FailClose",
                },
            },
        }
    )
    docs.append(
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": {"name": f"{engine.key}-route"},
            "spec": {
                "parentRefs": [
                    {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway"}
                ],
                "rules": [
                    {
                        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                        "backendRefs": [
                            {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool}
                        ],
                    }
                ],
            },
        }
    )
    return docs


def render(engine: Engine, mode: str, kind: str, docs: list[dict[str, Any]]) -> str:
    what = "aggregated" if mode == "agg" else "disaggregated (prefill/decode)"
    where = {
        "dynamo": "Dynamo DynamoGraphDeployment (nvidia.com/v1beta1)",
        "plain": "plain Kubernetes Deployment(s) and Service(s), no Dynamo operator needed",
        "gie": (
            f"a Gateway API Inference Extension InferencePool of sidecar pods (OpenAI API and GIE metrics on port\n"
            f"# {GIE_PORT}) and an HTTPRoute from Gateway inference-gateway; the endpoint picker {engine.key}-pool-epp\n"
            f"# (port {EPP_PORT}) comes from GIE's own manifests (docs/OPENAI.md)"
        ),
    }[kind]
    header = (
        f"# GENERATED by deploy/k8s/generate.py; edit the generator, not this file.\n"
        f"# {engine.title}, {what}: {where}.\n"
        f"#\n# {engine.header}\n"
        "#\n"
        "# Each engine pod: the GPU engine is a native sidecar (initContainers, restartPolicy: Always,\n"
        "# startup probe on OpenEngine Health); openengine-sidecar is the `main` container, reaching the\n"
        f"# engine at unix://{SOCKET} on a shared emptyDir. Probes: readiness GET /ready and liveness\n"
        f"# GET /health on port {PORTS['http']}; WebSocket /v1/ws on {PORTS['ws']}; KV events on {PORTS['kv-pub']} (replay {PORTS['kv-replay']}).\n"
        "# Prerequisites: PVCs openengine-model-cache (the model at /models/<name>) and openengine-lora-cache\n"
        "# (shared by every pod, ReadWriteMany for P/D); images as named below (see deploy/README.md).\n"
        f"{_ASSUMED}"
    )
    body = yaml.safe_dump_all(docs, sort_keys=False, width=400, default_flow_style=False)
    lines = []
    for line in body.splitlines():
        for key, comment in LINE_COMMENTS.items():
            if key in line:
                line = f"{line}  # {comment}"
                break
        lines.append(line)
    return header + "---\n" + "\n".join(lines) + "\n"


def outputs() -> dict[Path, str]:
    files = {}
    for engine in ENGINES:
        for mode in ("agg", "disagg"):
            files[HERE / "dynamo" / f"{engine.key}-{mode}.yaml"] = render(
                engine, mode, "dynamo", dgd(engine, mode)
            )
            files[HERE / "plain" / f"{engine.key}-{mode}.yaml"] = render(
                engine, mode, "plain", plain(engine, mode)
            )
        files[HERE / "gie" / f"{engine.key}-agg.yaml"] = render(engine, "agg", "gie", gie(engine))
    return files


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for path, text in outputs().items():
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if stale:
        print(
            "stale (run .venv/bin/python deploy/k8s/generate.py):",
            *map(str, stale),
            sep="\n  ",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
