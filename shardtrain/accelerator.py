"""Every accelerator-specific branch of shardtrain, in one place.

Everything else is device-agnostic: it takes the device from the mesh (or from ``DistEnv``) and asks
this module for what differs between a CPU and an accelerator: which device a process uses, the
default backend, the accelerator's RNG state, allocator peaks and peak FLOP/s. ``torch.accelerator``
answers for CUDA, ROCm, XPU and others alike. None of the accelerator branches here has run on a GPU
in this project's CI (its machines have none); the CPU path is the tested one.
"""

from __future__ import annotations

import logging
import os
import re
import resource
import sys

import torch
import torch.distributed as dist

from shardtrain.errors import ConfigError

log = logging.getLogger("shardtrain")

# Dense bf16 peak TFLOP/s per device (vendor data sheets, as collected by torchtitan). Anything not
# listed reports MFU as unknown rather than guessing (torchtitan once reported 7x MFU by guessing).
PEAK_BF16_TFLOPS = {
    "A100": 312.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "H200 NVL": 835.0,
    "H200": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "GB200": 2500.0,
    "MI300X": 1300.0,
}


# What torch's CPU allocator raises where the operating system refuses an allocation (one larger than
# memory and swap allow): a RuntimeError, not torch.OutOfMemoryError (torch 2.13's alloc_cpu.cpp).
CPU_ALLOCATION_REFUSED = "DefaultCPUAllocator: can't allocate memory"


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says a device ran out of memory: an accelerator's OutOfMemoryError, or the CPU
    allocator's refusal (which would otherwise read as any other RuntimeError: a checkpoint that "does
    not fit this model", a traceback)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and CPU_ALLOCATION_REFUSED in str(exc))


def device_type() -> str:
    """'cuda' (or another accelerator's type) when one is present, else 'cpu'."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None else "cpu"


def accelerator_count() -> int:
    return torch.accelerator.device_count() if torch.accelerator.is_available() else 0


def claim_device(local_rank: int) -> torch.device:
    """This process's device: accelerator ``local_rank`` (made current), or the CPU.

    A scheduler that binds one device to each task (Slurm's ``--gpus-per-task=1``, a per-task
    ``CUDA_VISIBLE_DEVICES``) leaves each process one visible device, number 0, whatever its local
    rank: that one is used (``distributed.env.check_distinct_devices`` then makes sure no two
    processes of a node got the same one). Any other shortfall is a launch error.
    """
    kind = device_type()
    if kind == "cpu":
        return torch.device("cpu")
    visible = accelerator_count()
    if local_rank >= visible and visible != 1:
        raise ConfigError(f"local rank {local_rank} has no {kind} device of its own ({visible} visible); "
                          "start one process per device, or give each process its own device")
    device = torch.device(kind, local_rank if local_rank < visible else 0)
    torch.get_device_module(kind).set_device(device)
    return device


def device_identity(device: torch.device) -> str | None:
    """A name unique to the physical device (CUDA: its UUID), to find two processes on one device;
    None on a CPU or where the accelerator does not say."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    return None


def default_precision() -> str:
    """The mixed-precision preset ``strategy.mixed_precision=auto`` means on this machine: bf16
    compute (fp32 weights and reductions) on an accelerator with bf16 units, where fp32 matmuls
    run at a few percent of its peak; fp32 on a CPU, which has no such units (bf16 is emulated)."""
    kind = device_type()
    if kind == "cpu":
        return "fp32"
    if kind == "cuda" and not torch.cuda.is_bf16_supported():
        return "fp32"
    return "bf16-mixed"


# Float8 matmuls (e4m3/e5m2 tensor cores): NVIDIA Ada (8.9) and Hopper (9.0) on.
FLOAT8_COMPUTE_CAPABILITY = (8, 9)


