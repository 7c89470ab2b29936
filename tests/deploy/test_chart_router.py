"""The chart past one replica: the gateway as a sidecar of each Triton pod, vLLM's router in front
of the sidecars, and an InferencePool of the pods (test_helm_chart.py validates these value sets
against the Kubernetes and CRD schemas, test_chart_security.py holds them to the restricted
standard). What a user relies on: each pod answers the OpenAI API for its own Triton; the router's
arguments, read by vllm-router's own parser, find exactly Triton's pods on that port and carry the
gateway's key; its API token reads pods and nothing else; the pool selects Triton's pods on the
sidecar's port; the NetworkPolicies let the router in; settings that cannot work are refused.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from .test_chart_security import admitted, pod_labels
from .test_helm_chart import (API_KEY, FULLNAME, NAMESPACE, RELEASE, VALUE_SETS, RenderError, manifests,  # noqa: F401
                              named, notes, one, render)

ROUTER_NAME = f"{FULLNAME}-router"


def containers(documents: list[dict], name: str = FULLNAME) -> dict[str, dict]:
    return {c["name"]: c for c in named(documents, "Deployment", name)["spec"]["template"]["spec"]["containers"]}


def router_arguments(documents: list[dict]) -> dict:
    """The router container's arguments as vllm-router 0.1.17 parses them (its own argparse and
    RouterArgs, run in the peer environment benchmarks/peers/vllm_router.py makes), with the
    key Kubernetes puts for $(PAGEDSERVE_API_KEY)."""
    from benchmarks.peers import vllm_router

    container = containers(documents, ROUTER_NAME)["router"]
    assert container["command"] == ["vllm-router"]
    args = [arg.replace("$(PAGEDSERVE_API_KEY)", API_KEY) for arg in container["args"]]
    script = ("import dataclasses, json, sys; from vllm_router.launch_router import parse_router_args; "
              "print(json.dumps(dataclasses.asdict(parse_router_args(sys.argv[1:])), default=str))")
    vllm_router.setup()
    python = vllm_router.venv_dir() / "bin" / "python"
    result = subprocess.run([str(python), "-c", script, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_sidecar_gateway_serves_its_own_pods_triton(monkeypatch):
    """gateway.placement=sidecar: the gateway is a container of Triton's pod calling localhost (its
    /metrics passes that Triton's metrics through), reads the weights' tokenizer from the same
    mounts, waits as long as Triton before SIGTERM, and no gateway Deployment is left."""
    from pagedserve.client import cli, openai_gateway

    weights = {"extraVolumes": [{"name": "weights", "persistentVolumeClaim": {"claimName": "llama"}}],
               "extraVolumeMounts": [{"name": "weights", "mountPath": "/models/llama", "readOnly": True}]}
    documents = render({**VALUE_SETS["sidecar"], **weights})
    assert [d["metadata"]["name"] for d in documents if d["kind"] == "Deployment"] == [FULLNAME]
    pod = containers(documents)
    gateway = pod["gateway"]
    assert {p["name"]: p["containerPort"] for p in gateway["ports"]} == {"openai": 9000}
    assert {"mountPath": "/models/llama", "name": "weights", "readOnly": True} in gateway["volumeMounts"]
    assert gateway["lifecycle"] == pod["tritonserver"]["lifecycle"]
    started = []
    monkeypatch.setattr(openai_gateway, "run_gateway", started.append)
    monkeypatch.setenv("PAGEDSERVE_API_KEY", API_KEY)
    monkeypatch.delenv("PAGEDSERVE_API_KEY_FILE", raising=False)
    assert cli.main(gateway["args"][1:]) == 0
    [config] = started
    assert (config.host, config.port, config.triton_url) == ("0.0.0.0", 9000, "localhost:8001")
    assert config.metrics_url() == "localhost:8002" and config.api_key == API_KEY


def test_router_discovers_tritons_pods_on_the_sidecars_port(manifests):
    documents = manifests["router"]
    parsed = router_arguments(documents)
    triton = named(documents, "Deployment")
    assert parsed["service_discovery"] is True and parsed["service_discovery_namespace"] == NAMESPACE
    assert parsed["selector"] == triton["spec"]["selector"]["matchLabels"]  # Triton's pods, not the router's
    assert not parsed["selector"].items() <= pod_labels(documents, ROUTER_NAME).items()
    assert parsed["service_discovery_port"] == containers(documents)["gateway"]["ports"][0]["containerPort"]
    assert parsed["policy"] == "cache_aware" and parsed["worker_urls"] == []
    assert parsed["api_key"] == API_KEY  # its own calls to the workers (render, model info)
    [key] = [e for e in containers(documents, ROUTER_NAME)["router"]["env"] if e["name"] == "PAGEDSERVE_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": f"{FULLNAME}-gateway", "key": "api-key"}
    assert parsed["host"] == "0.0.0.0" and parsed["port"] == 8080
    # its token reads the namespace's pods, nothing else, and only it holds that token
    role, binding = one(documents, "Role"), one(documents, "RoleBinding")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": ROUTER_NAME, "namespace": NAMESPACE}]
    router_pod = named(documents, "Deployment", ROUTER_NAME)["spec"]["template"]["spec"]
    assert router_pod["serviceAccountName"] == ROUTER_NAME and router_pod["automountServiceAccountToken"] is True
    assert triton["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    service = named(documents, "Service", ROUTER_NAME)
    assert service["spec"]["selector"].items() <= pod_labels(documents, ROUTER_NAME).items()
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {"http": "http", "metrics": "metrics"}


class FakeKubernetesApi(http.server.ThreadingHTTPServer):
    """The two calls vllm-router's discovery makes (list the namespace's pods, then watch them), for
    `pods`; it filters them by labels itself."""

    def __init__(self, namespace: str, pods: list[dict]):
        self.namespace, self.pods, self.calls = namespace, pods, []
        super().__init__(("127.0.0.1", 0), FakeKubernetesHandler)


class FakeKubernetesHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeKubernetesApi

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self.server.calls.append(self.path)
        if not self.path.startswith(f"/api/v1/namespaces/{self.server.namespace}/pods"):
            self.send_error(403)  # a Role for the release namespace only: nothing else
            return
        pods = [{"kind": "Pod", "apiVersion": "v1", **pod} for pod in self.server.pods]
        if "watch=true" not in self.path:
            self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": pods})
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for pod in pods:
            line = json.dumps({"type": "ADDED", "object": pod}).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        self.wfile.flush()
        time.sleep(5)  # an open watch; the router watches again when it ends

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


class FakeWorker(http.server.BaseHTTPRequestHandler):
    """A worker that is healthy and answers every route with a chat completion."""

    def do_GET(self) -> None:  # noqa: N802
        body = json.dumps({"id": "x", "object": "chat.completion", "model": "llm", "created": 0, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.do_GET()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def serving(server: http.server.HTTPServer) -> Iterator[http.server.HTTPServer]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def pod(name: str, labels: dict, ip: str, ready: bool = True) -> dict:
    return {"metadata": {"name": name, "namespace": NAMESPACE, "uid": name, "resourceVersion": "1", "labels": labels},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_router_discovers_exactly_the_releases_ready_triton_pods(tmp_path):
    """The router, started with the chart's arguments against a Kubernetes API (a fake serving the
    namespace's pods), adds the release's ready Triton pod at the sidecar port and routes a chat
    request there: not the release's router or not-ready pod, not another release's Triton pod."""
    from benchmarks.peers import vllm_router
    from pagedserve.client.process import ServerProcess, free_port, http_status

    with serving(http.server.ThreadingHTTPServer(("127.0.0.2", 0), FakeWorker)) as worker:
        port = worker.server_address[1]
        documents = render({**VALUE_SETS["router"], "gateway": {**VALUE_SETS["router"]["gateway"], "port": port}})
        triton, router = pod_labels(documents), pod_labels(documents, ROUTER_NAME)
        other_release = {**triton, "app.kubernetes.io/instance": "other"}
        pods = [pod("triton-ready", triton, "127.0.0.2"), pod("triton-starting", triton, "127.0.0.3", ready=False),
                pod("router", router, "127.0.0.4"), pod("other-triton", other_release, "127.0.0.5")]
        with serving(FakeKubernetesApi(NAMESPACE, pods)) as api:
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(json.dumps({
                "apiVersion": "v1", "kind": "Config", "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{api.server_address[1]}"}}],
                "users": [{"name": "router", "user": {"token": "service-account-token"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "router", "namespace": NAMESPACE}}]}))
            router_port, metrics_port = free_port(), free_port()
            args = [arg.replace("$(PAGEDSERVE_API_KEY)", API_KEY) for arg in containers(documents, ROUTER_NAME)["router"]["args"]]
            args = [a for a in args if not a.startswith(("--host=", "--port=", "--prometheus-"))]
            command = [str(vllm_router.setup()), *args, "--host=127.0.0.1", f"--port={router_port}",
                       f"--prometheus-port={metrics_port}"]
            process = ServerProcess(command, tmp_path / "router.log", name="vllm-router",
                                    env={**os.environ, "KUBECONFIG": str(kubeconfig)}).start()
            try:
                base = f"http://127.0.0.1:{router_port}"
                process.wait_ready(lambda: http_status(f"{base}/readiness") == 200, time.monotonic() + 60)
                listed = json.load(urllib.request.urlopen(f"{base}/workers", timeout=10))
                assert [w["url"] for w in listed["workers"]] == [f"http://127.0.0.2:{port}"]
                request = urllib.request.Request(
                    f"{base}/v1/chat/completions", headers={"Content-Type": "application/json"},
                    data=json.dumps({"model": "llm", "messages": [{"role": "user", "content": "hi"}]}).encode())
                answer = json.load(urllib.request.urlopen(request, timeout=30))
                assert answer["choices"][0]["message"]["content"] == "hi"
            finally:
                process.stop()
            assert all(call.startswith(f"/api/v1/namespaces/{NAMESPACE}/pods") for call in api.calls)


def test_router_with_a_static_list_and_kv_events(manifests):
    """router.workerUrls: those workers only, no discovery and no API token; kv_aware is allowed
    there, with each worker's KV-event source in extraArgs."""
    documents = manifests["router-static"]
    parsed = router_arguments(documents)
    assert parsed["service_discovery"] is False and parsed["policy"] == "kv_aware"
    assert parsed["worker_urls"] == ["http://replica-a:9000", "http://replica-b:9000"]
    assert len(parsed["kv_event_source"]) == 2
    assert named(documents, "Deployment", ROUTER_NAME)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert not [d for d in documents if d["kind"] in ("Role", "RoleBinding")]


