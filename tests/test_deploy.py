"""deploy/: the manifests are valid Kubernetes objects, and every flag, port and path they
(and the Dockerfile and the Envoy config) name is one the real CLI and router have."""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from trioserve import MetricsConfig, ServerConfig
from trioserve._cli import _parser
from trioserve._context import server_context
from trioserve._served import ModelRepository
from trioserve.metrics import exposition, server_registry
from trioserve.metrics._orca import FORMAT_HEADER
from trioserve.metrics._vllm_names import FAMILIES
from trioserve.models import reference_zoo
from trioserve.rest._endpoints import build_app
from trioserve.rest._router import Router
from trioserve.scheduler._runner import ModelRunner

ROOT = Path(__file__).parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.33.0"
# Kinds that no built-in schema knows (CRDs): checked field by field below.
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("serving.kserve.io/v1alpha1", "ServingRuntime"),
    ("serving.kserve.io/v1beta1", "InferenceService"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
}


def manifests() -> Iterator[tuple[str, dict[str, Any]]]:
    for folder in ("kubernetes", "kserve", "gateway"):
        for path in sorted((DEPLOY / folder).glob("*.yaml")):
            for document in yaml.safe_load_all(path.read_text()):
                yield f"{folder}/{path.name}", document


def by_kind() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for _, document in manifests():
        key = f"{document['kind']}/{document['metadata']['name']}"
        assert key not in found, f"{key} is defined twice"
        found[key] = document
    return found


OBJECTS = by_kind()
DEPLOYMENT = OBJECTS["Deployment/trioserve"]
POD = DEPLOYMENT["spec"]["template"]
CONTAINER = POD["spec"]["containers"][0]


def run_flags(args: list[str]) -> Any:
    """``trioserve run ARGS`` as the real parser reads them (unknown flags fail)."""
    try:
        return _parser().parse_args(["run", *args])
    except SystemExit:
        pytest.fail(f"trioserve run does not accept {args}")


def real_app() -> Router[Any]:
    repository = ModelRepository([ModelRunner(m, "1") for m in reference_zoo()])
    return build_app(server_context(ServerConfig(), repository)).router


def served(method: str, path: str) -> None:
    real_app().resolve(method, path)  # raises NOT_FOUND or 405 for a path that is not served


@pytest.mark.parametrize(("where", "document"), list(manifests()))
def test_manifests_validate(where: str, document: dict[str, Any]) -> None:
    kind = (document["apiVersion"], document["kind"])
    if kind in CUSTOM_KINDS:
        return  # no schema here; see the tests of each below
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_all_kinds_are_known() -> None:
    kinds = {(d["apiVersion"], d["kind"]) for _, d in manifests()}
    assert kinds >= CUSTOM_KINDS
    assert {
        ("apps/v1", "Deployment"),
        ("v1", "Service"),
        ("autoscaling/v2", "HorizontalPodAutoscaler"),
    } <= kinds


