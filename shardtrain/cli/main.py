"""``shardtrain`` command line: ``shardtrain train [key=value ...]``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from shardtrain.errors import ShardtrainError
from shardtrain.logs import setup_logging


def cmd_train(overrides: list[str]) -> int:
    from shardtrain.config.loader import load_config, to_yaml
    from shardtrain.distributed.env import destroy_distributed
    from shardtrain.distributed.launch import relaunch_if_needed
    from shardtrain.train.loop import Trainer

    cfg = load_config(overrides)  # every config error surfaces here, before any process starts
    relaunch_if_needed(cfg, ["train", *overrides])
    if int(os.environ.get("RANK", 0)) == 0:
        logging.getLogger("shardtrain").info("resolved config:\n" + to_yaml(cfg).rstrip())
    try:
        Trainer.create(cfg).fit()
    finally:
        destroy_distributed()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardtrain",
        description="Train models with FSDP2. Every setting is a key=value override "
        "(see docs/configuration.md).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train a model (default: a small Llama on the Python standard library)",
        description="Examples: shardtrain train | shardtrain train trainer.devices=2 "
        "strategy=hybrid_shard | shardtrain train experiment=quick trainer.max_steps=50",
    )
    train.add_argument("overrides", nargs="*", help="key=value config overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        if args.command == "train":
            return cmd_train(args.overrides)
    except ShardtrainError as exc:
        print(f"shardtrain: error: {exc}", file=sys.stderr)
        return 2
    return 1
