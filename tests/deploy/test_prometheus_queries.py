"""Every PromQL expression of the Grafana dashboard and of the alert rules, evaluated by a real Prometheus
(Debian's package; .ci/run installs it) scraping a real tokenmill after a short load: each parses, each dashboard
query returns at least one series, and every alert rule evaluates with health "ok"."""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import openai
import pytest
import yaml

from tests.deploy.test_deploy_files import DEPLOY, tool
from tests.live_server import API_KEY, free_port

# What Grafana would substitute: the rate window (>= 4 scrapes at the 1 s interval used here), all models, a cost.
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$model": ".*", "$node_hourly_cost": "2.5"}


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((DEPLOY / "grafana" / "tokenmill.json").read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            queries.append((f"{panel['title']} / {target['legendFormat']}", expr))
    return queries


def alert_queries() -> list[tuple[str, str]]:
    groups = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    return [(rule["alert"], rule["expr"]) for group in groups for rule in group["rules"]]


@pytest.fixture
def prometheus(tmp_path, fp32_server):
    """Prometheus on 127.0.0.1 with the repository's config and rules, its target pointed at the test server."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(DEPLOY / "prometheus" / "alerts.yml")]
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [fp32_server.root.removeprefix("http://")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp_path / "prometheus.log", "w")
    process = subprocess.Popen([tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                                f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=log, stderr=subprocess.STDOUT)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    try:
        api.log_path = tmp_path / "prometheus.log"
        wait_for(lambda: api.get("/-/ready").status_code == 200, "Prometheus ready", api)
        wait_for(lambda: query(api, 'up{job="tokenmill"} == 1'), "tokenmill scraped", api)
        yield api
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def query(api: httpx.Client, expr: str, at: float | None = None) -> list:
    params = {"query": expr} | ({"time": f"{at:.3f}"} if at else {})
    body = api.get("/api/v1/query", params=params).json()
    if body.get("status") != "success":
        raise AssertionError(f"{expr!r}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]["result"]


def wait_for(condition, what: str, api: httpx.Client, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (httpx.HTTPError, AssertionError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}:\n{api.log_path.read_text()[-3000:]}")


def send_load(base_url: str) -> None:
    """Finished requests (chat + completions, with an API key), a stream the client abandons, a rejected prompt."""
    client = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    for i in range(3):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                                       max_tokens=6, temperature=0)
    client.completions.create(model=model, prompt="The capital of France is", max_tokens=4)
    with client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell a story."}],
                                        max_tokens=200, stream=True) as stream:
        next(iter(stream))  # then the connection closes: the server aborts the request
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi " * 3000, max_tokens=4)


def test_every_dashboard_and_alert_query_evaluates_on_real_prometheus(prometheus, fp32_server):
    send_load(fp32_server.base_url)
    time.sleep(3)  # a few more scrapes, so every rate() window holds the load
    at = time.time()
    empty = [name for name, expr in dashboard_queries() if not query(prometheus, expr, at)]
    assert not empty, f"dashboard queries without a series: {empty}"
    for name, expr in alert_queries():
        query(prometheus, expr, at)  # parses and evaluates; firing or not depends on the thresholds
    wait_for(lambda: all(r["lastEvaluation"] > "2000" for r in rules(prometheus)), "rule evaluation", prometheus)
    assert {r["name"]: r["health"] for r in rules(prometheus)} == {name: "ok" for name, _ in alert_queries()}


def rules(api: httpx.Client) -> list[dict]:
    return [r for g in api.get("/api/v1/rules").json()["data"]["groups"] for r in g["rules"]]
