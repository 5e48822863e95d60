"""Static checks of the Kubernetes manifests in deploy/k8s (no cluster needed).

Every object is validated against the Kubernetes 1.30 OpenAPI schemas that the
`kubernetes_validate` package bundles, in strict mode (an unknown or misspelled
field fails). The cross-checks pin what the schemas cannot see: selectors that
match the pods, Service ports that name a container port, no port for tritonserver's
own HTTP (one request can crash it), probes on Triton's health endpoints from inside
the container, a grace period that covers the drain, the GPU limit, and an
autoscaler metric that the Prometheus Adapter rules expose and the engine exports.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from engine_lib.serving.metrics import GAUGES

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "k8s"
KUSTOMIZATION = "kustomization.yaml"
KUBERNETES_VERSION = "1.30"
APP = "diffusion-triton"
LIVE_PATH = "/v2/health/live"
HTTP_PORT = 8000
DEFAULT_EXIT_TIMEOUT_S = 120  # the image's EXIT_TIMEOUT_SECS (docker/Dockerfile)
ENGINE_METRICS = {name for name, _ in GAUGES.values()}


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S_DIR.glob("*.yaml") if p.name != KUSTOMIZATION)


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _all_objects() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in _manifest_files() for doc in _documents(path)]


def _objects(kind: str) -> list[dict]:
    return [doc for _, doc in _all_objects() if doc["kind"] == kind]


def _validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.fixture(scope="module")
def deployment() -> dict:
    deployments = _objects("Deployment")
    assert [d["metadata"]["name"] for d in deployments] == [APP]
    return deployments[0]


@pytest.fixture(scope="module")
def pod_spec(deployment) -> dict:
    return deployment["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod_spec) -> dict:
    assert len(pod_spec["containers"]) == 1, "one container per pod: the launcher"
    return pod_spec["containers"][0]


@pytest.fixture(scope="module")
def pod_labels(deployment) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def _env(container: dict) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def _port_number(container: dict, port) -> int:
    """A probe's or Service's target port (a number or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    by_name = {p["name"]: p["containerPort"] for p in container["ports"] if "name" in p}
    assert port in by_name, f"port {port!r} names no container port ({sorted(by_name)})"
    return by_name[port]


def _adapter_rules() -> list[dict]:
    maps = [cm for cm in _objects("ConfigMap") if "config.yaml" in cm.get("data", {})]
    assert maps, "no ConfigMap holds the Prometheus Adapter's config.yaml"
    return [rule for cm in maps for rule in yaml.safe_load(cm["data"]["config.yaml"])["rules"]]


# -- schema validation ---------------------------------------------------------------------


def test_manifests_exist():
    names = {p.name for p in _manifest_files()}
    assert {"deployment.yaml", "service.yaml", "pdb.yaml", "hpa.yaml", "prometheus-adapter.yaml"} <= names


@pytest.mark.parametrize("filename,obj", _all_objects(),
                         ids=lambda v: v if isinstance(v, str) else f"{v['kind']}/{v['metadata']['name']}")
def test_object_validates_strictly(filename, obj):
    _validate(obj)
    assert "namespace" not in obj["metadata"], f"{filename}: the user picks the namespace (kubectl -n, kustomize)"


def test_strict_validation_rejects_a_misspelled_field(deployment):
    """The validator is proven strict: a planted typo fails."""
    mutated = copy.deepcopy(deployment)
    probe_owner = mutated["spec"]["template"]["spec"]["containers"][0]
    probe_owner["readinesProbe"] = probe_owner.pop("readinessProbe")
    _validate(deployment)  # the original passes
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(mutated)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S_DIR / KUSTOMIZATION).read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    assert "namespace" not in kustomization, "namespace-free: the user picks it"
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources)), "a resource is listed twice"
    assert set(resources) == {p.name for p in _manifest_files()}


# -- cross-checks ------------------------------------------------------------------------------


def test_deployment_selects_its_own_pods(deployment, pod_labels):
    assert pod_labels.get("app.kubernetes.io/name") == APP
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_services_and_pdb_select_the_pods(pod_labels):
    services = _objects("Service")
    assert {s["metadata"]["name"] for s in services} >= {APP, f"{APP}-metrics"}
    for service in services:
        selector = service["spec"]["selector"]
        assert selector and selector.items() <= pod_labels.items(), service["metadata"]["name"]
    pdbs = _objects("PodDisruptionBudget")
    assert pdbs, "no PodDisruptionBudget"
    for pdb in pdbs:
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert selector and selector.items() <= pod_labels.items(), pdb["metadata"]["name"]


def test_service_ports_target_container_ports(container):
    numbers = {p["containerPort"] for p in container["ports"]}
    exposed = set()
    for service in _objects("Service"):
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert _port_number(container, target) in numbers, (service["metadata"]["name"], port)
            exposed.add(_port_number(container, target))
    assert exposed == {8001, 8002, 9000}


