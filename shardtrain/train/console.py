"""What rank 0 shows while training: a progress bar on a terminal and one line per logged step."""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

from shardtrain.train.metrics import Throughput

log = logging.getLogger("shardtrain")


def rate(record: dict, unit: str | None = None) -> str:
    """The task's own unit per second ("1234 tok/s", "5120 elements/s": its ``count_unit``, whose
    rate comes with its count, or ``unit`` where the record has no count: the bar's), else samples per
    second."""
    if unit is None and "tokens_per_s" in record:
        unit = "tokens"
    if unit is None:
        units = [key.removesuffix("_seen") for key in record
                 if key.endswith("_seen") and key != "samples_seen"]
        unit = next((unit for unit in units if f"{unit}_per_s" in record), None)
    if unit not in (None, "samples") and f"{unit}_per_s" in record:
        return f"{record[f'{unit}_per_s']:.0f} {'tok' if unit == 'tokens' else unit}/s"
    return f"{record['samples_per_s']:.1f} samples/s"


def format_record(step: int, max_steps: int, record: dict, metrics: tuple[str, ...] = ()) -> str:
    """``step 10/300 | loss 2.1 | ... | val_loss 2.0`` from a metrics record; ``metrics``: the
    names of the task's own training values, shown after the loss."""
    parts = [f"step {step}/{max_steps}"]
    if "loss" in record:
        mfu, tflops = record.get("mfu"), record.get("model_tflops")
        parts += [f"loss {record['loss']:.4f}"]
        parts += [f"{name} {record[name]:.4g}" for name in metrics if name in record]
        parts += [f"grad_norm {record['grad_norm']:.3f}", f"lr {record['lr']:.2e}", rate(record)]
        # Unknowns are left out (FLOPs a task cannot count, MFU without the device's peak): the
        # start-up report says once why, and metrics.jsonl records them as null.
        if tflops is not None:
            parts.append(f"{tflops * 1e3:.1f} GFLOP/s")
        if mfu is not None:
            parts.append(f"MFU {100 * mfu:.1f}%")
        parts += [f"peak mem {record['peak_memory_mib']:.0f} MiB",
                  f"data wait {record['data_wait_pct']:.1f}%"]
    # Every validation value, in the evaluation's order: those of names training does not return too
    # (found by review: logged, and not shown)
    for prefix in ("val_", "ema_val_"):  # ema_: the weights' average (trainer.ema_decay)
        if f"{prefix}loss" in record:
            parts.append(f"{prefix}loss {record[f'{prefix}loss']:.4f}")
            parts += [f"{key} {record[key]:.4g}" for key in record
                      if key.startswith(prefix) and key != f"{prefix}loss"]
    return " | ".join(parts)


class Console:
    def __init__(self, enabled: bool, progress_bar: bool, max_steps: int) -> None:
        self.enabled = enabled
        self.want_bar = progress_bar
        self.max_steps = max_steps
        self.bar: tqdm | None = None

    def open(self, initial_step: int) -> None:
        """The bar appears only on rank 0 and only on a terminal (never in CI logs)."""
        if self.enabled and self.want_bar and sys.stderr.isatty():
            self.bar = tqdm(total=self.max_steps, initial=initial_step, desc="train", dynamic_ncols=True)

    def advance(self, loss: float, throughput: Throughput) -> None:
        """One step on the bar (nothing is computed without one: most steps are not logged)."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", rate=rate(throughput.report(), throughput.unit))

    def show(self, step: int, record: dict, metrics: tuple[str, ...] = ()) -> None:
        if not self.enabled:
            return
        line = format_record(step, self.max_steps, record, metrics)
        if self.bar is not None:
            self.bar.write(line)
        else:
            log.info(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
