"""Several models in one server, without engines: the [[models]] / [[routes]] config and its errors, the memory
check before anything loads, a model host's restarts with backoff and its on-demand loads and unloads (with a fake
loader), and the routes' rules and fallbacks."""

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from tokenmill.cli import build_parser, _model_entry
from tokenmill.config import ConfigError, load_config
from tokenmill.engine.footprint import Footprint
from tokenmill.server import fleet_plan
from tokenmill.server.errors import APIError
from tokenmill.server.fleet import Fleet, ModelHost, backoff
from tokenmill.server.metrics import Metrics
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.routing import Router, shape_of
from tokenmill.server.tenants import Tenants

TOML = """
max_loaded_models = 1
[[models]]
name = "small"
aliases = ["gpt-4o-mini"]
kv_cache_memory = "64MiB"

[[models]]
name = "large"
model = "{path}"
dtype = "float32"
tool_call_parser = "hermes"
load = "on_demand"

[[routes]]
name = "auto"
rules = [{{ prompt_tokens_above = 100, model = "large" }}, {{ tools = true, model = "large" }}]
default = "small"
fallbacks = ["large"]
"""


def test_models_and_routes_from_toml(tmp_path):
    (tmp_path / "m.toml").write_text(TOML.format(path=tmp_path))
    config = load_config(tmp_path / "m.toml")
    small, large = (config.for_model(spec) for spec in config.models)
    assert (small.served_model_name, small.model, small.kv_cache_memory, small.dtype) == ("small", None, 64 * 2**20,
                                                                                         "auto")
    assert (large.served_model_name, large.model, large.dtype, large.cpu_kv_cache_memory) == ("large", str(tmp_path),
                                                                                         "float32", 2 * 2**30)
    assert large.tool_call_parser == "hermes" and small.tool_call_parser == "auto"
    assert config.models[1].load == "on_demand" and config.routes[0].targets == ("large", "large", "small", "large")


@pytest.mark.parametrize("models, routes, message", [
    ([{"name": "a"}, {"name": "b", "aliases": ["a"]}], [], "the id 'a' is given twice"),
    ([{"name": "a", "port": 1}], [], "'a' sets 'port', which is not a per-model setting"),
    ([{"name": "a", "bogus": 1}], [], "'a' sets 'bogus'"),
    ([{"name": "a"}], [{"name": "r", "default": "b"}], "'r' names models that are not served: ['b']"),
    ([{"name": "a"}], [{"name": "a", "default": "a"}], "already a model's"),
    ([], [{"name": "r", "default": "a"}], "routes need [[models]]"),
    ([{"name": "a"}], [{"name": "r", "default": "a", "rules": [{"model": "a"}]}], "needs a condition"),
])
def test_fleet_config_errors(models, routes, message):
    with pytest.raises(ConfigError) as refused:
        load_config(models=models, routes=routes)
    assert message in str(refused.value)


def test_a_models_own_setting_is_checked_before_anything_loads():
    with pytest.raises(ConfigError, match="(?s)model 'a'.*dtype"):
        load_config(models=[{"name": "a", "dtype": "float64"}])


def test_one_model_or_many_not_both(tmp_path):
    with pytest.raises(ConfigError, match="not both"):
        load_config(model=str(tmp_path), models=[{"name": "a"}])


def test_cli_model_shorthand(tmp_path):
    args = build_parser().parse_args(["serve", "--model", f"tiny={tmp_path}", "--model", "smol="])
    assert args.model_entries == [{"name": "tiny", "model": str(tmp_path)}, {"name": "smol", "model": None}]
    with pytest.raises(Exception, match="NAME=PATH"):
        _model_entry("no-equals-sign")


def test_memory_check_names_the_model_that_does_not_fit(monkeypatch):
    sizes = {"a": 3 * 2**30, "b": 2 * 2**30, "c": 5 * 2**30}
    monkeypatch.setattr(fleet_plan, "footprint", lambda c: Footprint("cpu", sizes[c.served_model_name], 0.0))
    config = load_config(models=[{"name": "a"}, {"name": "b"}, {"name": "c", "load": "on_demand"}])
    assert len(fleet_plan.model_configs(config, available_bytes=10 * 2**30)) == 3
    with pytest.raises(ConfigError, match="model 'c' does not fit: .* ~10.0 GiB .* 9.0 GiB available"):
        fleet_plan.model_configs(config, available_bytes=9 * 2**30)
    with pytest.raises(ConfigError, match="model 'b' does not fit"):
        fleet_plan.model_configs(config, available_bytes=4 * 2**30)
    monkeypatch.setattr(fleet_plan, "footprint", lambda c: Footprint("cuda", 0, 0.6, (0,)))
    with pytest.raises(ConfigError, match="model 'b' does not fit: .* on GPU 0 adds up to 1.20"):
        fleet_plan.model_configs(config, available_bytes=0)
    gpus = {"a": (0,), "b": (1, 2), "c": (2,)}
    monkeypatch.setattr(fleet_plan, "footprint", lambda c: Footprint("cuda", 0, 0.6, gpus[c.served_model_name]))
    with pytest.raises(ConfigError, match="model 'c' does not fit: .* on GPU 2 adds up to 1.20"):
        fleet_plan.model_configs(config, available_bytes=0)
    gpus["c"] = (3,)
    assert len(fleet_plan.model_configs(config, available_bytes=0)) == 3


