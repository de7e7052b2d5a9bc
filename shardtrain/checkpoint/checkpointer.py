"""The checkpointer: sharded DCP saves that are complete or invisible, and exact resumes.

Saving (every rank): model and optimizer state as sharded DTensors through ``get_state_dict`` into a
temporary directory with ``dcp.save`` (or ``dcp.async_save``) on a process group of its own, plus this
rank's RNG states. When DCP's metadata exists, every rank has written its files; rank 0 then writes
``trainer_state.json``, renames the directory to its final name, and only after that deletes
checkpoints beyond ``keep_last``. Nothing else needs a collective, so a save cannot deadlock with
training collectives.

Loading (every rank): the directory is verified and compared with the model before DCP reads
anything, on every rank from the same files, so a bad checkpoint makes every rank raise the same
error at once instead of hanging in a collective. DCP then reshards to the current mesh.
"""

from __future__ import annotations

import datetime
import logging
import platform
import random
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from shardtrain import faults
from shardtrain.checkpoint import layout
from shardtrain.config.loader import config_hash
from shardtrain.config.schema import Config
from shardtrain.errors import CheckpointError

log = logging.getLogger("shardtrain")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.accelerator.is_available():
        device_type = torch.accelerator.current_accelerator().type
        state["accelerator"] = torch.get_device_module(device_type).get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "accelerator" in state and torch.accelerator.is_available():
        device_type = torch.accelerator.current_accelerator().type
        torch.get_device_module(device_type).set_rng_state(state["accelerator"])


