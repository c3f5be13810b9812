"""One entry point: ``tokenmill serve | generate | bench | plan``. Every EngineConfig field is a flag (``--kv-cache-dtype``
etc.); flags beat ``TOKENMILL_*`` environment variables, which beat the ``--config`` TOML file."""

from __future__ import annotations

import argparse
import logging
import sys
import typing

from tokenmill.config import SERVER_FIELDS, ConfigError, EngineConfig, load_config


def _add_config_flags(parser: argparse.ArgumentParser, fields: typing.Iterable[str]) -> None:
    parser.add_argument("--config", dest="config_file", help="TOML file with settings (top-level keys)")
    for name in fields:
        field = EngineConfig.model_fields[name]
        flag, annotation = "--" + name.replace("_", "-"), field.annotation
        default = field.default_factory() if field.default_factory else field.default
        help_text = f"{field.description or name} (default: {default})"
        optional = [a for a in typing.get_args(annotation) if a is not type(None)]
        if typing.get_origin(annotation) is list or (len(optional) == 1 and typing.get_origin(optional[0]) is list):
            parser.add_argument(flag, dest=name, action="append", default=None, help=help_text)
        elif annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            literal = typing.get_origin(annotation) is typing.Literal
            parser.add_argument(flag, dest=name, default=None, help=help_text,
                                choices=typing.get_args(annotation) if literal else None)


def _config(args: argparse.Namespace, fields: typing.Iterable[str]) -> EngineConfig:
    return load_config(args.config_file, model=args.model, **{name: getattr(args, name) for name in fields})


def _model_entry(value: str) -> dict:
    """``--model NAME=PATH`` -> a [[models]] entry (an empty PATH: the embedded SmolLM2)."""
    name, sep, path = value.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return {"name": name, "model": path or None}


def _cmd_serve(args: argparse.Namespace) -> int:
    if args.model_entries:
        args.models = args.model_entries
    config = _config(args, args.fields)
    if config.rank:  # a multi-node launch (torchrun): only rank 0 serves
        from tokenmill.engine.ranks import run_rank

        return run_rank(config)
    from tokenmill.server.launch import serve

    return serve(config)


def _cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill.llm import LLM
    from tokenmill.sampling.params import SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = _config(args, args.fields)
    llm = LLM(**config.model_dump(exclude=SERVER_FIELDS))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed_sampling)
    if args.raw:
        result = llm.generate(args.prompt, params)[0]
    else:
        result = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    print(result.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="load-test an OpenAI-compatible server (tokenmill bench --help)", add_help=False)
    sub.add_parser("plan", help="KV cache and memory capacity of a model (tokenmill plan --help)", add_help=False)
    engine_fields = [f for f in EngineConfig.model_fields if f != "model" and f not in SERVER_FIELDS]

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("model", nargs="?", default=None, help="HF checkpoint dir or .gguf file "
                                                              "(default: the embedded SmolLM2)")
    serve.add_argument("--model", dest="model_entries", action="append", type=_model_entry, default=None,
                       metavar="NAME=PATH", help="serve several models (repeatable): each a name and its checkpoint "
                       "(an empty PATH: the embedded SmolLM2); the first is the default. [[models]] in the "
                       "--config file sets more per model")
    _add_config_flags(serve, engine_fields + sorted(SERVER_FIELDS))
    serve.set_defaults(func=_cmd_serve, fields=engine_fields + sorted(SERVER_FIELDS))

    gen = sub.add_parser("generate", help="answer one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF checkpoint dir or .gguf file (default: embedded SmolLM2)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed-sampling", type=int, default=None, help="seed of this request's sampling")
    gen.add_argument("--raw", action="store_true", help="complete the prompt as is, without the chat template")
    _add_config_flags(gen, engine_fields)
    gen.set_defaults(func=_cmd_generate, fields=engine_fields)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Tools with parsers of their own.
    if argv[:1] == ["bench"]:
        from tokenmill.bench.sweep import main as bench_main
        return bench_main(argv[1:])
    if argv[:1] == ["plan"]:
        from tokenmill.bench.plan import main as plan_main
        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    from tokenmill.models.paths import ModelLoadError  # not models.loader: that imports torch (~1.2 s)
    from tokenmill.sampling.params import SamplingParamError

    try:
        return args.func(args)
    except (ConfigError, ModelLoadError, SamplingParamError, ValueError) as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2
