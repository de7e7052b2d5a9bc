"""The accelerator module's choices, and the closest CPU test of the CPU-offload gather on NCCL."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest
import torch
from accelerator_workers import offload_on_device_mapped_group
from distributed import run_on_ranks
from equivalence import max_errors, reference_run
from safetensors.torch import load_file

from shardtrain.accelerator import peak_flops_of, process_group_backend
from shardtrain.config.schema import Config
from shardtrain.distributed.env import (
    NR_OPEN_DEFAULT,
    files_needed,
    gloo_beside_accelerator,
    gloo_connects_lazily,
)


@pytest.mark.parametrize(
    ("device", "requested", "offload", "expected"),
    [
        ("cpu", "auto", False, "gloo"),
        ("cpu", "auto", True, "gloo"),
        ("cuda", "auto", False, "nccl"),
        # Offloaded shards live on the CPU: gathering them needs a CPU backend beside NCCL.
        ("cuda", "auto", True, "cpu:gloo,cuda:nccl"),
        ("cuda", "nccl", True, "cpu:gloo,cuda:nccl"),
        ("cuda", "gloo", True, "gloo"),
    ],
)
def test_process_group_backend(device, requested, offload, expected):
    assert process_group_backend(torch.device(device, 0 if device != "cpu" else None), requested,
                                 offload) == expected


def test_gloo_beside_an_accelerator_connects_lazily(monkeypatch):
    """CPU offload's gloo side carries rare CPU tensors: its groups connect pairs on first use (found
    by a large-scale review: eagerly, every pair at start-up, a socket per peer past the usual
    open-files limit at 1,024 ranks). A CPU run's gloo trains: connected at creation."""
    monkeypatch.delenv("TORCH_GLOO_LAZY_INIT", raising=False)
    assert gloo_beside_accelerator(process_group_backend(torch.device("cuda", 0), "auto", True))
    assert not any(gloo_beside_accelerator(process_group_backend(device, "auto", offload))
                   for device in (torch.device("cpu"), torch.device("cuda", 0)) for offload in (False, True)
                   if not (device.type == "cuda" and offload))
    with gloo_connects_lazily():
        assert os.environ["TORCH_GLOO_LAZY_INIT"] == "1"
    with gloo_connects_lazily(False):
        assert "TORCH_GLOO_LAZY_INIT" not in os.environ
    assert "TORCH_GLOO_LAZY_INIT" not in os.environ  # only the groups made inside


def test_the_default_group_and_the_mesh_connect_gloo_lazily_beside_an_accelerator(monkeypatch):
    """The wiring of the switch: set while the default group and the mesh's groups are made, for a
    backend of gloo beside an accelerator's (on this CPU machine the group is then made as gloo
    alone: the switch is what is checked, recorded at each call)."""
    import torch.distributed as dist

    from shardtrain.config.plan import resolve_plan
    from shardtrain.config.schema import StrategyConfig
    from shardtrain.distributed import env as env_module

    monkeypatch.delenv("TORCH_GLOO_LAZY_INIT", raising=False)
    seen = []
    make_group, make_mesh = dist.init_process_group, env_module.init_device_mesh

    def recording_group(backend, **kwargs):
        seen.append(("group", backend, os.environ.get("TORCH_GLOO_LAZY_INIT")))
        make_group(backend="gloo", **kwargs)

    def recording_mesh(*args, **kwargs):
        seen.append(("mesh", dist.get_backend(), os.environ.get("TORCH_GLOO_LAZY_INIT")))
        return make_mesh(*args, **kwargs)

    for backend, lazily in (("cpu:gloo,cuda:nccl", "1"), ("gloo", None)):
        monkeypatch.setattr(env_module, "process_group_backend",
                            lambda device, requested, offload, backend=backend: backend)
        monkeypatch.setattr(env_module.dist, "init_process_group", recording_group)
        monkeypatch.setattr(env_module.dist, "get_backend", lambda group=None, backend=backend: backend)
        monkeypatch.setattr(env_module, "init_device_mesh", recording_mesh)
        try:
            env_module.init_distributed()
            env_module.build_mesh(resolve_plan(StrategyConfig(), 1, 1), "cpu")
        finally:
            monkeypatch.undo()
            env_module.destroy_distributed()
        assert seen[-2:] == [("group", backend, lazily), ("mesh", backend, lazily)], seen
    assert "TORCH_GLOO_LAZY_INIT" not in os.environ


def test_cpu_offload_gathers_through_a_device_mapped_group(tmp_path):
    run_on_ranks(offload_on_device_mapped_group, 2, str(tmp_path), tmp_path=tmp_path)
    result = torch.load(tmp_path / "offload.pt")
    # What went through the CPU group is the training's own: the one-process reference's numbers.
    errors = max_errors(result, reference_run())
    assert all(error <= 1e-5 for error in errors.values()), errors
    assert len(result["sample"]) > len(Config().trainer.sample_prompt)
    full = load_file(str(next((tmp_path / "run" / "checkpoints").glob("step-*")) / "model.safetensors"))
    assert full.keys() == result["weights"].keys()
    for name, tensor in full.items():
        assert tensor.float().equal(result["weights"][name]), name


@pytest.mark.parametrize(("name", "tflops"), [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("AMD Instinct MI300X", 1300.0), ("NVIDIA B200", 2250.0),
    # found by review: matched by substring, "H100 NVL" was an H100 SXM and "GB200" a B200
    ("NVIDIA H100 NVL", 835.0), ("NVIDIA GB200", 2500.0), ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA H800", None), ("NVIDIA A1000", None), ("Intel(R) Data Center GPU Max 1550", None)])
def test_peak_flops_by_device_name(name, tflops):
    assert peak_flops_of(name) == (None if tflops is None else tflops * 1e12)


def test_the_open_file_limit_is_raised_to_the_hard_one():
    """Rank 0 holds a socket to every rank per process group: a soft limit of 1,024 (still common)
    failed it alone at 1,024 ranks (found by a scale review). In processes of their own, their soft
    limit lowered first; a hard limit too low for the world size is warned of, not refused."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = ("import resource; from shardtrain.distributed.env import raise_open_file_limit; "
            "print(raise_open_file_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[1])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    assert proc.returncode == 0, proc.stderr
    expected = NR_OPEN_DEFAULT if hard == resource.RLIM_INFINITY else hard
    assert tuple(map(int, proc.stdout.split())) == (expected, hard)
    # a hard limit below what rank 0 needs: one warning naming it, and the process group still forms
    code = ("import logging; logging.basicConfig(); from shardtrain.distributed.env import init_distributed; "
            "print(init_distributed().world_size)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200)))
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr
    assert (f"open files: rank 0 may open 200 (its hard limit) and needs about {files_needed(1)} at world "
            "size 1") in proc.stderr
