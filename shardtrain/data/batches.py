"""Fixed-length token windows in one global order, cut into per-rank micro-batches.

The position in the data is a single global number (samples consumed), and every step takes the
next ``global_batch`` samples of the global order. How those samples are split over ranks and
micro-batches is decided here, by construction identical in count on every rank, so no rank can run
out of batches before the others (the classic hang), and a run can later resume at another world
size without repeating or skipping a sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardtrain.errors import DataError

IGNORE_INDEX = -100


class TokenWindows:
    """Non-overlapping windows of ``seq_len + 1`` tokens; sample i starts at ``i * seq_len``."""

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str = "data") -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise DataError(
                f"{name} has {len(tokens)} tokens, fewer than one window of trainer.seq_len+1="
                f"{seq_len + 1}; use more data or a shorter trainer.seq_len"
            )

    def batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets for sample ``ids``; an id of -1 is padding (targets ignored)."""
        x = np.zeros((len(ids), self.seq_len), dtype=np.int64)
        y = np.full((len(ids), self.seq_len), IGNORE_INDEX, dtype=np.int64)
        for row, i in enumerate(ids):
            if i < 0:
                continue
            window = self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1]
            x[row] = window[:-1]
            y[row] = window[1:]
        return torch.from_numpy(x), torch.from_numpy(y)


class GlobalOrder:
    """An endless sequence of sample ids: one seeded permutation per epoch."""

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = rng.permutation(self.num_samples)
            self._epoch = epoch
        return self._perm

    def take(self, start: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        for k in range(count):
            epoch, offset = divmod(start + k, self.num_samples)
            out[k] = self._permutation(epoch)[offset]
        return out


@dataclass(frozen=True)
class BatchLayout:
    micro_batch_size: int
    grad_accum_steps: int
    dp_world_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.dp_world_size

    def rank_slices(self, ids: np.ndarray, rank: int) -> list[np.ndarray]:
        """The micro-batches of one rank: micro-step k holds ranks' slices side by side."""
        per_micro = self.micro_batch_size * self.dp_world_size
        start = rank * self.micro_batch_size
        return [
            ids[k * per_micro + start : k * per_micro + start + self.micro_batch_size]
            for k in range(self.grad_accum_steps)
        ]


class TrainBatches:
    """Hands each rank its micro-batches for the next step and tracks the global position."""

    def __init__(self, windows: TokenWindows, layout: BatchLayout, rank: int, seed: int) -> None:
        self.windows = windows
        self.layout = layout
        self.rank = rank
        self.order = GlobalOrder(windows.num_samples, seed)
        self.consumed_samples = 0

    def step_ids(self) -> np.ndarray:
        """The global sample ids of the next step (a function of the seed and the position only)."""
        return self.order.take(self.consumed_samples, self.layout.global_batch)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ids = self.step_ids()
        self.consumed_samples += self.layout.global_batch
        return [self.windows.batch(s) for s in self.layout.rank_slices(ids, self.rank)]


def eval_batches(windows: TokenWindows, num_samples: int, micro_batch_size: int,
                 dp_world_size: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``num_samples`` validation windows, padded so every rank gets as many batches.

    Padding rows have only ignored targets, so the validation loss is the same at any world size.
    """
    n = min(num_samples, windows.num_samples)
    per_round = micro_batch_size * dp_world_size
    rounds = -(-n // per_round)
    ids = np.full(rounds * per_round, -1, dtype=np.int64)
    ids[:n] = np.arange(n)
    return [
        windows.batch(ids[r * per_round + rank * micro_batch_size:][:micro_batch_size])
        for r in range(rounds)
    ]
