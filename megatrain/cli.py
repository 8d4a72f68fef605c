"""`megatrain` command line: parse, build, run, close."""

from __future__ import annotations

import argparse
import sys

from .errors import MegatrainError


def _train(args) -> None:
    from .config import TrainConfig
    from .trainer import train

    train(TrainConfig.load(args.config, args.overrides))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a model: megatrain train CONFIG.yaml [key=value ...]")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="key=value overrides (TrainingArguments names)")
    p.set_defaults(func=_train)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except MegatrainError as e:
        print(f"megatrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("megatrain: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
