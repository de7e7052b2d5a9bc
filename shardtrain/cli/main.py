"""``shardtrain`` command line: ``shardtrain train [key=value ...]``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from shardtrain.errors import ShardtrainError
from shardtrain.logs import setup_logging


def cmd_train(overrides: list[str]) -> int:
    from shardtrain.config.loader import load_config, to_yaml
    from shardtrain.diagnostics.failures import describe, first_failure, record_failure
    from shardtrain.distributed.env import destroy_distributed
    from shardtrain.distributed.launch import relaunch_if_needed
    from shardtrain.train.loop import Trainer

    cfg = load_config(overrides)  # every config error surfaces here, before any process starts
    started = time.time()
    status = relaunch_if_needed(cfg, ["train", *overrides])
    if status is not None:
        if status != 0:
            failure = first_failure(Path(cfg.run.dir), started)
            if failure is not None:
                print(f"shardtrain: error: {describe(failure)}", file=sys.stderr)
        return status
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        logging.getLogger("shardtrain").info("resolved config:\n" + to_yaml(cfg).rstrip())
    trainer = None
    try:
        trainer = Trainer.create(cfg)
        trainer.fit()
    except BaseException as exc:
        if not isinstance(exc, SystemExit) or exc.code not in (0, None):
            step = trainer.step if trainer is not None else 0
            record_failure(Path(cfg.run.dir), rank, step, type(exc).__name__, str(exc).splitlines()[0]
                           if str(exc) else "", traceback.format_exc())
        raise
    finally:
        destroy_distributed()
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from shardtrain.config.loader import launch_shape, load_config
    from shardtrain.diagnostics.planner import plan_table
    from shardtrain.export.consolidate import parse_size

    cfg = load_config(args.overrides)
    per_node, world = launch_shape(cfg)
    memory = parse_size(args.device_memory) if args.device_memory else None
    sizes = args.world_sizes or sorted({1, 2, 4, 8, world})
    print(plan_table(cfg, sizes, memory, args.processes_per_node or per_node))
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

    plan = sub.add_parser(
        "plan", help="estimate per-rank memory for each strategy and world size",
        description="Same key=value overrides as train. Parameters, gradients and optimizer state are "
        "exact for FSDP2's layout; activations and communication buffers are estimates "
        "(docs/memory-planner.md).",
    )
    plan.add_argument("overrides", nargs="*", help="key=value config overrides")
    plan.add_argument("--device-memory", default=None, help="memory per device, e.g. 80GB")
    plan.add_argument("--world-sizes", type=int, nargs="+", default=None,
                      help="world sizes to show (default 1 2 4 8 and the config's)")
    plan.add_argument("--processes-per-node", type=int, default=None,
                      help="for hybrid strategies (default: trainer.devices)")

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
        if args.command == "plan":
            return cmd_plan(args)
    except ShardtrainError as exc:
        print(f"shardtrain: error: {exc}", file=sys.stderr)
        return 2
    return 1