def expected_shapes(state: dict[str, Any], prefix: str) -> dict[str, tuple[int, ...]]:
    """Flattened DCP keys of the tensors in ``state`` (global shapes for DTensors)."""
    return {f"{prefix}.{k}": tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def check_model_compatible(path: Path, metadata, model_state: dict[str, Any]) -> None:
    """Name missing keys, unexpected keys and shape mismatches between checkpoint and model."""
    saved = {
        k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    wanted = expected_shapes(model_state, "model")
    missing = sorted(set(wanted) - set(saved))
    unexpected = sorted(set(saved) - set(wanted))
    mismatched = sorted(
        f"{k}: checkpoint {list(saved[k])} vs model {list(wanted[k])}"
        for k in set(saved) & set(wanted) if saved[k] != wanted[k]
    )
    if not (missing or unexpected or mismatched):
        return
    def show(items: list[str]) -> str:
        return ", ".join(items[:6]) + (f" (+{len(items) - 6} more)" if len(items) > 6 else "")
    problems = []
    if missing:
        problems.append(f"missing keys: {show(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {show(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {show(mismatched)}")
    raise CheckpointError(
        f"checkpoint {str(path)!r} does not fit this model ({'; '.join(problems)}); "
        "use the model config it was saved with (see its trainer_state.json)"
    )


@dataclass
class PendingSave:
    step: int
    tmp: Path
    future: Future
    started: float
    trainer_state: dict[str, Any]


class Checkpointer:
    def __init__(self, cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.ckpt = cfg.checkpoint
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.rank = rank
        self.world_size = world_size
        self.root = Path(cfg.run.dir) / "checkpoints"
        self.pending: PendingSave | None = None
        # Checkpoint collectives get their own gloo group: an async save's thread can then never
        # interleave with a training collective on the default group (a known deadlock).
        self.group = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=cfg.dist.timeout_s)
        )

    # ---- finding what to resume ----------------------------------------------------------

    def resume_path(self) -> Path | None:
        """The checkpoint ``checkpoint.resume`` selects, or None to start fresh."""
        choice = self.ckpt.resume
        if choice == "none":
            found = layout.scan(self.root)
            if found.complete:
                raise CheckpointError(
                    f"{self.root} already holds checkpoints ({found.complete[-1][1].name} is the newest) "
                    "and checkpoint.resume=none would overwrite them; resume (checkpoint.resume=auto) or "
                    "choose a new run.dir"
                )
            return None
        if choice != "auto":
            return Path(choice)
        found = layout.scan(self.root)
        for path, why in found.skipped:
            self.info(f"resume: skipping {path}: {why}")
        if not found.complete:
            return None
        step, path = found.complete[-1]
        self.info(f"resume: newest complete checkpoint is {path} (step {step})")
        return path

    # ---- saving --------------------------------------------------------------------------

    def training_state(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def save(self, step: int, counters: dict[str, Any], plan_info: dict[str, Any],
             blocking: bool = False) -> float:
        """Start (async) or do (sync) a save; returns the seconds training was blocked."""
        start = time.perf_counter()
        self.wait()  # one save in flight at a time
        final, tmp = layout.step_dir(self.root, step), layout.tmp_dir(self.root, step)
        # Every rank decides from the same files, so all raise together instead of some waiting.
        if final.exists() and layout.is_complete(final):
            raise CheckpointError(f"{final} already exists; refusing to overwrite a checkpoint")
        if self.rank == 0:
            if final.exists():  # damaged (resume skipped it): keep it aside for inspection
                aside = final.with_name(f"{final.name}.damaged-{int(time.time())}")
                final.rename(aside)
                self.info(f"checkpoint: moved damaged {final.name} to {aside.name}")
            if tmp.exists():  # left by a crashed save of this step
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        dist.barrier(group=self.group)
        torch.save(rng_state(), tmp / f"rng-rank{self.rank}.pt")
        faults.inject("save", self.rank, step)
        if self.ckpt.save_full:
            self.save_full_weights(tmp / "model.safetensors")
        state = self.training_state()
        trainer_state = self.describe(step, counters, plan_info)
        if self.ckpt.async_save and not blocking:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
            self.pending = PendingSave(step, tmp, future, time.perf_counter(), trainer_state)
            blocked = time.perf_counter() - start
            self.info(f"checkpoint step {step}: async save started, training blocked {blocked:.3f}s")
            return blocked
        dcp.save(state, checkpoint_id=str(tmp), process_group=self.group)
        self.finalize(step, tmp, trainer_state)
        blocked = time.perf_counter() - start
        self.info(f"checkpoint step {step}: saved to {final} in {blocked:.3f}s")
        return blocked

    def save_full_weights(self, path: Path) -> None:
        from safetensors.torch import save_file

        full = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank == 0:
            save_file({k: v.contiguous() for k, v in full.items()}, str(path))

    def describe(self, step: int, counters: dict[str, Any], plan_info: dict[str, Any]) -> dict:
        from shardtrain import __version__

        return {
            "format": layout.FORMAT,
            "step": step,
            **counters,
            "world_size": self.world_size,
            **plan_info,
            "config": OmegaConf.to_container(OmegaConf.structured(self.cfg)),
            "config_hash": config_hash(self.cfg),
            "versions": {"shardtrain": __version__, "torch": torch.__version__,
                         "python": platform.python_version()},
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def finalize(self, step: int, tmp: Path, trainer_state: dict) -> None:
        """Rank 0: make the checkpoint visible under its final name, then prune old ones."""
        if self.rank != 0:
            return
        if not (tmp / layout.METADATA_FILE).is_file():
            raise CheckpointError(f"save of step {step} produced no DCP metadata in {tmp}")
        layout.write_json_durably(tmp / layout.STATE_FILE, trainer_state)
        final = layout.step_dir(self.root, step)
        tmp.rename(final)
        layout.fsync_dir(self.root)
        self.prune()

    def prune(self) -> None:
        complete = layout.scan(self.root).complete
        for _, path in complete[: max(0, len(complete) - self.ckpt.keep_last)]:
            # Rename first: a crash while deleting must not leave a half directory named step-N.
            doomed = path.with_name(f".{path.name}.deleting")
            path.rename(doomed)
            shutil.rmtree(doomed)
            self.info(f"checkpoint: deleted {path.name} (checkpoint.keep_last={self.ckpt.keep_last})")

    def poll(self) -> None:
        """Non-blocking: rank 0 finalizes a finished async save."""
        if self.pending is not None and self.pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is written, then finalize it."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        pending.future.result()
        self.finalize(pending.step, pending.tmp, pending.trainer_state)
        self.info(f"checkpoint step {pending.step}: async save complete after "
                  f"{time.perf_counter() - pending.started:.3f}s")

    # ---- loading -------------------------------------------------------------------------

    def load(self, path: Path) -> dict[str, Any]:
        """Restore model, optimizer, scheduler and RNG from ``path``; return its trainer state."""
        metadata = layout.verify(path)
        trainer_state = layout.read_trainer_state(path)
        state = self.training_state()
        check_model_compatible(path, metadata, state["model"])
        if not any(k.startswith("optim.") for k in metadata.state_dict_metadata):
            raise CheckpointError(f"checkpoint {str(path)!r} has no optimizer state; use it as "
                                  "model.init_from to start a new run from its weights")
        try:
            dcp.load(state, checkpoint_id=str(path), process_group=self.group)
        except Exception as exc:
            raise CheckpointError(f"loading {str(path)!r} failed: {str(exc).splitlines()[0]}") from exc
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(trainer_state["scheduler"])
        rng_file = path / f"rng-rank{self.rank}.pt"
        if trainer_state["world_size"] == self.world_size and rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            self.info("resume: world size changed; RNG states are not restored (the data order is "
                      "global and does not depend on them)")
        return trainer_state

    def info(self, message: str) -> None:
        if self.rank == 0:
            log.info(message)


def load_model_weights(model: nn.Module, source: str, model_cfg=None) -> None:
    """``model.init_from``: weights only, from a checkpoint directory, a .safetensors file, or
    ``hf:<dir>`` (a local Hugging Face Llama directory; never downloaded)."""
    if source.startswith("hf:"):
        from shardtrain.export.hf import load_hf_into

        load_hf_into(model, model_cfg, source[3:])
        return
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".safetensors":
        load_safetensors_into(model, path)
        return
    metadata = layout.verify(path, need_state=False)
    state = get_model_state_dict(model)
    check_model_compatible(path, metadata, state)
    dcp.load({"model": state}, checkpoint_id=str(path))
    set_model_state_dict(model, state)


def load_safetensors_into(model: nn.Module, path: Path) -> None:
    from safetensors import safe_open

    from shardtrain.distributed.parallelize import shard_like

    params = dict(model.named_parameters())
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        missing, unexpected = sorted(set(params) - keys), sorted(keys - set(params))
        if missing or unexpected:
            raise CheckpointError(f"{path}: missing keys {missing[:6]}, unexpected keys {unexpected[:6]}")
        with torch.no_grad():
            for name, param in params.items():
                full = f.get_tensor(name)  # one full tensor at a time
                if tuple(full.shape) != tuple(param.shape):
                    raise CheckpointError(f"{path}: {name} has shape {list(full.shape)}, "
                                          f"the model wants {list(param.shape)}")
                param.copy_(shard_like(full.to(param.dtype), param))

