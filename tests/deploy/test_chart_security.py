"""What the chart promises about security, on the manifests `helm template` renders
(test_helm_chart.py validates the same value sets against the Kubernetes schemas):

- every pod and container non-root as the image's UID, no privilege escalation, no
  capabilities, RuntimeDefault seccomp, a read-only root filesystem with every place the
  image writes ($HOME, the caches, /tmp, /dev/shm) on a volume: the restricted Pod
  Security Standard;
- default resource requests with a GPU;
- the gateway: an optional Deployment + Service whose API key comes from a Secret through
  secretKeyRef (the chart's, or one named in values), never as plain text in the
  Deployment or its arguments, and whose arguments the real `pagedserve openai` accepts;
- the Service offers only the Triton ports asked for; the NetworkPolicies admit only the
  peers named, checked by evaluating them for sample pods.
"""

from __future__ import annotations

import base64
import json

import pytest

from .test_helm_chart import (API_KEY, FULLNAME, NAMESPACE, VALUE_SETS, RenderError, manifests, named, notes,  # noqa: F401
                              one, render, server_container)

GATEWAY_NAME = f"{FULLNAME}-gateway"
IMAGE_UID = 1000  # docker/Dockerfile's USER (test_dockerfile.py checks the two agree)
WRITABLE_ENV = ("HOME", "PAGEDSERVE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HF_HOME",
                "CUDA_CACHE_PATH")
# Volume types the restricted Pod Security Standard allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                      "secret"}


def deployments(documents: list[dict]) -> list[dict]:
    return [doc for doc in documents if doc["kind"] == "Deployment"]


