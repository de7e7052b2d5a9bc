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
    status = relaunch_if_needed(cfg, ["train", *overrides])
    if status is not None:
        return status
    if int(os.environ.get("RANK", 0)) == 0:
        logging.getLogger("shardtrain").info("resolved config:\n" + to_yaml(cfg).rstrip())
    try:
        Trainer.create(cfg).fit()
    finally:
        destroy_distributed()
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    from shardtrain.export.consolidate import consolidate

    files = consolidate(args.checkpoint, args.out, args.max_shard_size, args.dtype, args.key)
    for file in files:
        print(file)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from shardtrain.checkpoint.inspect import inspect_path

    report = inspect_path(args.path)
    print(report.render())
    return 0 if report.complete else 1


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

    cons = sub.add_parser(
        "consolidate",
        help="sharded checkpoint -> model-only safetensors (streamed, one output shard in memory)",
        description="Reads shardtrain, Lightning (meta.pt + .metadata + *.distcp) and plain DCP "
        "checkpoints. OUT ending in .safetensors: one file; otherwise a directory with "
        "model.safetensors, or HF-style shards + model.safetensors.index.json with --max-shard-size.",
    )
    cons.add_argument("checkpoint", help="checkpoint directory (the one holding .metadata)")
    cons.add_argument("out", help="output .safetensors file or directory")
    cons.add_argument("--max-shard-size", default=None, help="e.g. 5GB, 500MB (default: one file)")
    cons.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                      help="cast weights (default: as saved)")
    cons.add_argument("--key", default=None,
                      help="top-level key holding the weights (default: state_dict. for Lightning, "
                      "else model.)")

    insp = sub.add_parser("inspect", help="describe a checkpoint and check that it is whole",
                          description="Exit status 0 when complete with no problem found, else 1.")
    insp.add_argument("path", help="checkpoint directory, .safetensors file or index .json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        if args.command == "train":
            return cmd_train(args.overrides)
        if args.command == "consolidate":
            return cmd_consolidate(args)
        if args.command == "inspect":
            return cmd_inspect(args)
    except ShardtrainError as exc:
        print(f"shardtrain: error: {exc}", file=sys.stderr)
        return 2
    return 1