def check_float8(device: torch.device | None = None) -> None:
    """``strategy.float8=true`` needs float8 tensor cores: refused with one line anywhere else
    (``device``: this process's; None: this machine's first accelerator, or the CPU)."""
    kind = device.type if device is not None else device_type()
    if kind == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= FLOAT8_COMPUTE_CAPABILITY:
            return
        where = f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]})"
    else:
        where = "a CPU" if kind == "cpu" else f"a {kind} device"
    raise ConfigError(f"strategy.float8=true needs a GPU with float8 matmuls (CUDA compute capability "
                      f"8.9 or more: H100, H200, L4, B200), and this run has {where}; drop strategy.float8")


def set_fp32_matmul(device: torch.device, tf32: bool) -> None:
    """On accelerators, let fp32 matmuls and convolutions use TF32 tensor cores (``tf32``); a CPU
    keeps full fp32, whatever ``tf32`` says, so CPU results do not depend on the setting."""
    if device.type != "cpu":
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
    if device.type == "cuda":  # cuDNN's convolutions have a switch of their own (on by default)
        torch.backends.cudnn.allow_tf32 = tf32


def use_deterministic_kernels() -> None:
    """Deterministic kernels for the rest of the process (``trainer.deterministic``). cuBLAS reads
    its workspace setting when it creates a handle, at the first matmul: set before the model is
    built, it applies (a value the user exported is kept)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Inductor benchmarks kernel configurations on the device (Triton reductions, padded matmuls)
    # unless told not to: compiled runs could differ from run to run. Its config reads this when
    # first imported, by the first compile; one imported already is told directly.
    os.environ.setdefault("TORCHINDUCTOR_DETERMINISTIC", "1")
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None and hasattr(inductor, "deterministic"):
        inductor.deterministic = True
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def process_group_backend(device: torch.device, requested: str = "auto", cpu_offload: bool = False) -> str:
    """The backend string for ``init_process_group``.

    gloo on CPU; the device's own collective backend (NCCL on CUDA) elsewhere. With CPU offload the
    sharded parameters live on the CPU, and gathering them (sampling, full weights, save_full) runs
    collectives on CPU tensors, which NCCL cannot do: the group then gets gloo for CPU tensors
    beside the accelerator's backend ("cpu:gloo,cuda:nccl").
    """
    if device.type == "cpu" or requested == "gloo":
        return "gloo"
    backend = dist.get_default_backend_for_device(device) if requested == "auto" else requested
    return f"cpu:gloo,{device.type}:{backend}" if cpu_offload else backend


def rng_state() -> torch.Tensor | None:
    """The current accelerator's RNG state, or None on a CPU-only machine."""
    if not torch.accelerator.is_available():
        return None
    return torch.get_device_module(device_type()).get_rng_state()


def set_rng_state(state: torch.Tensor | None) -> None:
    if state is not None and torch.accelerator.is_available():
        torch.get_device_module(device_type()).set_rng_state(state)


# The allocator's peak is reset per phase by the diagnostics; the run's peak must survive that.
_peak_before_reset: dict[torch.device, int] = {}


def _allocator(device: torch.device):
    module = torch.get_device_module(device.type) if device.type != "cpu" else None
    return module if module is not None and hasattr(module, "max_memory_allocated") else None


def phase_peak_bytes(device: torch.device) -> int | None:
    """Allocator peak since the last ``reset_phase_peak`` (None on CPU)."""
    allocator = _allocator(device)
    return allocator.max_memory_allocated(device) if allocator is not None else None


