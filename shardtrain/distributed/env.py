"""Process-group set-up: rank discovery, device and backend choice, device meshes, and teardown.

The device comes from ``shardtrain.accelerator`` (the one home of accelerator-specific branches);
everything after set-up asks the mesh or this ``DistEnv``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import resource
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, _redistribute

from shardtrain.accelerator import claim_device, device_identity, process_group_backend
from shardtrain.config.plan import ShardingPlan
from shardtrain.config.schema import DistConfig
from shardtrain.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where one rank runs: its host, its accelerator's identity (None on a CPU) and the cores it
    may use. Gathered from every rank once, at start-up, for the checks that need the neighbours."""

    host: str
    device: str | None
    cores: tuple[int, ...]


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    placements: tuple[Placement, ...] = ()  # every rank's, by rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@contextlib.contextmanager
def gloo_connects_lazily(lazily: bool = True) -> Iterator[None]:
    """Gloo groups made inside connect each pair of ranks on first use, not all at creation.

    A gloo group normally connects every pair of ranks when it is made: at 1,024 ranks, half a
    million TCP connections through the rendezvous store at start-up, and a socket per peer on
    every rank for the whole run (past a common open-files limit of 1,024). torch reads the switch
    from the environment when a group is made, so it is set for the groups made inside only; a
    connection that then stalls is bounded by the watchdog, whatever gloo's own timeout does.
    """
    if not lazily:
        yield
        return
    previous = os.environ.get("TORCH_GLOO_LAZY_INIT")
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TORCH_GLOO_LAZY_INIT"]
        else:
            os.environ["TORCH_GLOO_LAZY_INIT"] = previous


def gloo_beside_accelerator(backend: str) -> bool:
    """Whether ``backend`` is gloo beside an accelerator's (``cpu:gloo,cuda:nccl``, CPU offload):
    its gloo side carries only the rare CPU tensors (a sample's or a full save's gathers, object
    collectives), a few pairs of ranks, so it connects lazily. A CPU run's gloo is its training
    backend, every collective's: connected at creation, as tested."""
    return "gloo" in backend and "," in backend


