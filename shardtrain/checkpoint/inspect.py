"""``shardtrain inspect``: what a checkpoint is, whether it is whole, and what it holds."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from shardtrain.checkpoint import layout
from shardtrain.errors import CheckpointError


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
            lines.append(f"  {name:18s} {human(size)}")
        for dtype, size in sorted(self.bytes_by_dtype.items()):
            lines.append(f"  {dtype:18s} {human(size)}")
        lines += [f"problem:    {p}" for p in self.problems] or ["problems:   none found"]
        return "\n".join(lines)


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def add_tensor(report: Report, name: str, dtype, numel: int) -> None:
    import torch

    size = numel * (dtype.itemsize if isinstance(dtype, torch.dtype) else 1)
    report.tensors += 1
    report.bytes_by_dtype[dtype_name(dtype)] = report.bytes_by_dtype.get(dtype_name(dtype), 0) + size
    group = name.split(".", 1)[0] if "." in name else "(top level)"
    report.bytes_by_group[group] = report.bytes_by_group.get(group, 0) + size


def inspect_safetensors(path: Path, report: Report) -> None:
    from safetensors import safe_open

    files = [path]
    if path.name.endswith(".index.json"):
        report.format = "safetensors shards (index)"
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{path}: not a valid safetensors index ({exc})") from exc
        files = sorted({path.parent / f for f in weight_map.values()})
        report.details["files"] = len(files)
    else:
        report.format = "safetensors file"
    import torch

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
                    dtype = getattr(torch, {"F32": "float32", "BF16": "bfloat16", "F16": "float16",
                                            "I64": "int64", "F64": "float64"}.get(sl.get_dtype(), "uint8"))
                    add_tensor(report, name, dtype, numel)
        except Exception as exc:
            report.problems.append(f"{file.name} is unreadable: {exc}")
    report.complete = not report.problems


def inspect_path(target: str | Path) -> Report:
    path = Path(target)
    report = Report(str(path))
    if not path.exists():
        raise CheckpointError(f"{str(path)!r} does not exist")
    if path.is_file():
        if path.suffix == ".safetensors" or path.name.endswith(".index.json"):
            inspect_safetensors(path, report)
            return report
        raise CheckpointError(f"{str(path)!r} is a file but neither .safetensors nor an index; "
                              "pass a checkpoint directory")
    if (path / "model.safetensors.index.json").is_file():
        inspect_safetensors(path / "model.safetensors.index.json", report)
        return report
    if not (path / layout.METADATA_FILE).exists() and (path / "model.safetensors").is_file():
        inspect_safetensors(path / "model.safetensors", report)
        return report
    from shardtrain.export.consolidate import detect_format

    fmt = detect_format(path)
    report.format = {"shardtrain": "shardtrain checkpoint (DCP)",
                     "lightning": "Lightning sharded checkpoint (DCP)", "dcp": "DCP directory"}[fmt]
    if layout.TMP_DIR.match(path.name):
        report.problems.append("this is a temporary directory of a save that did not finish")
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
            state = layout.read_trainer_state(path)
            report.details.update({
                "step": state["step"], "world size": state["world_size"],
                "strategy": state["strategy"],
                "mesh": " x ".join(f"{n}={s}" for n, s in zip(state["mesh_dim_names"], state["mesh_shape"])),
                "samples seen": state["consumed_samples"], "saved with": state["versions"],
            })
        except CheckpointError as exc:
            report.problems.append(str(exc))
    elif fmt == "lightning":
        report.details.update(lightning_meta(path, report))
    report.complete = not report.problems
    return report


def lightning_meta(path: Path, report: Report) -> dict:
    import torch

    try:
        meta = torch.load(path / "meta.pt", weights_only=True, map_location="cpu")
    except Exception as exc:
        report.problems.append(f"meta.pt is unreadable with weights_only=True ({str(exc).splitlines()[0]})")
        return {}
    details = {}
    for key in ("global_step", "epoch"):
        if key in meta:
            details[key.replace("_", " ")] = meta[key]
    return details
