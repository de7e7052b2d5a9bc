"""``shardtrain inspect``: what a checkpoint is, whether it is whole, and what it holds."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from shardtrain.checkpoint import integrity, layout
from shardtrain.checkpoint.safetensors_files import DTYPES, INDEX_FILE, SINGLE_FILE, indexed_files
from shardtrain.checkpoint.state import TrainState
from shardtrain.config.plan import dtype_name
from shardtrain.config.sizes import human_bytes
from shardtrain.errors import CheckpointError

FORMAT_NAMES = {"shardtrain": "shardtrain checkpoint (DCP)",
                "lightning": "Lightning sharded checkpoint (DCP)", "dcp": "DCP directory"}


@dataclass
class Report:
    path: str
    format: str = "unknown"
    complete: bool = False
    details: dict = field(default_factory=dict)
    tensors: int = 0
    bytes_by_dtype: dict = field(default_factory=dict)
    bytes_by_group: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def render(self) -> str:
        lines = [f"checkpoint: {self.path}", f"format:     {self.format}",
                 f"complete:   {'yes' if self.complete else 'no'}"]
        lines += [f"{k + ':':11s} {v}" for k, v in self.details.items()]
        lines.append(f"tensors:    {self.tensors}")
        for name, size in sorted(self.bytes_by_group.items()):
            lines.append(f"  {name:18s} {human_bytes(size)}")
        for dtype, size in sorted(self.bytes_by_dtype.items()):
            lines.append(f"  {dtype:18s} {human_bytes(size)}")
        lines += [f"problem:    {p}" for p in self.problems] or ["problems:   none found"]
        return "\n".join(lines)


def add_tensor(report: Report, name: str, dtype: torch.dtype, numel: int) -> None:
    size = numel * dtype.itemsize
    report.tensors += 1
    report.bytes_by_dtype[dtype_name(dtype)] = report.bytes_by_dtype.get(dtype_name(dtype), 0) + size
    group = name.split(".", 1)[0] if "." in name else "(top level)"
    report.bytes_by_group[group] = report.bytes_by_group.get(group, 0) + size


def inspect_safetensors(path: Path, report: Report) -> None:
    files = [path]
    weight_map: dict[str, str] | None = None
    if path.name.endswith(".index.json"):
        report.format = "safetensors shards (index)"
        try:
            files = indexed_files(path)
            weight_map = json.loads(path.read_bytes())["weight_map"]  # read and checked just now
        except CheckpointError as exc:  # damaged (exit 1), not absent (exit 2)
            report.problems.append(str(exc))
            report.complete = False
            return
        report.details["files"] = len(files)
    else:
        report.format = "safetensors file"
    held: dict[str, str] = {}  # each tensor's file
    for file in files:
        if not file.is_file():
            report.problems.append(f"missing shard file {file.name}")
            continue
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    numel = 1
                    for d in sl.get_shape():
                        numel *= d
                    add_tensor(report, name, DTYPES.get(sl.get_dtype(), torch.uint8), numel)
                    held[name] = file.name
        except Exception as exc:
            report.problems.append(f"{file.name} is unreadable: {exc}")
    if weight_map is not None and not report.problems:
        report.problems += index_disagreements(path.name, weight_map, held)
    report.complete = not report.problems


def index_disagreements(index: str, weight_map: dict[str, str], held: dict[str, str]) -> list[str]:
    """Where an index's weight_map and its shards disagree: transformers looks each tensor up in the
    map, so a name it maps to the wrong file, or to none, fails to load (a few named, then a count)."""
    wrong = [f"{index} maps {name} to {file}, which does not hold it"
             + (f" ({held[name]} does)" if name in held else "")
             for name, file in weight_map.items() if held.get(name) != file]
    wrong += [f"{index} does not name {name} (in {file})"
              for name, file in held.items() if name not in weight_map]
    return wrong[:5] + ([f"... and {len(wrong) - 5} more disagreements of {index} with its shards"]
                        if len(wrong) > 5 else [])


def describe_best(best: dict) -> str:
    """checkpoint/best.py's record in one line: the checkpoints keep_best keeps, the best evaluation,
    the evaluations since it, and an early stop."""
    parts = [f"by {best['monitor']} ({best['mode']})"]
    if best["ranking"]:
        parts.append("kept " + ", ".join(f"step-{step} {value:.6g}" for step, value in best["ranking"]))
    if best.get("best") is not None:
        step, value = best["best"]
        parts.append(f"best step {step} ({value:.6g}), {best.get('stale', 0)} evaluation(s) since")
    if best.get("stopped_at") is not None:
        parts.append(f"stopped early at step {best['stopped_at']}")
    return "; ".join(parts)


def inspect_path(target: str | Path) -> Report:
    path = Path(target)
    report = Report(str(path))
    if not path.exists():
        raise layout.missing(path, what="")
    if path.is_file():
        if path.suffix == ".safetensors" or path.name.endswith(".index.json"):
            inspect_safetensors(path, report)
            return report
        raise CheckpointError(f"{str(path)!r} is a file but neither .safetensors nor an index; "
                              "pass a checkpoint directory")
    if (path / INDEX_FILE).is_file():
        inspect_safetensors(path / INDEX_FILE, report)
        return report
    # Consolidated weights: not a save_full checkpoint (DCP shards beside its model.safetensors) whose
    # .metadata is gone, nor one whose save did not finish.
    if (not (path / layout.METADATA_FILE).exists() and (path / SINGLE_FILE).is_file()
            and not any(path.glob("*.distcp")) and not layout.TMP_DIR.match(path.name)):
        inspect_safetensors(path / SINGLE_FILE, report)
        return report
    if not (path / layout.METADATA_FILE).exists() and (kind := layout.directory_of_checkpoints(path)):
        # not a damaged checkpoint: the wrong level (consolidate and the rest refuse it alike)
        raise CheckpointError(f"{str(path)!r} is {kind}")
    own_files = (layout.METADATA_FILE, layout.STATE_FILE, integrity.MANIFEST_FILE)
    if not (any((path / name).exists() for name in own_files) or any(path.glob("*.distcp"))
            or any(path.glob("rng-rank*.pt")) or layout.TMP_DIR.match(path.name)):
        raise CheckpointError(f"{str(path)!r} is no checkpoint: it holds no .metadata and no *.distcp "
                              "files (pass a checkpoint directory, a .safetensors file or an index)")
    fmt = layout.detect_format(path)
    if fmt == "dcp" and (any(path.glob("rng-rank*.pt")) or (path / integrity.MANIFEST_FILE).is_file()):
        fmt = "shardtrain"  # shardtrain's own files, without the one its commit writes last
    report.format = FORMAT_NAMES[fmt]
    if reason := layout.unfinished_save(path):  # still looked inside: what it holds is the question
        report.problems.append(reason)
    if not check_checksums(path, report):
        return report
    try:
        metadata = layout.read_dcp_metadata(path)
    except CheckpointError as exc:
        report.problems.append(str(exc))
        return report
    try:
        layout.check_shard_files(path, metadata)
    except CheckpointError as exc:
        report.problems.append(str(exc))
    shards = {info.relative_path for info in (metadata.storage_data or {}).values()}
    report.details["shard files"] = len(shards)
    for name, meta in metadata.state_dict_metadata.items():
        if hasattr(meta, "size"):
            add_tensor(report, name, meta.properties.dtype, meta.size.numel())
    if fmt == "shardtrain":
        try:
            state = TrainState.read(path)
            report.details.update({
                "step": state.step, "world size": state.world_size, "strategy": state.strategy,
                "mesh": state.mesh, "samples seen": state.consumed_samples, "saved with": state.versions,
            })
            if state.best:  # trainer.monitor's judge, as this checkpoint's save knew it
                report.details["best"] = describe_best(state.best)
            if state.base_weights is not None:  # adapters only: what they need to be used
                tune = state.config.get("finetune", {})
                report.details["adapters"] = (
                    f"{tune.get('method')} rank {tune.get('rank')} alpha {tune.get('alpha')} on "
                    f"{', '.join(tune.get('targets') or []) or 'the default targets'}; base "
                    + ("drawn from the run's seed" if state.base_weights.get("source") == "random"
                       else str(state.base_weights.get("source"))))
        except CheckpointError as exc:
            report.problems.append(str(exc))
    elif fmt == "lightning":
        report.details.update(lightning_meta(path, report))
    report.complete = not report.problems
    return report


def check_checksums(path: Path, report: Report) -> bool:
    """Record the checksum verdict; False when .metadata itself is damaged (it is a pickle: not read)."""
    try:
        damaged = integrity.damaged_files(path)
    except CheckpointError as exc:  # the manifest itself is unreadable, or missing from a save that wrote one
        report.problems.append(str(exc))
        missing = not (path / integrity.MANIFEST_FILE).exists()
        report.details["checksums"] = "missing (its save wrote them)" if missing else "unreadable"
        return True
    if damaged is None:
        report.details["checksums"] = "none recorded (damage inside the files cannot be detected)"
        return True
    report.details["checksums"] = f"damaged: {', '.join(damaged)}" if damaged else "all match (sha256)"
    report.problems += [f"{why}: the file changed after the save" for why in damaged.values()]
    return layout.METADATA_FILE not in damaged


def lightning_meta(path: Path, report: Report) -> dict:
    try:
        meta = torch.load(path / layout.LIGHTNING_META_FILE, weights_only=True, map_location="cpu")
    except Exception as exc:
        report.problems.append(f"meta.pt is unreadable with weights_only=True ({str(exc).splitlines()[0]})")
        return {}
    details = {}
    for key in ("global_step", "epoch"):
        if key in meta:
            details[key.replace("_", " ")] = meta[key]
    return details