def test_inference_pool_is_tritons_pods_on_the_sidecars_port(manifests):
    documents = manifests["inference-pool"]
    pool = one(documents, "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"] == named(documents, "Deployment")["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["targetPorts"] == [{"number": containers(documents)["gateway"]["ports"][0]["containerPort"]}]
    assert pool["spec"]["endpointPickerRef"] == {"name": "llm-epp", "port": {"number": 9002}, "failureMode": "FailClose"}


def test_network_policy_admits_the_router_to_the_sidecars(manifests):
    documents = manifests["network-policy-router"]
    triton, router = pod_labels(documents), pod_labels(documents, ROUTER_NAME)
    router_pod = {"namespace": NAMESPACE, "labels": router}
    web = {"namespace": "web", "labels": {}}
    stranger = {"namespace": NAMESPACE, "labels": {"app": "something-else"}}
    assert admitted(documents, triton, "openai", router_pod) and admitted(documents, triton, "openai", web)
    assert not admitted(documents, triton, "openai", stranger)
    assert not any(admitted(documents, triton, port, router_pod) for port in ("http", "grpc"))
    assert admitted(documents, router, "http", web) and not admitted(documents, router, "http", stranger)
    assert admitted(documents, router, "metrics", {"namespace": "monitoring", "labels": {}})
    opened = render({**VALUE_SETS["router"], "networkPolicy": {"enabled": True}})
    assert admitted(opened, triton, "openai", stranger)  # empty gateway.from: anyone (the key is checked)


ROUTER_IMAGE = {"image": {"repository": "registry.example.com/vllm-router"}}


@pytest.mark.parametrize("values, message", [
    ({"gateway": {"enabled": True, "apiKey": {"value": API_KEY}}, "router": {"enabled": True, **ROUTER_IMAGE}},
     "router.enabled routes to each pod's OpenAI port: set gateway.enabled=true and gateway.placement=sidecar"),
    ({**VALUE_SETS["sidecar"], "router": {"enabled": True}}, "router.image.repository: vLLM's router publishes no image"),
    ({**VALUE_SETS["sidecar"], "router": {"enabled": True, "policy": "kv_aware", **ROUTER_IMAGE}},
     "kv_aware needs each worker's KV-event endpoint"),
    ({**VALUE_SETS["sidecar"], "router": {"enabled": True, "policy": "fastest", **ROUTER_IMAGE}}, "router.policy must be one of"),
    ({**VALUE_SETS["sidecar"], "inferencePool": {"enabled": True}}, "inferencePool.endpointPicker.name"),
    ({"inferencePool": {"enabled": True, "endpointPicker": {"name": "epp"}}}, "inferencePool.enabled: the pool's port"),
    ({"gateway": {"enabled": True, "placement": "beside", "apiKey": {"value": API_KEY}}},
     "gateway.placement must be deployment or sidecar"),
])
def test_render_refuses_what_cannot_route(values, message):
    with pytest.raises(RenderError, match=message):
        render(values)


def test_release_name_reaches_the_selector():
    """Two releases in one namespace: each router discovers its own release's pods only."""
    assert RELEASE in router_arguments(render(VALUE_SETS["router"]))["selector"].values()


def test_notes_send_clients_to_the_router(tmp_path):
    text = notes(VALUE_SETS["router"], tmp_path / "router")
    assert f"http://{ROUTER_NAME}.{NAMESPACE}.svc:8080/v1" in text and API_KEY not in text
    assert f"{FULLNAME}-gateway.{NAMESPACE}.svc" not in text  # no gateway Service of its own
    text = notes(VALUE_SETS["inference-pool"], tmp_path / "pool")
    assert f"InferencePool {FULLNAME}" in text and "Service llm-epp:9002" in text
