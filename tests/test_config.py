import pytest

from tokenmill.config import ConfigError, EngineConfig, load_config, parse_byte_size


def test_precedence_cli_env_toml_default(tmp_path, monkeypatch):
    toml = tmp_path / "tm.toml"
    toml.write_text('block_size = 32\nmax_num_seqs = 4\nseed = 5\n[benchmark]\nconcurrency = "1,8"\n')
    monkeypatch.setenv("TOKENMILL_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("TOKENMILL_SEED", "6")
    cfg = load_config(toml, seed=7)
    assert cfg.block_size == 32  # toml over default
    assert cfg.max_num_seqs == 8  # env over toml
    assert cfg.seed == 7  # explicit over env
    assert cfg.kv_cache_dtype == "auto"  # default
    assert load_config(toml, seed=None).seed == 6  # None means "flag not given"


@pytest.mark.parametrize("field,value,needle", [
    ("kv_cache_dtype", "int4", "'auto', 'fp8', 'bf16', 'fp16' or 'fp32'"),
    ("block_size", 0, "greater than 0"),
    ("device", "tpu", "'auto', 'cpu' or 'cuda'"),
    ("kv_cache_memory", "lots", "not a byte size"),
    ("max_num_seqs", "many", "integer"),
])
def test_bad_values_name_field_and_allowed_values(field, value, needle):
    with pytest.raises(ConfigError) as err:
        load_config(**{field: value})
    assert field in str(err.value) and needle in str(err.value)


def test_bad_env_and_unknown_toml_keys_fail(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_KV_CACHE_DTYPE", "fp4")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        load_config()
    monkeypatch.delenv("TOKENMILL_KV_CACHE_DTYPE")
    toml = tmp_path / "bad.toml"
    toml.write_text("blok_size = 3\n")
    with pytest.raises(ConfigError, match="blok_size"):
        load_config(toml)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(model=str(tmp_path / "no-such-model"))


def test_byte_sizes():
    assert parse_byte_size("2GiB") == 2 * 2**30
    assert parse_byte_size("512MB") == 512 * 10**6
    assert parse_byte_size(1000) == 1000


@pytest.mark.parametrize("device,expected", [("cpu", "bf16"), ("cuda", "fp8")])
def test_auto_kv_cache_dtype_is_fp8_on_cuda_and_bf16_on_a_cpu(device, expected):
    from tokenmill.engine.settle import choose_device, choose_kv_cache_dtype

    config = load_config(device=device)
    assert choose_kv_cache_dtype(config, choose_device(config)) == expected
    assert choose_kv_cache_dtype(load_config(device=device, kv_cache_dtype="fp8"), device) == "fp8"


def test_torchrun_variables_place_a_rank_and_set_the_tensor_parallel_size(monkeypatch):
    for var, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.7",
                       "MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(var, value)
    config = load_config()
    assert (config.rank, config.world_size, config.local_rank, config.master_addr, config.master_port,
            config.launch_tensor_parallel_size) == (3, 4, 1, "10.0.0.7", 29400, 4)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size \(2\) differs from the launch's world_size \(4\)"):
        load_config(tensor_parallel_size=2)
    monkeypatch.delenv("RANK")
    with pytest.raises(ConfigError, match="a launch of 4 ranks needs rank in 0..3"):
        load_config()


def test_chat_template_settings():
    assert EngineConfig(default_chat_template_kwargs='{"enable_thinking": false}').default_chat_template_kwargs == \
        {"enable_thinking": False}
    for bad, words in ((dict(default_chat_template_kwargs="[1]"), "JSON object"),
                       (dict(default_chat_template_kwargs="{nope"), "JSON object"),
                       (dict(chat_template="/no/such/template.jinja"), "no chat template file")):
        with pytest.raises(Exception, match=words):
            EngineConfig(**bad)