def test_deployment_flags_ports_and_probes() -> None:
    args = run_flags(CONTAINER["args"])
    ports = {p["name"]: p["containerPort"] for p in CONTAINER["ports"]}
    assert ports == {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port}
    assert args.model_repository == [Path("/models")]
    assert {m["mountPath"]: m.get("readOnly") for m in CONTAINER["volumeMounts"]}["/models"]
    for probe, path in (
        ("startupProbe", "/v2/health/live"),
        ("livenessProbe", "/v2/health/live"),
        ("readinessProbe", "/v2/health/ready"),
    ):
        assert CONTAINER[probe]["httpGet"] == {"path": path, "port": "http"}
        served("GET", path)
    # Kubernetes kills the pod only after preStop and the whole drain.
    pre_stop = CONTAINER["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert POD["spec"]["terminationGracePeriodSeconds"] > pre_stop + args.exit_timeout_secs
    annotations = POD["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.metrics_port
    served("GET", annotations["prometheus.io/path"])
    assert POD["spec"]["securityContext"]["runAsNonRoot"] is True


def test_services_name_real_ports() -> None:
    names = {p["name"] for p in CONTAINER["ports"]}
    for key in ("Service/trioserve", "Service/trioserve-pods"):
        service = OBJECTS[key]
        assert service["spec"]["selector"].items() <= POD["metadata"]["labels"].items()
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names
            assert port["name"] == port["targetPort"]
            expected = "kubernetes.io/h2c" if port["name"] == "grpc" else "http"
            assert port["appProtocol"] == expected
    assert OBJECTS["Service/trioserve-pods"]["spec"]["clusterIP"] == "None"


def test_service_monitor_and_autoscaler() -> None:
    monitor = OBJECTS["ServiceMonitor/trioserve"]["spec"]
    service = OBJECTS["Service/trioserve"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    served("GET", endpoint["path"])

    hpa = OBJECTS["HorizontalPodAutoscaler/trioserve"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == DEPLOYMENT["metadata"]["name"]
    (metric,) = hpa["metrics"]
    repository = ModelRepository([ModelRunner(m, "1") for m in reference_zoo()])
    text = exposition(server_registry(repository, MetricsConfig())).decode()
    assert f"# TYPE {metric['pods']['metric']['name']} gauge" in text


def test_kserve_runtime() -> None:
    runtime = OBJECTS["ServingRuntime/trioserve"]["spec"]
    assert runtime["protocolVersions"] == ["v2", "grpc-v2"]
    (container,) = runtime["containers"]
    assert container["name"] == "kserve-container"  # the name KServe looks for
    args = run_flags(container["args"])
    # KServe mounts storageUri at /mnt/models and sends HTTP to 8080.
    assert (args.model_repository, args.http_port) == ([Path("/mnt/models")], 8080)
    assert int(runtime["annotations"]["prometheus.kserve.io/port"]) == args.metrics_port
    served("GET", runtime["annotations"]["prometheus.kserve.io/path"])
    # Its container is a core Container: validate it as a pod's.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}}
    pod["spec"] = {"containers": [container]}
    kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)

    service = OBJECTS["InferenceService/trioserve-models"]["spec"]["predictor"]["model"]
    assert service["runtime"] == "trioserve"
    assert service["modelFormat"]["name"] in {f["name"] for f in runtime["supportedModelFormats"]}
    assert service["protocolVersion"] in runtime["protocolVersions"]


def test_inference_pool() -> None:
    pool = OBJECTS["InferencePool/trioserve-generative"]["spec"]
    assert pool["selector"]["matchLabels"].items() <= POD["metadata"]["labels"].items()
    (target,) = pool["targetPorts"]
    assert target["number"] == run_flags(CONTAINER["args"]).http_port
    assert pool["endpointPickerRef"]["failureMode"] in ("FailOpen", "FailClose")
    # The gauges the endpoint picker reads are vLLM's names, as trioserve exports them.
    comment = (DEPLOY / "gateway" / "inferencepool.yaml").read_text()
    exported = {name for _, name, _, _ in FAMILIES.values()}
    for gauge in re.findall(r"vllm:\w+", comment):
        assert gauge in exported
    route = OBJECTS["HTTPRoute/trioserve-generative"]["spec"]
    (rule,) = route["rules"]
    assert rule["backendRefs"][0]["name"] == "trioserve-generative"
    prefixes = [match["path"]["value"] for match in rule["matches"]]
    assert prefixes == ["/v1/", "/v2/models/"]
    served("POST", "/v1/completions")  # the OpenAI-style body the picker reads
    served("POST", "/v1/chat/completions")
    served("POST", "/v2/models/tiny_lm/generate")


def test_envoy_config() -> None:
    config = yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())
    listeners = config["static_resources"]["listeners"]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    container_ports = {p["name"]: p["containerPort"] for p in CONTAINER["ports"]}
    headless = OBJECTS["Service/trioserve-pods"]["metadata"]["name"]
    for cluster, port_name in (("trioserve_rest", "http"), ("trioserve_grpc", "grpc")):
        (endpoint,) = clusters[cluster]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        address = endpoint["endpoint"]["address"]["socket_address"]
        assert (address["address"], address["port_value"]) == (headless, container_ports[port_name])
        (policy,) = clusters[cluster]["load_balancing_policy"]["policies"]
        typed = policy["typed_extension_config"]
        assert typed["name"] == "envoy.load_balancing_policies.client_side_weighted_round_robin"
        assert typed["typed_config"]["enable_oob_load_report"] is False
    served("GET", clusters["trioserve_rest"]["health_checks"][0]["http_health_check"]["path"])
    for listener in listeners:
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        (host,) = manager["route_config"]["virtual_hosts"]
        (added,) = host["request_headers_to_add"]
        # The header that makes trioserve attach a report, in the format Envoy parses.
        assert added["header"] == {"key": FORMAT_HEADER.decode(), "value": "json"}


def test_dockerfile() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    instructions = re.findall(r"^(ENTRYPOINT|CMD|EXPOSE|USER) (.+)$", text, re.MULTILINE)
    found = dict(instructions)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entrypoint = json.loads(found["ENTRYPOINT"])
    assert entrypoint[:2] == ["trioserve", "run"] and "trioserve" in scripts
    args = run_flags(json.loads(found["CMD"]))
    assert args.model_repository == [Path("/models")]
    exposed = {int(p) for p in found["EXPOSE"].split()}
    assert exposed == {args.http_port, args.grpc_port, args.metrics_port}
    assert not found["USER"].startswith(("0", "root"))
    health = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/]+)", text)
    assert health is not None and int(health[1]) == args.http_port
    served("GET", health[2])
    assert (
        "ARG EXTRAS" in text
        and "gpu"
        in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