def lazily_connected_gloo_group(timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A gloo group over every rank whose pairs connect on first use (the checkpoint group's
    collectives, gathers to rank 0, DCP's plan exchange, the verdicts' all-gather, use few)."""
    with gloo_connects_lazily():
        return dist.new_group(backend="gloo", timeout=timeout)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ
    )


# The variables that say how many copies of a command a launcher other than torchrun started.
COPIES_STARTED_BY = (("SLURM_STEP_NUM_TASKS", "srun"), ("OMPI_COMM_WORLD_SIZE", "mpirun"))


def check_not_one_of_many(starts_torchrun: bool = False) -> None:
    """Training outside torchrun, in a process that is one of several copies of the command (``srun
    -n 8 shardtrain train``, mpirun, a launcher that set WORLD_SIZE but not torchrun's other
    variables): every copy would train a world of its own into the same run.dir. Refused, naming
    the launcher and the way to start it. ``starts_torchrun``: this process starts torchrun's agent
    itself (``trainer.devices=N``), which gives its workers their own WORLD_SIZE."""
    if under_torchrun():
        return
    found = [(name, launcher, int(os.environ[name])) for name, launcher in COPIES_STARTED_BY
             if os.environ.get(name, "").isdigit() and int(os.environ[name]) > 1]
    world = os.environ.get("WORLD_SIZE", "")
    # A WORLD_SIZE alone, left in the environment, is torchrun's to replace for the workers the
    # built-in launcher starts; with a RANK beside it a launcher made this process one of several
    # (a Kubeflow PyTorchJob's pods set both, and each pod trained a world of its own).
    if world.isdigit() and int(world) > 1 and (not starts_torchrun or "RANK" in os.environ):
        missing = " and ".join(name for name in ("RANK", "LOCAL_RANK") if name not in os.environ)
        found.append(("WORLD_SIZE", f"a launcher that set WORLD_SIZE but not {missing}", int(world)))
    if not found:
        return
    name, launcher, copies = found[0]
    alone = ("start a torchrun world of its own (trainer.devices)" if starts_torchrun
             else "train alone as a world of one")
    raise ConfigError(
        f"{name}={copies}: this process is one of {copies} copies started by {launcher}, not by torchrun, "
        f"and each would {alone}, all into the same run.dir; start one torchrun agent per node (srun "
        "--ntasks-per-node=1 torchrun --nproc-per-node N -m shardtrain train ...: "
        "examples/slurm/train.sbatch), or give every process RANK, LOCAL_RANK, WORLD_SIZE, "
        "LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT")


def check_restarts_resume(checkpoints: bool) -> None:
    """Under torchrun with ``--max-restarts``, a run without checkpoints would train from step 0
    again after each failure, reporting success at the end (train.sbatch restarts three times)."""
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if under_torchrun() and restarts.isdigit() and int(restarts) > 0 and not checkpoints:
        raise ConfigError(f"torchrun --max-restarts={restarts} restarts from the newest checkpoint, and "
                          "checkpoint.enabled=false saves none (each restart would train from step 0 "
                          "again); enable checkpoints, or start torchrun with --max-restarts=0")


def check_manual_launch_shape(nodes: int) -> None:
    """Processes given RANK, LOCAL_RANK and WORLD_SIZE by hand (not by torchrun) on several nodes
    without LOCAL_WORLD_SIZE: how many run on a node is then unknown (it was taken as all of them,
    and every such multi-node start refused as a shape mismatch)."""
    if (nodes > 1 and under_torchrun() and "TORCHELASTIC_RUN_ID" not in os.environ
            and "LOCAL_WORLD_SIZE" not in os.environ):
        raise ConfigError(f"trainer.num_nodes={nodes} with processes started without torchrun: give "
                          "every process LOCAL_WORLD_SIZE (the number of processes on its node) beside "
                          "RANK, LOCAL_RANK and WORLD_SIZE, or start them with torchrun")


# Linux's default ceiling on a process's open files (fs.nr_open), where the hard limit is unlimited.
NR_OPEN_DEFAULT = 1 << 20


def raise_open_file_limit() -> int:
    """The soft limit on open files raised to the hard one, as far as the system lets it; returns
    the soft limit in effect. Rank 0 holds a socket to every other rank for the rendezvous store and
    for each gloo group's gathers: 1,024 ranks need over 2,000, past the soft limit of 1,024 many
    systems still set, which failed rank 0 alone (EMFILE) at its first save."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = NR_OPEN_DEFAULT if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):  # a ceiling below the hard limit: keep the soft one
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def files_needed(world_size: int) -> int:
    """About the open files rank 0 needs: a socket to every rank for the store, the default group
    and the checkpoint group, plus the run's own files."""
    return 3 * world_size + 256


def init_distributed(backend: str = "auto", timeout_s: int = 300, cpu_offload: bool = False) -> DistEnv:
    """Join (or create, for a lone process) the default process group.

    Under torchrun the rendezvous comes from the environment. A lone process gets a world of one on
    an in-memory store, so single-process runs take exactly the same FSDP2 code path.
    """
    open_files = raise_open_file_limit()  # before the store's connections arrive
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = claim_device(local_rank)
    backend = process_group_backend(device, backend, cpu_offload)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        with gloo_connects_lazily(gloo_beside_accelerator(backend)):
            if under_torchrun():
                join_process_group(backend, timeout)
            else:
                dist.init_process_group(
                    backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
                )
    mine = Placement(socket.gethostname(), device_identity(device), tuple(sorted(os.sched_getaffinity(0))))
    placements: list[Any] = [mine]
    if dist.get_world_size() > 1:  # one all-gather for every start-up check of the neighbours
        placements = [None] * dist.get_world_size()
        dist.all_gather_object(placements, mine)
    env = DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
        device=device,
        backend=backend,
        placements=tuple(placements),
    )
    check_distinct_devices(env)
    if env.rank == 0 and open_files != resource.RLIM_INFINITY and open_files < files_needed(env.world_size):
        log.warning(f"open files: rank 0 may open {open_files} (its hard limit) and needs about "
                    f"{files_needed(env.world_size)} at world size {env.world_size} (a socket to every rank "
                    "for each process group); raise the hard limit (`ulimit -Hn`, limits.conf, or Slurm's "
                    "PropagateResourceLimits) before launching")
    return env