def test_devices_per_model(tmp_path, monkeypatch):
    from tokenmill.engine import footprint as footprint_module
    from tokenmill.engine.process import use_devices

    config = load_config(models=[{"name": "a", "devices": [2, 3], "tensor_parallel_size": 2}])
    a = config.for_model(config.models[0])
    monkeypatch.setattr(footprint_module, "_has_gpu", lambda: True)
    assert footprint_module.footprint(a).gpus == (2, 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    use_devices(a.devices)
    assert __import__("os").environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    for bad in ([1], [1, 1], [-1, 0]):
        with pytest.raises(ConfigError, match="distinct GPU indices"):
            load_config(devices=bad, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="engine in its own process"):
        load_config(devices=[0], engine_process=False)


def test_models_loaded_at_once_share_the_cores(monkeypatch):
    monkeypatch.setattr(fleet_plan, "footprint", lambda c: Footprint("cpu", 0, 0.0))
    monkeypatch.setattr(fleet_plan, "_cores", lambda: 12)
    monkeypatch.delenv("TOKENMILL_NUM_THREADS", raising=False)  # tests/conftest.py sets it
    config = load_config(models=[{"name": "a"}, {"name": "b", "num_threads": 2}, {"name": "c", "load": "on_demand"}])
    assert [c.num_threads for c in fleet_plan.model_configs(config, available_bytes=2**40)] == [4, 2, 4]
    one = load_config(models=[{"name": "a"}])
    assert fleet_plan.model_configs(one, available_bytes=2**40)[0].num_threads is None
    ranks = load_config(models=[{"name": "a", "tensor_parallel_size": 2}, {"name": "b"}])
    assert [c.num_threads for c in fleet_plan.model_configs(ranks, available_bytes=2**40)] == [3, 6]  # per rank


def test_models_that_ask_for_more_threads_than_cores_are_warned_of(monkeypatch, caplog):
    monkeypatch.setattr(fleet_plan, "footprint", lambda c: Footprint("cpu", 0, 0.0))
    monkeypatch.setattr(fleet_plan, "_cores", lambda: 4)
    monkeypatch.delenv("TOKENMILL_NUM_THREADS", raising=False)
    shared = load_config(models=[{"name": "a"}, {"name": "b"}])
    fitting = load_config(models=[{"name": "a", "num_threads": 3}, {"name": "b", "num_threads": 1}])
    over = load_config(num_threads=4, models=[{"name": "a"}, {"name": "b", "load": "on_demand"}])
    with caplog.at_level("WARNING", logger=fleet_plan.__name__):
        for config in (shared, fitting):
            fleet_plan.model_configs(config, available_bytes=2**40)
        assert not caplog.records
        fleet_plan.model_configs(over, available_bytes=2**40)
    assert [r.getMessage() for r in caplog.records] == [
        "the CPU models loaded at once ask for 8 threads on 4 cores (a: 4, b: 4): engines busy at the same time "
        "will take turns at every step; leave num_threads unset to share the cores out, or give each model its share"]


# --- hosts, with a fake loader
class FakeEngine:
    def __init__(self, name):
        self.client = SimpleNamespace(healthy=True, stats=SimpleNamespace(num_running=0, num_waiting=0),
                                      stop=lambda timeout=0: setattr(self, "stopped", True),
                                      info=SimpleNamespace(max_model_len=128))
        self.admission = SimpleNamespace(num_reserved=0)
        self.model_name, self.stopped, self.on_failure = name, False, None


class Loader:
    def __init__(self, fail: int = 0):
        self.loads, self.fail = [], fail

    def __call__(self, config, on_failure):
        if self.fail:
            self.fail -= 1
            raise RuntimeError("no such weights")
        engine = FakeEngine(config.served_model_name)
        engine.on_failure = on_failure
        self.loads.append(engine)
        return engine


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def host(name="m", loader=None, **kw):
    config = load_config(models=[{"name": name}])
    return ModelHost(name, ("alias",), config.for_model(config.models[0]), loader or Loader(), Metrics(), **kw)


def test_backoff_doubles_to_a_minute():
    assert [backoff(n) for n in (1, 2, 3, 6, 7, 20)] == [1, 2, 4, 32, 60, 60]


def test_a_dead_engine_is_restarted_after_a_backoff_and_counted():
    loader = Loader()
    h = host(loader=loader, restart=True)
    h.load()
    wait_for(lambda: h.status == "ready")
    first = loader.loads[0]
    first.on_failure(RuntimeError("killed"))
    assert h.status == "restarting" and h.ctx is None
    with pytest.raises(APIError) as refused:
        h.context()
    assert refused.value.status == 503 and refused.value.fallback and "restarting" in refused.value.message
    assert 1 <= int(refused.value.headers["Retry-After"]) <= 2
    wait_for(lambda: h.status == "ready", timeout=5)
    assert h.context() is loader.loads[1] and first.stopped
    assert h.metrics.engine_restarts.labels("m")._value.get() == 1
    first.on_failure(RuntimeError("late news of the old engine"))  # ignored: that engine is gone already
    assert h.status == "ready"


def test_a_restart_that_fails_to_load_tries_again_later():
    loader = Loader()
    h = host(loader=loader, restart=True)
    h.load()
    wait_for(lambda: h.status == "ready")
    loader.fail = 1
    loader.loads[0].on_failure(RuntimeError("killed"))
    wait_for(lambda: h.failures == 2, timeout=5)  # the reload failed: its next try waits 2 s
    wait_for(lambda: h.status == "ready", timeout=6)
    assert len(loader.loads) == 2


def test_a_lone_model_that_dies_stops_the_server():
    fatal = []
    h = host(on_fatal=lambda hst, exc: fatal.append((hst.served, str(exc))))
    h.load()
    wait_for(lambda: h.status == "ready")
    h.ctx.on_failure(RuntimeError("killed"))
    assert fatal == [(True, "killed")] and h.status == "failed"
    failed_load = host(loader=Loader(fail=1), on_fatal=lambda hst, exc: fatal.append((hst.served, str(exc))))
    failed_load.load()
    wait_for(lambda: len(fatal) == 2)
    assert fatal[1] == (False, "no such weights")


def test_on_demand_models_load_at_first_use_and_the_least_recently_used_idle_one_unloads():
    loader = Loader()
    config = load_config(models=[{"name": n} for n in "abc"])
    hosts = [ModelHost(s.name, (), config.for_model(s), loader, Metrics(), on_demand=True) for s in config.models]
    fleet = Fleet(hosts, max_loaded=2, idle_unload_s=0.5, load_wait_s=10)
    a, b, c = hosts
    assert a.status == "unloaded"
    assert asyncio.run(fleet.context(a)).model_name == "a"
    assert asyncio.run(fleet.context(b)).model_name == "b"
    b.ctx.admission.num_reserved = 1  # b is busy: a, the idle one, makes room for c
    assert asyncio.run(fleet.context(c)).model_name == "c"
    assert (a.status, b.status, c.status) == ("unloaded", "ready", "ready")
    wait_for(lambda: loader.loads[0].stopped)  # its engine stops off the event loop
    c.ctx.admission.num_reserved = 1
    with pytest.raises(APIError) as refused:  # both loaded models are busy
        asyncio.run(fleet.context(a))
    assert refused.value.status == 503 and "every on-demand slot is busy" in refused.value.message
    c.ctx.admission.num_reserved = b.ctx.admission.num_reserved = 0

    async def held_while_another_loads():  # a request between finding b and reserving on it keeps b loaded
        async with fleet.hold(b):
            b.last_used = 0.0  # the least recently used: the first to go, were it not held
            return (await fleet.context(a)).model_name
    assert asyncio.run(held_while_another_loads()) == "a" and b.status == "ready" and c.status == "unloaded"
    fleet.start()  # the idle unloader
    try:
        wait_for(lambda: a.status == b.status == "unloaded", timeout=5)
    finally:
        fleet.stop(0)


def test_a_request_gets_503_with_retry_after_when_loading_outlasts_load_wait():
    gate = threading.Event()

    def slow(config, on_failure):
        gate.wait(10)
        return FakeEngine("slow")
    h = host("slow", loader=slow, on_demand=True)
    fleet = Fleet([h], load_wait_s=0.2)
    with pytest.raises(APIError) as refused:
        asyncio.run(fleet.context(h))
    assert refused.value.status == 503 and "still loading" in refused.value.message
    assert refused.value.headers["Retry-After"] == "5"
    gate.set()
    wait_for(lambda: h.status == "ready")


# --- routes
def routed_fleet(**route):
    loader = Loader()
    config = load_config(models=[{"name": "small"}, {"name": "large", "aliases": ["big"]}],
                         routes=[{"name": "auto", "default": "small", "fallbacks": ["large"], **route}])
    hosts = [ModelHost(s.name, s.aliases, config.for_model(s), loader, Metrics()) for s in config.models]
    fleet = Fleet(hosts, config.routes)
    for h in hosts:
        h.load()
    wait_for(lambda: all(h.status == "ready" for h in hosts))
    for h in hosts:  # the router counts prompt tokens with the default model's tokenizer: one per word here
        async def encode(text, add_special_tokens=True):
            return text.split()
        h.ctx.client.encode = encode
    return fleet


def chat(text, **kw):
    return ChatCompletionRequest(model="auto", messages=[{"role": "user", "content": text}], **kw)


def test_rules_choose_by_what_the_request_shows():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    fleet = routed_fleet(rules=[{"prompt_tokens_above": 5, "model": "large"}, {"tools": True, "model": "large"},
                                {"json_schema": True, "model": "large"}])
    router = Router(fleet, Tenants([]))
    route = fleet.routes["auto"]
    choose = lambda body: asyncio.run(router.choices(route, shape_of(body)))  # noqa: E731
    assert choose(chat("one two three")) == ["small", "large"]
    assert choose(chat("one two three four five six")) == ["large"]
    assert choose(chat("hi", tools=[tool])) == ["large"]
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert choose(chat("hi", response_format=schema)) == ["large"]
    assert choose(CompletionRequest(model="auto", prompt=[1, 2, 3, 4, 5, 6])) == ["large"]
    assert shape_of(chat("hi")).tools is False


def test_a_refusal_for_capacity_falls_back_and_others_do_not():
    fleet = routed_fleet()
    router = Router(fleet, Tenants([]))
    tried = []

    async def attempt(ctx):
        tried.append(ctx.model_name)
        if ctx.model_name == "small":
            raise APIError(429, "at capacity", "rate_limit_error", fallback=True)
        return ctx.model_name
    assert asyncio.run(router.serve(chat("hi"), None, attempt)) == "large" and tried == ["small", "large"]

    async def bad(ctx):
        raise APIError(400, "bad request")
    with pytest.raises(APIError, match="bad request"):
        asyncio.run(router.serve(chat("hi"), None, bad))


def test_names_aliases_and_keys():
    from tokenmill.key_policy import KeyPolicy

    fleet = routed_fleet()
    keys = Tenants([KeyPolicy(name="k", key="sk", models=("big",)), KeyPolicy(name="r", key="sr", models=("auto",))])
    router = Router(fleet, keys)

    async def name(ctx):
        return ctx.model_name
    def serve(model, key):
        body = chat("hi").model_copy(update={"model": model}) if model else SimpleNamespace(model=None)
        return asyncio.run(router.serve(body, key, name))
    assert serve("big", None) == "large" and serve(None, None) == "small"
    assert serve("large", "k") == serve("big", "k") == "large"  # the key names the model by its alias
    assert serve("auto", "r") == "small"
    for model, key in (("small", "k"), ("nope", None), ("small", "r")):
        with pytest.raises(APIError) as refused:
            serve(model, key)
        assert refused.value.status == 404 and refused.value.code == "model_not_found"


def test_the_readme_example_is_a_valid_config(tmp_path):
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = readme.split("### One endpoint, several models", 1)[1].split("```toml", 1)[1].split("```", 1)[0]
    (tmp_path / "models.toml").write_text(block.replace("/models/Qwen2.5-Coder-7B-Instruct", str(tmp_path)))
    config = load_config(tmp_path / "models.toml")
    assert [(m.name, m.load) for m in config.models] == [("small", "startup"), ("coder", "on_demand")]
    assert config.for_model(config.models[1]).quantization == "int8" and config.hourly_cost == 2.5
    assert config.routes[0].targets == ("coder", "coder", "coder", "small", "coder")
    assert [k.admin for k in config.keys] == [False, True]


def test_a_refusal_for_the_servers_capacity_gives_the_key_its_request_back():
    from tokenmill.key_policy import KeyPolicy

    tenants = Tenants([KeyPolicy(name="k", key="sk", rpm=2, tpm=1000)])
    tenants.enter("k")  # at the edge
    first = tenants.charge("k", 100)
    first.refund()  # admission refused it: neither its request nor its tokens count
    for _ in range(2):
        tenants.enter("k")
        tenants.charge("k", 100).settle(100)
    with pytest.raises(APIError) as refused:
        tenants.enter("k")
    assert refused.value.status == 429 and "RPM" in refused.value.message
