"""One entry point: ``tokenmill generate``. Every EngineConfig field is a flag (``--kv-cache-dtype`` etc.)."""

from __future__ import annotations

import argparse
import logging
import sys
import typing

from tokenmill.config import ConfigError, EngineConfig


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", dest="config_file", help="TOML file with engine settings")
    for name, field in EngineConfig.model_fields.items():
        if name == "model":
            continue
        choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else None
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None, choices=choices,
                            help=f"{field.description or name} (default: {field.default})")


def _engine_overrides(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in EngineConfig.model_fields if name != "model"}


def _cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill.llm import LLM
    from tokenmill.sampling.params import SamplingParams

    llm = LLM(model=args.model, config_file=args.config_file, **_engine_overrides(args))
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
    gen = sub.add_parser("generate", help="answer one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF checkpoint dir or .gguf file (default: embedded SmolLM2)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed-sampling", type=int, default=None, help="seed of this request's sampling")
    gen.add_argument("--raw", action="store_true", help="complete the prompt as is, without the chat template")
    _add_engine_flags(gen)
    gen.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from tokenmill.models.loader import ModelLoadError
    from tokenmill.sampling.params import SamplingParamError

    try:
        return args.func(args)
    except (ConfigError, ModelLoadError, SamplingParamError) as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2
