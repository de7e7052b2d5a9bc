"""The two programs ``shardtrain train`` is measured against (benchmarks/run.py --only e2e).

``handwritten``: the loop a user writes from the FSDP2 tutorial. ``lightning``: Lightning's
``ModelParallelStrategy`` (FSDP2) with ``configure_model``. Both train the default model (the same
``Llama`` class, dim 256, 4 layers) on random windows of the same standard-library corpus, run under
torchrun like ``shardtrain train`` does, and time whole iterations by wall clock (batch, forward,
backward, clipping, optimizer, logging). Rank 0 prints one JSON line: seconds per iteration.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from shardtrain.config.schema import DataConfig, ModelConfig
from shardtrain.data.corpus import load_corpus
from shardtrain.models.llama import Llama

SEQ_LEN, GLOBAL_BATCH, LR, WARMUP = 256, 16, 3e-3, 30


def precision_policy(precision: str) -> MixedPrecisionPolicy:
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard(model: Llama, mesh, precision: str) -> Llama:
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=precision_policy(precision))
    fully_shard(model, mesh=mesh, mp_policy=precision_policy(precision))
    return model


def lr_lambda(max_steps: int):
    def factor(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / (max_steps - WARMUP))))
    return factor


class Windows(torch.utils.data.Dataset):
    """Random windows of the corpus (fixed by the seed), as (input, target) pairs."""

    def __init__(self, tokens: np.ndarray, count: int, seed: int = 0, seq_len: int = SEQ_LEN) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.starts = np.random.default_rng(seed).integers(0, tokens.size - seq_len - 1, size=count)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int):
        start = self.starts[index]
        chunk = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def handwritten(steps: int, precision: str) -> list[float]:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard(Llama(ModelConfig()), init_device_mesh("cpu", (world,)), precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(steps))
    data = Windows(load_corpus(DataConfig()).train, steps * GLOBAL_BATCH)
    per_rank = GLOBAL_BATCH // world
    times = []
    for step in range(steps):
        start = time.perf_counter()
        first = step * GLOBAL_BATCH + rank * per_rank
        x, y = (torch.stack(t) for t in zip(*(data[i] for i in range(first, first + per_rank))))
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 and rank == 0:
            print(f"step {step} loss {loss.item():.4f} norm {norm.full_tensor().item():.3f}", file=sys.stderr)
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return times


def lightning(steps: int, precision: str) -> list[float]:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    world = int(os.environ["WORLD_SIZE"])

    class LitLlama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Llama(ModelConfig())

        def configure_model(self) -> None:
            shard(self.model, self.device_mesh["data_parallel"], precision)

        def training_step(self, batch, _):
            x, y = batch
            loss = F.cross_entropy(self.model(x).float().flatten(0, 1), y.flatten())
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(steps))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            self.starts.append(time.perf_counter())

    timer = Timer()
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=steps, precision="32-true",
                        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                        gradient_clip_val=1.0, callbacks=[timer], enable_checkpointing=False,
                        log_every_n_steps=10, default_root_dir=os.environ.get("BENCH_DIR", "."))
    data = Windows(load_corpus(DataConfig()).train, steps * GLOBAL_BATCH)
    loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // world)
    trainer.fit(LitLlama(), loader)
    return [b - a for a, b in zip(timer.starts, timer.starts[1:])]


def main() -> None:
    program, steps, precision = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    times = {"handwritten": handwritten, "lightning": lightning}[program](steps, precision)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps({"program": program, "seconds": times}))


if __name__ == "__main__":
    main()