def reset_phase_peak(device: torch.device) -> None:
    allocator = _allocator(device)
    if allocator is None:
        return
    peak = allocator.max_memory_allocated(device)
    _peak_before_reset[device] = max(_peak_before_reset.get(device, 0), peak)
    allocator.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> float:
    """Accelerator: allocator peak since start (phase resets included). CPU: peak resident set."""
    allocator = _allocator(device)
    if allocator is not None:
        return max(_peak_before_reset.get(device, 0), allocator.max_memory_allocated(device)) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory this process could still allocate on ``device``: the accelerator's free memory plus
    what its caching allocator holds reserved but unused (``mem_get_info`` counts that as taken: after
    training, gigabytes of it), or on CPU the system's available memory (Linux /proc/meminfo); None
    where unknown."""
    module = torch.get_device_module(device.type) if device.type != "cpu" else None
    if module is not None and hasattr(module, "mem_get_info"):
        cached = 0
        if hasattr(module, "memory_reserved") and hasattr(module, "memory_allocated"):
            cached = max(0, module.memory_reserved(device) - module.memory_allocated(device))
        return int(module.mem_get_info(device)[0]) + int(cached)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def profiler_activities(device: torch.device) -> list[torch.profiler.ProfilerActivity]:
    """What torch's profiler records for a run on ``device``: the host's operators, and the device's
    kernels where the profiler has an activity for its type (CUDA, XPU)."""
    activity = {"cuda": torch.profiler.ProfilerActivity.CUDA,
                "xpu": torch.profiler.ProfilerActivity.XPU}.get(device.type)
    return [torch.profiler.ProfilerActivity.CPU] + ([activity] if activity is not None else [])


def record_memory_history(device: torch.device, enabled: bool) -> None:
    """Start (or stop) the CUDA caching allocator's record of every allocation with its stack."""
    if device.type != "cuda":
        raise ConfigError("diagnostics.memory_snapshot records the CUDA caching allocator's history; "
                          f"this run's device is {device.type}: set diagnostics.memory_snapshot=false")
    # Bounded: a step of a large model makes hundreds of thousands of allocations.
    torch.cuda.memory._record_memory_history(enabled="all" if enabled else None, max_entries=100_000,
                                             device=device)


def dump_memory_snapshot(path: str) -> None:
    """The CUDA allocator's recorded history, for https://pytorch.org/memory_viz."""
    torch.cuda.memory._dump_snapshot(path)


def device_peak_flops(device: torch.device) -> float | None:
    """Peak FLOP/s of one device, or None when unknown (every CPU, unlisted accelerators)."""
    if device.type == "cpu":
        return None
    return peak_flops_of(torch.get_device_module(device.type).get_device_name(device))


def peak_flops_of(device_name: str) -> float | None:
    """The listed peak of a device named ``device_name`` ("NVIDIA H100 80GB HBM3"): the longest listed
    name found in it as whole words, so that "H100 NVL" is not taken for an H100 SXM, nor "GB200" for
    a B200; None when none is."""
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name):
            return PEAK_BF16_TFLOPS[key] * 1e12
    return None


def pin_offloaded_memory(device_type_name: str) -> bool:
    """Host memory that feeds a device (offloaded parameters, batches) is pinned only when the
    device is an accelerator: pinning needs one, and a CPU run copies nothing."""
    return device_type_name != "cpu"


def device_memory_bytes(device: torch.device, local_processes: int) -> int | None:
    """What one process may use of its device's memory: on an accelerator what is free to it
    (``free_memory_bytes``) and what its tensors hold, within the total (another process on the
    device, or the leftovers of one that crashed, hold the rest: planned against the total, an auto
    micro-batch ran out of memory there); on a CPU this process's share of the host's available
    memory (``MemAvailable`` over the processes on the machine); None where unknown."""
    module = torch.get_device_module(device.type) if device.type != "cpu" else None
    if module is not None and hasattr(module, "mem_get_info"):
        total = int(module.mem_get_info(device)[1])
        usable = min(total, (free_memory_bytes(device) or 0) + (allocated_bytes(device) or 0))
        if usable < 0.9 * total:
            log.warning(f"{device}: {(total - usable) / 2**30:.1f} GiB of its {total / 2**30:.1f} GiB are "
                        "held outside this process's tensors (another process, or its own CUDA context "
                        "and libraries): planned against the rest")
        return usable
    available = free_memory_bytes(device)
    return available // max(local_processes, 1) if available is not None else None



def allocated_bytes(device: torch.device) -> int | None:
    """What the accelerator's allocator holds for tensors now (None on a CPU)."""
    allocator = _allocator(device)
    return int(allocator.memory_allocated(device)) if allocator is not None else None