def join_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """The default process group from torchrun's (or a hand-set) environment; a rendezvous that
    cannot be reached, or an environment that names none, is one line naming the address."""
    where = ":".join(os.environ.get(name, f"({name} unset)") for name in ("MASTER_ADDR", "MASTER_PORT"))
    try:
        dist.init_process_group(backend=backend, timeout=timeout, **restart_safe_store(timeout))
    except (ValueError, KeyError, dist.DistError) as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"rank {os.environ.get('RANK', '?')} cannot join the process group at {where} "
                          f"({why}); check that MASTER_ADDR and MASTER_PORT name rank 0's host and a free "
                          "port every node can reach, and that rank 0 is running") from exc


def check_distinct_devices(env: DistEnv) -> None:
    """Two processes on one accelerator (more processes than visible devices, each seeing one) run
    out of memory or fail in the collective library much later: one line now, on every rank."""
    first: dict = {}
    for rank, place in enumerate(env.placements):
        host, device = place.host, place.device
        if device is not None and (host, device) in first:
            raise ConfigError(f"ranks {first[host, device]} and {rank} on host {host} use the same "
                              f"{env.device.type} device; start at most one process per device "
                              "(trainer.devices, torchrun --nproc-per-node)")
        first.setdefault((host, device), rank)


def restart_safe_store(timeout: datetime.timedelta) -> dict:
    """Store arguments for ``init_process_group`` that survive torchrun restarts.

    torchrun's workers share the rendezvous agent's TCPStore by default, and that store outlives a
    restart: a restarted attempt then reads the dead attempt's keys (gloo peer addresses) and fails
    with "connectFullMesh ... Connection refused" or hangs (pytorch/pytorch#135712, #167288). Keys of
    each attempt get their own prefix, so no attempt sees another's. Without restarts, or when the
    agent does not share its store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which the built-in launcher
    sets), torch's own env:// set-up is used unchanged.
    """
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not shared or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) == 0:
        return {}
    if int(os.environ.get("GROUP_WORLD_SIZE", 1)) > 1:
        # Restart counts are per agent and may differ between nodes; the prefixes would too.
        raise ConfigError("torchrun --max-restarts on several nodes with the shared rendezvous store "
                          "(pytorch/pytorch#135712): set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the "
                          "environment of torchrun on every node")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"shardtrain/attempt-{attempt}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


# The flight recorder's variables as this process set them: a later run in the same process (the
# library's) sets or clears them for its own settings and run.dir (they stayed the first run's, and
# its dumps went into the first run's directory), while values the user set are left as they are.
# The recorder's size is read once a process (torch 2.13's CPU recorder, gloo's, records by default,
# TORCH_FR_BUFFER_SIZE unset): what follows each run is where its dump goes.
_SWITCHED: dict[str, str] = {}


def switch_variable(name: str, value: str | None) -> None:
    """Set (or with None, remove) ``name`` unless the user set it."""
    if name in os.environ and _SWITCHED.get(name) != os.environ[name]:
        return  # the user's own
    if value is None:
        os.environ.pop(name, None)
        _SWITCHED.pop(name, None)
    else:
        os.environ[name] = _SWITCHED[name] = value


def apply_debug_switches(dist_cfg: DistConfig, run_dir: Path) -> None:
    """Pass ``dist.debug`` and ``dist.flight_recorder`` to torch (before the process group exists)."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = str(dist_cfg.debug).upper()
    on = dist_cfg.flight_recorder
    if on:
        (run_dir / "flight_recorder").mkdir(parents=True, exist_ok=True)
    # The collective flight recorder keeps the last collectives; the watchdog dumps it when it stops
    # a hung run. TORCH_FR_BUFFER_SIZE is the backend-neutral switch (gloo in 2.13), the NCCL names
    # are what NCCL's own dump-on-timeout reads.
    for name, value in (("TORCH_FR_BUFFER_SIZE", "2000"), ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
                        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                        ("TORCH_FR_DUMP_TEMP_FILE", str(run_dir / "flight_recorder" / "rank_"))):
        switch_variable(name, value if on else None)


def set_cpu_threads(env: DistEnv, threads: int) -> int:
    """Split the cores this process may use between the processes on its node, on every device:
    torchrun sets one thread a worker, and with GPUs the host still runs the offloaded optimizer
    step, the norm and clipping of offloaded gradients, and meta-device initialisation."""
    cores = os.sched_getaffinity(0)
    sharing = ranks_sharing_cores(cores, env)
    if threads <= 0:
        threads = max(1, len(cores) // sharing)
    elif threads * sharing > len(cores) and env.local_rank == 0:
        log.warning(f"trainer.threads_per_process={threads} x {sharing} process(es) on this node's "
                    f"{len(cores)} core(s): the threads take turns on the cores, which is slower than "
                    "one thread a core; 0 divides the cores between the processes")
    torch.set_num_threads(threads)
    return threads


def ranks_sharing_cores(cores: set[int], env: DistEnv) -> int:
    """How many processes of this node (this one included) may run on any of ``cores``: all of them
    when they share the machine, one when a scheduler bound each to its own cores (Slurm's
    ``--cpus-per-task``), which must then not be divided again. No collective: start-up gathered
    every rank's placement."""
    if not env.placements:  # an environment made by hand, not by init_distributed
        return 1
    host = env.placements[env.rank].host
    return sum(1 for place in env.placements if place.host == host and cores & set(place.cores))