def test_tritonserver_http_is_neither_a_container_port_nor_on_the_pod_ip(container):
    """A 100 KB nested JSON body crashes it (docs/serving.md, Security): it listens on the pod's loopback."""
    assert HTTP_PORT not in {p["containerPort"] for p in container["ports"]}
    assert _env(container).get("TRITON_HTTP_ADDRESS", {}).get("value", "127.0.0.1") == "127.0.0.1"
    assert _env(container).get("GRPC_MAX_MESSAGE_BYTES", {}).get("value", "1") != "0", "keep the gate"


def test_metrics_are_scraped_from_the_metrics_port(deployment, container):
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == _port_number(container, "metrics") == 8002


def _probe_url(container: dict, probe: str) -> str:
    """The URL an exec probe's command opens: tritonserver's HTTP port is not on the pod IP, so the kubelet's
    httpGet cannot reach it."""
    command = container[probe]["exec"]["command"]
    urls = re.findall(r"https?://[^'\"\s]+", " ".join(command))
    assert command[0] == "python3" and len(urls) == 1, command
    return urls[0]


@pytest.mark.parametrize("probe", ["readinessProbe", "startupProbe"])
def test_readiness_and_startup_probe_ask_every_port(container, probe):
    """The launcher's `ready` (every public port serves; tests/serving/test_supervision.py), with the time its
    three checks of at most 2 s each may take."""
    assert container[probe]["exec"]["command"] == ["python3", "-m", "engine_lib.serving.serve", "ready"]
    assert container[probe]["timeoutSeconds"] >= 6


def test_liveness_probe_triton_live(container):
    assert _probe_url(container, "livenessProbe") == f"http://127.0.0.1:{HTTP_PORT}{LIVE_PATH}"


def test_startup_probe_allows_a_long_weight_load(container):
    probe = container["startupProbe"]
    window_s = probe.get("initialDelaySeconds", 0) + probe.get("failureThreshold", 3) * probe.get("periodSeconds", 10)
    assert window_s >= 20 * 60, f"startup window {window_s} s: loading real weights takes many minutes"


def test_grace_period_covers_pre_stop_and_drain(pod_spec, container):
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    sleep_s = float(command[1])
    env = _env(container)
    exit_timeout_s = int(env["EXIT_TIMEOUT_SECS"]["value"]) if "EXIT_TIMEOUT_SECS" in env else DEFAULT_EXIT_TIMEOUT_S
    assert pod_spec["terminationGracePeriodSeconds"] > sleep_s + exit_timeout_s


def test_one_gpu_per_pod(container):
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1


def test_triton_listens_on_every_interface(container):
    assert _env(container)["TRITON_ADDRESS"].get("value") == "0.0.0.0"


def test_dev_shm_is_a_memory_empty_dir(pod_spec, container):
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "/dev/shm" in mounts
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert volumes[mounts["/dev/shm"]].get("emptyDir", {}).get("medium") == "Memory"


def test_the_front_doors_data_dir_is_a_shared_claim_and_jobs_go_to_postgresql(pod_spec, container):
    """Replicas answer for each other's video jobs: the results on one claim, the rows in one database."""
    env = _env(container)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert "persistentVolumeClaim" in volumes[mounts[env["DIFFUSION_DATA_DIR"]["value"]]]
    assert env["JOB_STORE_URL"]["valueFrom"]["secretKeyRef"]["key"] == "job-store-url"


def test_rolling_update_keeps_capacity(deployment):
    strategy = deployment["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0


def test_hpa_scales_the_deployment(deployment):
    hpas = _objects("HorizontalPodAutoscaler")
    assert hpas, "no HorizontalPodAutoscaler"
    for hpa in hpas:
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment",
                                                                          deployment["metadata"]["name"])
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_hpa_metric_is_exposed_by_the_adapter_and_exported_by_the_engine():
    exposed = {}
    for rule in _adapter_rules():
        match = re.match(r"\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*\{", rule["seriesQuery"])
        assert match, f"seriesQuery names no metric: {rule['seriesQuery']!r}"
        name = (rule.get("name") or {}).get("as") or match.group(1)
        exposed[name] = (match.group(1), rule)
    metrics = [m for hpa in _objects("HorizontalPodAutoscaler") for m in hpa["spec"]["metrics"]]
    assert metrics, "the HPA has no metric"
    for metric in metrics:
        assert metric["type"] == "Pods", metric
        name = metric["pods"]["metric"]["name"]
        assert name in exposed, f"{name} is in no Prometheus Adapter rule ({sorted(exposed)})"
        series, rule = exposed[name]
        assert series in ENGINE_METRICS, f"{series} is not an engine metric ({sorted(ENGINE_METRICS)})"
        # A Pods metric must be associated with pods.
        overrides = rule["resources"]["overrides"]
        assert overrides.get("pod", {}).get("resource") in ("pod", "pods")
        assert overrides.get("namespace", {}).get("resource") in ("namespace", "namespaces")