def all_containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def gateway_container(documents: list[dict]) -> dict:
    [container] = named(documents, "Deployment", GATEWAY_NAME)["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "gateway"
    return container


# -- pods and containers -----------------------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_pod_runs_restricted(manifests, value_set):
    """Pod Security Standard `restricted`, plus the image's UID and a read-only root."""
    read_only = value_set != "writable-root"
    for deployment in deployments(manifests[value_set]):
        pod = deployment["spec"]["template"]["spec"]
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True
        assert context["runAsUser"] == context["runAsGroup"] == context["fsGroup"] == IMAGE_UID
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        # An API token only where the router discovers Triton's pods through the API.
        discovers = "--service-discovery" in pod["containers"][0].get("args", [])
        assert pod["automountServiceAccountToken"] is discovers
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for volume in pod["volumes"]:
            kinds = set(volume) - {"name"}
            assert kinds <= RESTRICTED_VOLUMES, (deployment["metadata"]["name"], volume)
        for container in all_containers(pod):
            own = container["securityContext"]
            assert own["runAsNonRoot"] is True and own["runAsUser"] == IMAGE_UID, container["name"]
            assert own["allowPrivilegeEscalation"] is False
            assert own["capabilities"] == {"drop": ["ALL"]}
            assert not own.get("privileged")
            assert own["readOnlyRootFilesystem"] is read_only
            assert not any(port.get("hostPort") for port in container.get("ports", []))


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_written_place_is_a_volume(manifests, value_set):
    """A read-only root filesystem leaves $HOME, the caches and /tmp to volumes: each of
    the image's writable paths that a container uses is a writable mount of its pod."""
    for deployment in deployments(manifests[value_set]):
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in all_containers(pod):
            mounts = {m["mountPath"]: m for m in container["volumeMounts"] if not m.get("readOnly")}
            assert volumes[mounts["/tmp"]["name"]]["emptyDir"]["sizeLimit"]
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            for name in WRITABLE_ENV:
                if name not in env:  # no caches used there; the router writes nothing at all
                    assert container["name"] == "router" or (container["name"] == "gateway" and name != "HOME")
                    continue
                under = [path for path in mounts if env[name] == path or env[name].startswith(path + "/")]
                assert under, f"{container['name']}: ${name}={env[name]} is on the read-only root filesystem"
        if deployment["metadata"]["name"] == FULLNAME:
            server = pod["containers"][0]
            shm = next(m for m in server["volumeMounts"] if m["mountPath"] == "/dev/shm")
            assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
            assert volumes[shm["name"]]["emptyDir"]["sizeLimit"]


def test_cache_can_be_a_volume_that_outlives_the_pod():
    documents = render({"cache": {"volume": {"persistentVolumeClaim": {"claimName": "pagedserve-cache"}}},
                        "engine": {"max_num_seqs": 8}})
    pod = named(documents, "Deployment")["spec"]["template"]["spec"]
    cache = next(v for v in pod["volumes"] if v["name"] == "cache")
    assert cache == {"name": "cache", "persistentVolumeClaim": {"claimName": "pagedserve-cache"}}
    for container in all_containers(pod):
        mount = next(m for m in container["volumeMounts"] if m["name"] == "cache")
        assert mount["mountPath"] == "/var/cache/pagedserve" and not mount.get("readOnly")


def test_default_resources_request_a_gpu(manifests):
    server = server_container(manifests["default"])
    requests, limits = server["resources"]["requests"], server["resources"]["limits"]
    assert requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"] == 1
    assert requests["cpu"] and requests["memory"] and limits["memory"]
    assert "cpu" not in limits  # no CPU throttling of the engine thread
    cpu_only = server_container(render({"gpu": {"count": 0}}))
    assert "nvidia.com/gpu" not in cpu_only["resources"]["requests"]
    assert "nvidia.com/gpu" not in cpu_only["resources"]["limits"]
    gateway = gateway_container(manifests["gateway"])
    assert gateway["resources"]["requests"] and gateway["resources"]["limits"]["memory"]
    assert "nvidia.com/gpu" not in json.dumps(gateway["resources"])


def test_security_defaults_can_be_relaxed_key_by_key():
    server = server_container(render({"securityContext": {"readOnlyRootFilesystem": False}}))
    assert server["securityContext"]["readOnlyRootFilesystem"] is False
    assert server["securityContext"]["allowPrivilegeEscalation"] is False  # the rest stays


# -- the gateway ---------------------------------------------------------------------------


def test_gateway_is_off_by_default(manifests):
    for documents in (manifests["default"], manifests["full"]):
        assert [d["metadata"]["name"] for d in deployments(documents)] == [FULLNAME]
        assert not [d for d in documents if d["kind"] == "Secret"]


@pytest.mark.parametrize("value_set, secret, key", [("gateway", GATEWAY_NAME, "api-key"),
                                                    ("gateway-existing-secret", "llm-gateway-key", "token")])
def test_gateway_takes_its_key_from_a_secret(manifests, value_set, secret, key):
    documents = manifests[value_set]
    gateway = gateway_container(documents)
    [from_secret] = [e for e in gateway["env"] if e["name"] == "PAGEDSERVE_API_KEY"]
    assert from_secret == {"name": "PAGEDSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
    assert not any(arg.startswith("--api-key") for arg in gateway["args"])
    secrets = [d for d in documents if d["kind"] == "Secret"]
    if value_set == "gateway":
        [created] = secrets
        assert created["metadata"]["name"] == secret and created["type"] == "Opaque"
        assert base64.b64decode(created["data"][key]).decode() == API_KEY
    else:
        assert secrets == []  # the user's own Secret is not the chart's


@pytest.mark.parametrize("value_set", ["gateway", "network-policy-gateway"])
def test_no_plaintext_key_outside_the_secret(manifests, value_set):
    encoded = base64.b64encode(API_KEY.encode()).decode()
    for doc in manifests[value_set]:
        if doc["kind"] == "Secret":
            continue
        text = json.dumps(doc)
        assert API_KEY not in text and encoded not in text, f"{doc['kind']} {doc['metadata']['name']} holds the key"


def test_gateway_calls_tritons_grpc_service(manifests):
    documents = manifests["gateway"]
    gateway = gateway_container(documents)
    assert gateway["args"][:2] == ["pagedserve", "openai"]
    args = dict(arg.split("=", 1) for arg in gateway["args"][2:])
    assert args["--host"] == "0.0.0.0"
    host, port = args["--triton-url"].split(":")
    service = named(documents, "Service")
    assert host == service["metadata"]["name"] == FULLNAME
    assert int(port) == next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert args["--model"] == "llm"
    assert dict(arg.split("=", 1) for arg in gateway_container(manifests["gateway-existing-secret"])["args"][2:])[
        "--model"] == "chat"
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert gateway["livenessProbe"] == {**gateway["livenessProbe"], "tcpSocket": {"port": "http"}}
    assert {p["name"]: p["containerPort"] for p in gateway["ports"]} == {"http": 9000}


def test_gateway_arguments_are_what_pagedserve_openai_accepts(manifests, monkeypatch):
    """The rendered arguments and the Secret's env var, through the real command line: the
    gateway listens on every address (allowed: a key is set) and has the key."""
    from pagedserve.client import cli, openai_gateway

    gateway = gateway_container(manifests["gateway"])
    started = []
    monkeypatch.setattr(openai_gateway, "run_gateway", started.append)
    monkeypatch.setenv("PAGEDSERVE_API_KEY", API_KEY)  # what secretKeyRef gives the container
    monkeypatch.delenv("PAGEDSERVE_API_KEY_FILE", raising=False)
    assert cli.main(gateway["args"][1:]) == 0
    [config] = started
    assert (config.host, config.port, config.triton_url) == ("0.0.0.0", 9000, f"{FULLNAME}:8001")
    assert config.model_ids() == {"llm": "llm"}
    assert config.api_key == API_KEY


def test_gateway_and_triton_select_only_their_own_pods(manifests):
    documents = manifests["gateway"]
    triton_pods = named(documents, "Deployment")["spec"]["template"]["metadata"]["labels"]
    gateway_pods = named(documents, "Deployment", GATEWAY_NAME)["spec"]["template"]["metadata"]["labels"]
    triton_selector = named(documents, "Service")["spec"]["selector"]
    gateway_selector = named(documents, "Service", GATEWAY_NAME)["spec"]["selector"]
    assert triton_selector.items() <= triton_pods.items() and not triton_selector.items() <= gateway_pods.items()
    assert gateway_selector.items() <= gateway_pods.items() and not gateway_selector.items() <= triton_pods.items()
    assert named(documents, "Deployment", GATEWAY_NAME)["spec"]["selector"]["matchLabels"] == gateway_selector
    gateway_service = named(documents, "Service", GATEWAY_NAME)
    assert gateway_service["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]
    # the ServiceMonitor's selector (Triton's labels) does not pick up the gateway's Service
    assert not triton_selector.items() <= gateway_service["metadata"]["labels"].items()


@pytest.mark.parametrize("values, message", [
    ({"gateway": {"enabled": True}}, "gateway.enabled needs an API key"),
    ({"gateway": {"enabled": True, "apiKey": {"value": API_KEY, "existingSecret": "mine"}}}, "not both"),
    ({"gateway": {"enabled": True, "apiKey": {"value": "short"}}}, "at least 16 characters"),
    ({**VALUE_SETS["gateway"], "service": {"expose": {"grpc": False}}}, "set service.expose.grpc=true"),
    ({"serviceMonitor": {"enabled": True}, "service": {"expose": {"metrics": False}}}, "set service.expose.metrics=true"),
    ({"service": {"expose": {"http": False, "grpc": False, "metrics": False}}}, "offer at least one"),
])
def test_render_refuses_unsafe_or_broken_settings(values, message):
    with pytest.raises(RenderError, match=message):
        render(values)


def test_notes_name_the_gateway_and_only_offered_ports(tmp_path):
    text = notes(VALUE_SETS["gateway"], tmp_path / "gateway")
    assert f"http://{GATEWAY_NAME}.{NAMESPACE}.svc:9000/v1" in text
    assert f"get secret {GATEWAY_NAME} -o jsonpath='{{.data.api-key}}'" in text
    assert API_KEY not in text
    text = notes(VALUE_SETS["grpc-only"], tmp_path / "grpc")
    assert f"port-forward service/{FULLNAME} 8001:8001\n" in text
    assert ":8000" not in text and ":8002" not in text


# -- NetworkPolicies, evaluated ----------------------------------------------------------


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes LabelSelector; an empty one selects everything."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not ok:
            return False
    return True


def peer_admits(peer: dict, policy_namespace: str, pod: dict) -> bool:
    if "ipBlock" in peer:
        return False  # the sample pods have no fixed address
    namespace_ok = (selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": pod["namespace"]})
                    if "namespaceSelector" in peer else pod["namespace"] == policy_namespace)
    return namespace_ok and selects(peer.get("podSelector", {}), pod["labels"])


def admitted(documents: list[dict], target_labels: dict, port: str, pod: dict) -> bool:
    """Whether the NetworkPolicies let `pod` reach the pods labelled `target_labels` on the
    named container port (no policy selecting them: everything is admitted)."""
    policies = [d for d in documents if d["kind"] == "NetworkPolicy"
                and selects(d["spec"]["podSelector"], target_labels) and "Ingress" in d["spec"]["policyTypes"]]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports_ok = "ports" not in rule or any(p.get("port") == port for p in rule["ports"])
            peers_ok = "from" not in rule or any(peer_admits(peer, policy["metadata"]["namespace"], pod)
                                                 for peer in rule["from"])
            if ports_ok and peers_ok:
                return True
    return False


def pod_labels(documents: list[dict], name: str = FULLNAME) -> dict:
    return named(documents, "Deployment", name)["spec"]["template"]["metadata"]["labels"]


STRANGER = {"namespace": NAMESPACE, "labels": {"app": "something-else"}}
OTHER_NAMESPACE = {"namespace": "elsewhere", "labels": {}}
PROMETHEUS = {"namespace": "monitoring", "labels": {"app.kubernetes.io/name": "prometheus"}}


def test_network_policy_off_by_default(manifests):
    assert not [d for d in manifests["default"] if d["kind"] == "NetworkPolicy"]


def test_network_policy_alone_closes_tritons_api(manifests):
    documents = manifests["network-policy"]
    triton = pod_labels(documents)
    policy = one(documents, "NetworkPolicy")
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), "a rule without peers admits everyone"
    for pod in (STRANGER, OTHER_NAMESPACE, PROMETHEUS):
        assert not admitted(documents, triton, "http", pod) and not admitted(documents, triton, "grpc", pod)
    assert admitted(documents, triton, "metrics", PROMETHEUS)
    assert not admitted(documents, triton, "metrics", STRANGER)
    container_ports = {p["name"] for p in server_container(documents)["ports"]}
    assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} <= container_ports


def test_network_policy_admits_the_gateway_and_named_clients(manifests):
    documents = manifests["network-policy-gateway"]
    triton, gateway = pod_labels(documents), pod_labels(documents, GATEWAY_NAME)
    gateway_pod = {"namespace": NAMESPACE, "labels": gateway}
    assert admitted(documents, triton, "grpc", gateway_pod)
    assert not admitted(documents, triton, "http", gateway_pod)  # it needs only gRPC
    assert not admitted(documents, triton, "metrics", gateway_pod)
    # the gateway's labels in another namespace are not the gateway
    assert not admitted(documents, triton, "grpc", {"namespace": "elsewhere", "labels": gateway})
    client_namespace = {"namespace": "apps", "labels": {"app": "anything"}}
    client_pod = {"namespace": NAMESPACE, "labels": {"app.kubernetes.io/name": "batch-client"}}
    for client in (client_namespace, client_pod):
        assert admitted(documents, triton, "http", client) and admitted(documents, triton, "grpc", client)
        assert not admitted(documents, triton, "metrics", client)
    for pod in (STRANGER, OTHER_NAMESPACE):
        assert not any(admitted(documents, triton, port, pod) for port in ("http", "grpc", "metrics"))
    assert admitted(documents, triton, "metrics", PROMETHEUS)
    assert not admitted(documents, triton, "grpc", PROMETHEUS)
    # the gateway's own policy: its port, from networkPolicy.gateway.from only
    web = {"namespace": "web", "labels": {}}
    assert admitted(documents, gateway, "http", web)
    assert not admitted(documents, gateway, "http", STRANGER)
    open_gateway = render({**VALUE_SETS["gateway"], "networkPolicy": {"enabled": True}})
    assert admitted(open_gateway, gateway, "http", OTHER_NAMESPACE)  # empty `from`: anyone (it checks the key)
    assert not admitted(open_gateway, gateway, "metrics", OTHER_NAMESPACE)