def check_shared_run_dir(run_dir: Path, env: DistEnv) -> None:
    """Every rank must see the directory rank 0 writes checkpoints into: on node-local disks only
    rank 0's node would have a save's files, and each node would choose its own resume point.

    Rank 0 writes a file of a name never used before (no cache can answer for it) and every rank
    looks for it in its own ``run_dir``; one all-gather makes every rank raise the same one line.
    """
    if env.world_size == 1:
        return
    marker: list = [f".shardtrain-shared-{secrets.token_hex(8)}" if env.is_main else None, None]
    if env.is_main:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / marker[0]).write_text("rank 0 wrote this to check that every rank sees run.dir\n")
        except OSError as exc:  # every rank raises it, rather than wait for rank 0 in the broadcast
            marker[1] = f"run.dir={str(run_dir)!r} is not writable on rank 0 ({exc.strerror or exc}); " \
                        "choose a directory this user can write"
    dist.broadcast_object_list(marker, src=0)
    if marker[1] is not None:
        raise ConfigError(marker[1])
    seen = (run_dir / marker[0]).is_file()
    views: list = [None] * env.world_size
    dist.all_gather_object(views, (seen, socket.gethostname(), str(run_dir.absolute())))
    if env.is_main:
        (run_dir / marker[0]).unlink()
    blind = [rank for rank, (seen, _, _) in enumerate(views) if not seen]
    if blind:
        _, host, path = views[blind[0]]
        raise ConfigError(
            f"run.dir is not shared: rank {blind[0]} (host {host}) does not see the files rank 0 "
            f"writes in {views[0][2]} (host {views[0][1]}; rank {blind[0]} looks in {path}, "
            f"{len(blind)} rank(s) in all); set run.dir to one directory on a filesystem every node "
            "mounts, the same for every rank"
        )


_MESHES: dict[tuple, DeviceMesh] = {}


def build_mesh(plan: ShardingPlan, device_type: str) -> DeviceMesh:
    """The device mesh for ``plan``; one per shape and process group, since each costs new groups."""
    key = (device_type, plan.mesh_shape, plan.mesh_dim_names, id(dist.group.WORLD))
    if key not in _MESHES:
        # The mesh's groups take the default group's backend: gloo beside an accelerator's connects
        # lazily there too.
        with gloo_connects_lazily(gloo_beside_accelerator(dist.get_backend())):
            _MESHES[key] = init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
    return _MESHES[key]


def destroy_distributed() -> None:
    """Shut every process group down (call on every rank, once training or inference is over)."""
    _MESHES.clear()
    release_dtensor_caches()
    if dist.is_initialized():
        dist.destroy_process_group()


def release_dtensor_caches() -> None:
    """Empty DTensor's caches of sharding propagations and redistribution plans. They keep the
    specs of every operation and redistribution they saw, and through them the device meshes and
    their process groups: gloo's threads then outlived ``destroy_process_group``, were torn down
    during interpreter exit, and now and then aborted a finished command there ("terminate called
    without an active exception", exit -6). Emptied first, the groups go when they are destroyed."""
    # Private caches, each from some torch release on (the names of torch.distributed.tensor.debug's
    # helpers for them changed between releases): cleared where this torch has them.
    clearers = (DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear,
                getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
                getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
                getattr(_redistribute, "clear_redistribute_planner_cache", None))
    for clear in clearers:
        if clear is not None:
            clear()
