"""The one configuration object of an engine, built and validated once.

Precedence, highest first: explicit arguments (CLI flags, ``LLM(**kwargs)``) > ``TOKENMILL_*`` environment
variables > a TOML file (``--config path``; top-level keys, other tables such as ``[benchmark]`` belong to
other tools) > the defaults below. No other module reads the environment.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from tokenmill.key_policy import KeyPolicy, check_unique
from tokenmill.model_specs import ModelSpec, RouteSpec, check_fleet

ENV_PREFIX = "TOKENMILL_"
# torchrun's (torch.distributed's) launch variables -> the fields they set.
LAUNCH_ENV = {"RANK": "rank", "WORLD_SIZE": "world_size", "LOCAL_RANK": "local_rank", "MASTER_ADDR": "master_addr",
              "MASTER_PORT": "master_port"}

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "ki": 2**10, "mi": 2**20, "gi": 2**30}


# Fields only `tokenmill serve` uses; the other commands take the rest.
SERVER_FIELDS = frozenset({"host", "port", "served_model_name", "api_key", "api_key_file", "keys", "models", "routes",
                           "max_loaded_models", "idle_unload_s", "load_wait_s", "usage_db", "hourly_cost",
                           "auth_all_endpoints", "cors_origins", "shutdown_timeout", "admission_overcommit", "log_json",
                           "engine_process",
                           "tool_call_parser", "reasoning_parser", "chat_template", "default_chat_template_kwargs",
                           "responses_store_max_count", "responses_store_max_bytes", "max_request_body_bytes", "max_n",
                           "max_stop_sequences",
                           "max_stop_length", "max_logit_bias", "max_stop_token_ids", "max_prompts", "max_tools",
                           "max_embedding_inputs", "max_json_depth", "request_output_budget_bytes",
                           "responses_store_max_count_per_key", "responses_store_max_bytes_per_key",
                           "responses_store_max_item_bytes", "stream_buffer_bytes", "stream_send_timeout_s",
                           "body_read_timeout_s", "max_connections", "max_header_bytes", "keep_alive_timeout_s",
                           "metrics_per_key"})


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


def parse_byte_size(value: int | float | str) -> int:
    """'2GiB', '512MB', '1e9' or a plain number of bytes -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a byte size: {value!r} (examples: 2GiB, 512MB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


class EngineConfig(BaseSettings):
    """Model, cache and scheduler settings of one engine."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # --- model
    model: str | None = Field(None, description="HF checkpoint dir or .gguf file; None = embedded SmolLM2")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="compute dtype; auto = bfloat16 on CUDA, on a CPU the faster of bfloat16 and "
                           "float32 (measured at start-up)")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = Field(None, gt=0, description="prompt + output tokens; None = model's limit")
    kernel_backend: Literal["auto", "triton", "cpu", "torch"] = Field(
        "auto", description="auto = Triton kernels on CUDA, on a CPU the C kernels built for the host at first use "
                            "(the PyTorch references where no compiler builds them); triton on a CPU needs "
                            "TRITON_INTERPRET=1 (slow: for proving the kernels)")
    cpu_weight_layout: Literal["auto", "plain", "packed"] = Field(
        "auto", description="CPU linear layers: weights packed once for oneDNN, plain, or auto = per layer shape and "
                            "row count, whichever was faster when timed at start-up")
    quantization: Literal["auto", "checkpoint", "none", "int8", "int4", "fp8"] = Field(
        "auto", description="weights: auto = as the checkpoint ships them (a GGUF file's Q4_0 / Q4_1 / Q8_0 tensors "
                            "kept quantized at the batch sizes where that was faster when timed at start-up, a dense "
                            "copy for the others); checkpoint = the checkpoint's quantized tensors at every batch "
                            "size (least memory); none = full precision; "
                            "int8 / int4 / fp8 = quantize a full-precision checkpoint's linear layers as it loads "
                            "(round to nearest: int8 per channel, int4 in groups of quantization_group_size, fp8 "
                            "per channel)")
    quantization_group_size: int = Field(128, ge=32, multiple_of=32,
                                         description="inputs per scale of --quantization int4 (a multiple of 32)")
    attention_prefetch: Literal["auto", "l1", "l2"] = Field(
        "auto", description="CPU decode attention: ask for the next cache block into the L1 or only the L2; auto = "
                            "whichever was faster when timed at start-up")
    prefill_attention: Literal["auto", "sdpa", "amx", "avx512", "paged"] = Field(
        "auto", description="CPU prefill attention: PyTorch's flash SDPA over a chunk's own tokens, the tile kernel "
                            "on AMX (bf16 models on CPUs with AMX) or on AVX512-BF16 registers (avx512), or paged: the "
                            "decode kernel over the cache with each chunk a causal segment (bf16 models over a bf16 "
                            "KV cache); auto = whichever was fastest when timed at start-up")
    kernel_tuning: Literal["heuristic", "autotune"] = Field(
        "heuristic", description="fused-MoE launch configs: heuristic, or measured once per shape and kept in "
                                 "kernel_cache_dir")
    kernel_cache_dir: str = Field("~/.cache/tokenmill/kernels", description="where autotuned MoE configs and the CPU "
                                  "linear-layout thresholds measured at start-up are kept (per GPU / CPU model)")
    # --- KV cache
    kv_cache_dtype: Literal["auto", "fp8", "bf16", "fp16", "fp32"] = Field(
        "auto", description="auto = fp8 on CUDA (native fp8 reads in the Triton kernels), bf16 on a CPU (the CPU has "
                            "no vector fp8 conversion: widening an fp8 cache cost more than its halved reads)")
    block_size: int = Field(16, gt=0, le=1024)
    kv_cache_memory: int | None = Field(
        None, gt=0, description="KV cache bytes (accepts '2GiB'); unset: 2 GiB on a CPU, on a GPU what "
                                "gpu_memory_utilization leaves after the weights (set: exactly this, on any device)")
    kv_cache_populate: Literal["startup", "lazy"] = Field(
        "startup", description="when a CPU cache's pages become resident (each costs a page fault at its first write, "
                               "~12 us on a VM whose host backs memory lazily): startup = before the engine is ready, "
                               "as a zeroed cache; lazy = at first use, inside the engine step that reaches them")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    enable_prefix_caching: bool = Field(True, description="reuse the KV of full blocks shared with earlier prompts "
                                                          "(hash-chained, LRU-evicted only when the pool needs room)")
    # --- scheduler
    max_num_seqs: int = Field(256, gt=0)
    max_num_batched_tokens: int = Field(2048, gt=0, description="token budget of one engine step")
    # --- speculative decoding
    speculative_method: Literal["off", "ngram", "mtp"] = Field(
        "off", description="draft tokens to verify in one pass: ngram = prompt lookup (the last n tokens matched "
                           "earlier in the request's own prompt and output); mtp = DeepSeek-V3's multi-token-"
                           "prediction layer, in the checkpoint (num_nextn_predict_layers)")
    num_speculative_tokens: int = Field(3, gt=0, le=16, description="most draft tokens per request and step")
    prompt_lookup_min: int = Field(2, gt=0, description="shortest n-gram the ngram method matches")
    prompt_lookup_max: int = Field(4, gt=0, description="longest n-gram the ngram method matches (tried first)")
    # --- structured outputs
    grammar_timeout: float = Field(
        5.0, gt=0, description="seconds a request's grammar may take to compile and pass a trial walk before it is "
                               "admitted, and for any one step's work in the engine; over it the request gets a 400 "
                               "naming its constraint, and no other request waits for it")
    grammar_max_bytes: int = Field(256 * 2**20, gt=0, description="largest compiled grammar of one request "
                                                                  "(accepts '256MiB')")
    grammar_cache_bytes: int = Field(16 * 2**20, gt=0, description="most bytes of grammar text whose check verdicts "
                                     "the API process remembers (accepts '16MiB')")
    grammar_checker_memory: int = Field(2 * 2**30, gt=0, description="address space a grammar check may add to its "
                                        "checker process (RLIMIT_AS); over it the grammar is refused (accepts '2GiB')")
    # --- parallelism
    devices: list[int] | None = Field(None, description="the GPUs this model's engine uses, its ranks on them in "
                                      "order (CUDA_VISIBLE_DEVICES of its engine process: one model per GPU set in a "
                                      "server of several); None = GPUs 0..N-1")
    tensor_parallel_size: int = Field(1, ge=1, description="ranks the model is split across (heads, MLP width, "
                                                          "vocabulary), one process each on this host: GPUs 0..N-1 "
                                                          "with NCCL, or the CPU cores shared out, with gloo")
    # --- ranks on several nodes: torchrun sets these (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)
    rank: int | None = Field(None, ge=0, description="this process's rank in a multi-node launch (RANK): 0 serves, "
                                                     "the others run their shards of the model")
    world_size: int | None = Field(None, ge=1, description="ranks in a multi-node launch (WORLD_SIZE): the "
                                                           "tensor-parallel size")
    local_rank: int = Field(0, ge=0, description="this rank's GPU on its node (LOCAL_RANK)")
    master_addr: str = Field("127.0.0.1", description="rank 0's host (MASTER_ADDR)")
    master_port: int = Field(29500, ge=1, le=65534, description="torchrun's port on rank 0's host (MASTER_PORT); "
                                                                "the ranks meet on the next port")
    # --- runtime
    seed: int = 0
    num_threads: int | None = Field(
        None, gt=0, description="torch CPU threads of the engine; None = every core, or one fewer (left to the API "
                                "process) where the decode step, timed at start-up, is as fast")
    enforce_eager: bool = Field(False, description="run the model eagerly; otherwise on a CPU the layer stack is "
                                                   "compiled with torch.compile and warmed up at start-up")
    cpu_layer_stack: bool = Field(True, description="on a CPU, run a plain Llama-style model's (int4 / int8 C "
                                  "kernels, bf16 or float32 activations, bf16 KV cache) whole layer stack in one C "
                                  "call in the steps that allow it (models/cpu_stack.py), the others compiled or "
                                  "eagerly; off: every step that way")
    compile_cache_dir: str = Field("~/.cache/tokenmill/inductor", description="torch.compile's generated code, "
                                   "kept across restarts (a subdirectory per vector ISA inductor generates for)")
    tokenizer_cache_dir: str = Field("~/.cache/tokenmill/tokenizers", description="a GGUF file's tokenizer, converted "
                                     "once (seconds) and kept across restarts; '' converts it at every start")
    # --- server (used by `tokenmill serve` only)
    host: str = Field("127.0.0.1", description="bind address; 0.0.0.0 to listen on every interface")
    port: int = Field(8000, ge=0, le=65535)
    served_model_name: str | None = Field(None, description="model id in the API; default: the checkpoint's name")
    api_key: list[str] = Field(default_factory=list, description="accepted API key (repeatable)")
    api_key_file: str | None = Field(None, description="file of 'name: key' lines")
    keys: list[KeyPolicy] = Field(default_factory=list, description="API keys as tenants ([[keys]] tables in the "
                                  "TOML file: name, key or key_sha256, models, rpm, tpm; tokenmill/key_policy.py)")
    models: list[ModelSpec] = Field(default_factory=list, description="several models in one server ([[models]] "
                                    "tables in the TOML file: name, model, aliases, load, any engine setting; "
                                    "tokenmill/model_specs.py); the first is the default")
    routes: list[RouteSpec] = Field(default_factory=list, description="virtual model names routed to [[models]] by "
                                    "the request's prompt length, tools or JSON schema, with fallbacks ([[routes]] "
                                    "tables)")
    max_loaded_models: int = Field(1, ge=1, description="most load = \"on_demand\" models loaded at once (the least "
                                   "recently used idle one unloads to make room)")
    idle_unload_s: float = Field(600.0, gt=0, description="seconds an on-demand model may sit idle before it unloads")
    load_wait_s: float = Field(60.0, ge=0, description="seconds a request waits for its on-demand model to load "
                               "before it gets 503 + Retry-After")
    usage_db: str = Field("~/.local/share/tokenmill/usage.sqlite3", description="the usage ledger (SQLite: "
                          "requests, tokens, errors and engine time per key x model x hour, kept across restarts; "
                          "GET /v1/usage); '' keeps none")
    hourly_cost: float | None = Field(None, ge=0, description="what the machine costs per hour (USD): the usage "
                                      "ledger prices each request's engine time at it")
    auth_all_endpoints: bool = Field(False, description="also require a key for /health, /ready, /metrics, "
                                     "/openapi.json and /docs")
    metrics_per_key: bool = Field(False, description="series per API key name on /metrics (key_tokens, "
                                  "key_requests, key_engine_seconds, key_time_to_first_token_seconds); off: no key "
                                  "name appears there (GET /v1/usage has the same figures for the keys entitled)")
    cors_origins: list[str] = Field(default_factory=list, description="allowed CORS origin (repeatable)")
    shutdown_timeout: float = Field(30.0, ge=0, description="seconds in-flight requests get to finish on SIGTERM")
    admission_overcommit: float = Field(
        2.0, gt=0, description="admit while promised tokens (prompt + max_tokens of live requests) <= this x "
                               "KV cache tokens; beyond it requests get 429")
    log_json: bool = Field(False, description="one JSON object per log line")
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "deepseek_v3", "kimi_k2", "qwen3_coder",
                              "glm45", "gpt_oss", "mistral", "pythonic"] = Field(
        "auto", description="the model's tool-call format; auto = read from its chat template (hermes when it has "
                            "none)")
    reasoning_parser: Literal["auto", "none", "deepseek_r1", "qwen3", "glm45", "gpt_oss"] = Field(
        "auto", description="how the model's thinking is split from its answer (reasoning_content); auto = from its "
                            "chat template (none when it has no <think>)")
    chat_template: str | None = Field(None, description="a Jinja chat template file that replaces the checkpoint's")
    default_chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description='variables every chat template rendering gets (JSON, e.g. '
                                          '\'{"enable_thinking": false}\'); a request\'s chat_template_kwargs win')
    responses_store_max_count: int = Field(
        1000, ge=0, description="most responses /v1/responses keeps for previous_response_id and GET (the least "
                                "recently used dropped first)")
    responses_store_max_bytes: int = Field(64 * 2**20, ge=0, description="most bytes of stored responses "
                                                                         "(accepts '64MiB')")
    responses_store_max_count_per_key: int = Field(
        200, ge=0, description="most stored responses of one API key; past the server's bounds the key holding the "
                               "most bytes gives way first, so one key cannot push out another's")
    responses_store_max_bytes_per_key: int = Field(16 * 2**20, ge=0, description="most bytes of one API key's "
                                                   "stored responses (accepts '16MiB')")
    responses_store_max_item_bytes: int = Field(2 * 2**20, gt=0, description="largest response (with its "
                                                "conversation) the store keeps; a larger one is answered, not kept "
                                                "(accepts '2MiB')")
    # --- request limits (each a 400 naming the parameter)
    max_request_body_bytes: int = Field(4 * 2**20, gt=0, description="largest request body (accepts '4MiB')")
    max_n: int = Field(16, gt=0, description="most choices (n) per prompt")
    max_stop_sequences: int = Field(16, gt=0, description="most stop strings per request")
    max_stop_length: int = Field(256, gt=0, description="most characters in one stop string")
    max_logit_bias: int = Field(1024, gt=0, description="most logit_bias entries per request")
    max_stop_token_ids: int = Field(256, gt=0, description="most stop_token_ids per request")
    max_prompts: int = Field(64, gt=0, description="most prompts in one /v1/completions request")
    max_tools: int = Field(128, gt=0, description="most tools in one chat request")
    max_embedding_inputs: int = Field(2048, gt=0, description="most inputs in one /v1/embeddings request "
                                                              "(OpenAI's limit)")
    max_json_depth: int = Field(64, gt=0, description="deepest nesting of arrays and objects in a request body")
    request_output_budget_bytes: int = Field(
        256 * 2**20, gt=0, description="most bytes one request may make the server build: its logprobs (prompts x "
                                       "choices x tokens x candidates) and embeddings, estimated before it runs "
                                       "(accepts '256MiB')")
    # --- the connection (each bounds what one client can hold)
    stream_buffer_bytes: int = Field(4 * 2**20, gt=0, description="most bytes of a stream's output waiting for its "
                                     "client to read them; past it the stream is cut off and its generation aborted "
                                     "(accepts '4MiB')")
    stream_send_timeout_s: float = Field(30.0, gt=0, description="seconds one event of a stream may wait for its "
                                         "client to read it; past it the stream is closed and its generation aborted")
    body_read_timeout_s: float = Field(30.0, gt=0, description="seconds a client has to send a request's body")
    max_connections: int = Field(1024, gt=0, description="open connections and requests at once; beyond it new "
                                 "ones get 503")
    max_header_bytes: int = Field(16 * 2**10, ge=1024, description="largest request line and headers (accepts "
                                  "'16KiB')")
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="seconds an idle keep-alive connection stays open")
    engine_process: bool = Field(True, description="run the engine core in its own process (--no-engine-process: "
                                                   "on a thread of the API process, one GIL for both)")

    @field_validator("default_chat_template_kwargs", mode="before")
    @classmethod
    def _parse_json_object(cls, value: Any) -> Any:
        if isinstance(value, str):  # a CLI flag or an environment variable
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(f"not a JSON object: {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"must be a JSON object, got {value!r}")
        return value

    @field_validator("chat_template")
    @classmethod
    def _readable_template(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).expanduser().is_file():
            raise ValueError(f"no chat template file at {value!r}")
        return value

    @field_validator("kv_cache_memory", "max_request_body_bytes", "grammar_max_bytes", "responses_store_max_bytes",
                     "responses_store_max_bytes_per_key", "responses_store_max_item_bytes", "stream_buffer_bytes",
                     "max_header_bytes", "request_output_budget_bytes", "grammar_cache_bytes", "grammar_checker_memory",
                     mode="before")
    @classmethod
    def _parse_size(cls, value: Any) -> int | None:
        return None if value is None else parse_byte_size(value)

    @field_validator("keys")
    @classmethod
    def _unique_keys(cls, value: list[KeyPolicy]) -> list[KeyPolicy]:
        check_unique(value)
        return value

    @field_validator("keys", "models", "routes", mode="before")
    @classmethod
    def _parse_tables(cls, value: Any) -> Any:
        # An environment variable: a JSON list; a repeated CLI flag: one JSON object each.
        try:
            value = json.loads(value) if isinstance(value, str) else value
            return [json.loads(v) if isinstance(v, str) else v for v in value] if isinstance(value, list) else value
        except ValueError:
            raise ValueError("not JSON (a list of objects, or one object per flag)") from None

    @model_validator(mode="after")
    def _check_fleet(self) -> "EngineConfig":
        if self.routes and not self.models:
            raise ValueError("routes need [[models]] to route to")
        if self.models and (self.model is not None or self.served_model_name is not None):
            raise ValueError("give the models either as [[models]] / --model NAME=PATH or as one model (the "
                             "positional argument, served_model_name), not both")
        check_fleet(self.models, self.routes, frozenset(type(self).model_fields), SERVER_FIELDS)
        return self

    def for_model(self, spec: ModelSpec, **defaults: Any) -> "EngineConfig":
        """The engine config of one of ``models``: this one's settings, then ``defaults``, then the entry's own
        (ConfigError naming the model where they are invalid)."""
        values = self.model_dump(exclude={"models", "routes"})
        values.update(defaults)
        values.update(spec.settings, model=spec.model, served_model_name=spec.name)
        try:
            return type(self)(**values)
        except ValidationError as exc:
            raise ConfigError(f"model {spec.name!r}: " + _format_errors(exc)) from None

    @model_validator(mode="after")
    def _check_lookup(self) -> "EngineConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) is larger than prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self

    @model_validator(mode="after")
    def _check_launch(self) -> "EngineConfig":
        if self.world_size is None or self.world_size == 1:
            return self
        if self.tensor_parallel_size not in (1, self.world_size):
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) differs from the launch's "
                             f"world_size ({self.world_size})")
        if self.rank is None or self.rank >= self.world_size:
            raise ValueError(f"a launch of {self.world_size} ranks needs rank in 0..{self.world_size - 1}")
        return self

    @model_validator(mode="after")
    def _check_devices(self) -> "EngineConfig":
        if self.devices is not None:
            if len(self.devices) < self.tensor_parallel_size or len(set(self.devices)) != len(self.devices) or \
                    min(self.devices, default=0) < 0:
                raise ValueError(f"devices {self.devices}: need {self.tensor_parallel_size} distinct GPU indices "
                                 "(one per tensor-parallel rank)")
            if not self.engine_process:
                raise ValueError("devices needs the engine in its own process (engine_process = true)")
        return self

    @property
    def launch_tensor_parallel_size(self) -> int:
        """The ranks the model is split across: a multi-node launch's world size, else tensor_parallel_size."""
        return self.world_size if self.world_size and self.world_size > 1 else self.tensor_parallel_size

    @property
    def cpu_kv_cache_memory(self) -> int:
        """The KV cache bytes of an engine on a CPU: kv_cache_memory, 2 GiB when unset."""
        return self.kv_cache_memory if self.kv_cache_memory is not None else 2 * 2**30

    @model_validator(mode="after")
    def _check_paths(self) -> "EngineConfig":
        if self.model is not None and not Path(self.model).exists():
            raise ValueError(f"model path does not exist: {self.model}")
        if self.api_key_file is not None and not Path(self.api_key_file).is_file():
            raise ValueError(f"api_key_file does not exist: {self.api_key_file}")
        return self


def _read_toml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    # Tables belong to other tools (e.g. [benchmark]); scalar keys are engine fields.
    return {k: v for k, v in data.items() if not isinstance(v, dict)}


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "config"
        secret = err["loc"][:1] == ("keys",)  # never echo an API key
        lines.append(f"{field}: {err['msg']}" + ("" if secret else f" (got {err.get('input')!r})"))
    return "invalid configuration:\n  " + "\n  ".join(lines)


def load_config(config_file: str | os.PathLike | None = None, **overrides: Any) -> EngineConfig:
    """Build the EngineConfig: overrides > TOKENMILL_* env > TOML file > defaults.

    Overrides whose value is None are treated as "not given" (an unset CLI flag). A process that torchrun started
    also takes its place in the launch from torchrun's variables (``LAUNCH_ENV``), below TOKENMILL_* ones.
    """
    values: dict[str, Any] = _read_toml(config_file) if config_file else {}
    values.update({field: os.environ[var] for var, field in LAUNCH_ENV.items() if var in os.environ})
    values.update(EnvSettingsSource(EngineConfig)())
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        config = EngineConfig(**values)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None
    for spec in config.models:  # each model's own settings, checked before anything loads
        config.for_model(spec)
    return config
