"""Slurm played on this machine, to run sbatch scripts in tests: ``srun`` and ``scontrol`` stand-ins on
PATH, and ``FakeSlurm.submit`` doing what sbatch and slurmd do with a batch script.

What is modelled, after Slurm's own behaviour:
- Nodes are names; every node is this machine. They are called 127.0.0.1 and 127.0.0.2 (both loopback
  addresses on Linux; SLURM_JOB_NODELIST=127.0.0.[1-2], compressed as Slurm writes it), so the first
  node's name, where a script puts its rendezvous, resolves without an /etc/hosts entry, and the
  script needs no test-only switch.
- The batch script runs as slurmd runs it: a copy in a spool directory (a script cannot find files
  beside itself), started by bash in the submit directory in a session of its own, its output to the
  job's ``--output`` file (``--open-mode`` truncate or append on a requeue), with the SLURM_* variables
  of the job and of the batch step, and the submitting environment (sbatch's ``--export=ALL``).
- ``--signal=B:SIG@T`` is delivered to the batch shell alone (``BatchJob.send_signal``), at a moment the
  test chooses: the time limit itself is not modelled.
- srun starts one task per node, each in a process group of its own (proctrack/pgid: a signal to the
  step reaches the task's process group, not processes that left it), with the variables srun sets
  per task. It passes SIGUSR1, SIGUSR2, SIGALRM and SIGCONT on to the tasks and answers SIGTERM,
  SIGHUP and SIGQUIT by SIGKILLing every process of the step, as srun does (and SIGINT, which srun
  wants twice within a second). Its exit status is
  the highest of its tasks' (128 + N for a task killed by signal N); ``--kill-on-bad-exit`` ends the
  step when a task fails.
- scontrol: ``show hostnames [LIST]`` and ``requeue JOBID``; a requeue is recorded, and the test
  starts the job again (``FakeSlurm.requeue``) as Slurm would, with SLURM_RESTART_COUNT raised.

The stand-ins are small Python files in the job's bin directory that call ``STAND_INS`` here
(standard library only).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardtrain.cli.launch import descendants

NODELIST = "127.0.0.[1-2]"  # Slurm's compressed form of 127.0.0.1,127.0.0.2
STATE_ENV = "FAKE_SLURM_STATE"  # where the stand-ins record what they were asked


# ---- Slurm's host lists -------------------------------------------------------------------------


def expand_hostlist(hostlist: str) -> list[str]:
    """``node[01-03,7],gpu1`` -> node01 node02 node03 node7 gpu1 (one bracket group per name)."""
    names = []
    for entry in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", entry)
        if match is None:
            names.append(entry)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            for number in range(int(first), int(last or first) + 1):
                names.append(f"{prefix}{number:0{len(first)}d}{suffix}")
    return names


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and everything below it (sessions and process groups of their own included)."""
    for pid in [root, *descendants(root)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def record(kind: str, **fields) -> None:
    with open(Path(os.environ[STATE_ENV]) / "calls.jsonl", "a") as f:
        f.write(json.dumps({"command": kind, **fields}) + "\n")


def recorded(state: Path, kind: str) -> list[dict]:
    path = state / "calls.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [call for call in map(json.loads, lines) if call["command"] == kind]


# ---- the stand-ins ------------------------------------------------------------------------------


def scontrol(args: list[str]) -> int:
    if args[:2] == ["show", "hostnames"]:
        # A name a write, and death by SIGPIPE on a closed pipe, as a C program on a long list: a
        # reader that stops early (head -n1) fails the pipeline under pipefail.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        hostlist = args[2] if len(args) > 2 else os.environ["SLURM_JOB_NODELIST"]
        for name in expand_hostlist(hostlist):
            print(name, flush=True)
        return 0
    if len(args) == 2 and args[0] == "requeue":
        record("requeue", job_id=args[1])
        return 0
    print(f"scontrol (test stand-in): {shlex.join(args)} is not modelled", file=sys.stderr)
    return 1


SRUN_OPTIONS = {"-N": "nodes", "--nodes": "nodes", "-n": "ntasks", "--ntasks": "ntasks",
                "--ntasks-per-node": "ntasks-per-node", "-c": "cpus-per-task",
                "--cpus-per-task": "cpus-per-task", "-K": "kill-on-bad-exit",
                "--kill-on-bad-exit": "kill-on-bad-exit"}
FLAGS = {"kill-on-bad-exit"}
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGCONT)
ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def parse_srun(args: list[str]) -> tuple[dict[str, str], list[str]]:
    options: dict[str, str] = {}
    while args and args[0].startswith("-"):
        arg = args.pop(0)
        name, has_value, value = arg.partition("=")
        if name not in SRUN_OPTIONS:
            raise SystemExit(f"srun (test stand-in): option {arg} is not modelled")
        key = SRUN_OPTIONS[name]
        if key in FLAGS:
            options[key] = value if has_value else "1"
        else:
            options[key] = value if has_value else args.pop(0)
    if not args:
        raise SystemExit("srun (test stand-in): no command")
    return options, args


def srun(args: list[str]) -> int:
    options, command = parse_srun(list(args))
    nodes = expand_hostlist(os.environ["SLURM_JOB_NODELIST"])
    n_nodes = int(options.get("nodes", os.environ["SLURM_NNODES"]))
    per_node = int(options.get("ntasks-per-node", 1))
    n_tasks = int(options.get("ntasks", n_nodes * per_node))
    if per_node != 1 or n_tasks != n_nodes or n_nodes > len(nodes):
        raise SystemExit("srun (test stand-in): only one task on each of the job's nodes is modelled")
    cpus = options.get("cpus-per-task") or os.environ.get("SRUN_CPUS_PER_TASK")
    step = len(recorded(Path(os.environ[STATE_ENV]), "srun"))
    # "argv", not "command": that key names the stand-in (found when a test first required a
    # recorded srun call: the argv list overwrote it, so no srun call was ever found)
    record("srun", options=options, argv=command, step=step)
    pending: list[int] = []
    for sig in (*FORWARDED, *ENDING):
        signal.signal(sig, lambda signum, frame: pending.append(signum))
    step_nodes = nodes[:n_nodes]
    tasks = []
    for rank, node in enumerate(step_nodes):
        env = {**os.environ, "SLURM_STEP_ID": str(step), "SLURM_STEPID": str(step),
               "SLURM_STEP_NODELIST": ",".join(step_nodes), "SLURM_STEP_NUM_NODES": str(n_nodes),
               "SLURM_STEP_NUM_TASKS": str(n_tasks), "SLURM_NTASKS": str(n_tasks),
               "SLURM_NPROCS": str(n_tasks), "SLURM_NODEID": str(rank), "SLURM_PROCID": str(rank),
               "SLURM_LOCALID": "0", "SLURMD_NODENAME": node}
        if cpus:
            env["SLURM_CPUS_PER_TASK"] = cpus
        tasks.append(subprocess.Popen(command, env=env, start_new_session=True))
    status: dict[int, int] = {}
    killed = False
    while len(status) < len(tasks):
        while pending:
            sig = pending.pop(0)
            if sig in ENDING:
                killed = True
            for task in tasks:
                if task.poll() is None:
                    if sig in ENDING:
                        kill_tree(task.pid)
                    else:
                        os.killpg(task.pid, sig)
        for rank, task in enumerate(tasks):
            if rank not in status and task.poll() is not None:
                code = task.returncode if task.returncode >= 0 else 128 - task.returncode
                status[rank] = code
                if code != 0:
                    print(f"srun: error: {step_nodes[rank]}: task {rank}: Exited with exit code {code}",
                          file=sys.stderr)
                    if options.get("kill-on-bad-exit", "0") != "0" and not killed:
                        killed = True
                        for other in tasks:
                            if other.poll() is None:
                                kill_tree(other.pid)
        time.sleep(0.02)
    return max(status.values())


STAND_INS = {"srun": srun, "scontrol": scontrol}


# ---- sbatch and slurmd --------------------------------------------------------------------------


def sbatch_options(script: Path) -> dict[str, str]:
    """The #SBATCH lines at the top of the script, in their ``--name[=value]`` form."""
    options = {}
    for line in script.read_text().splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break  # sbatch stops reading directives at the first command
        if line.startswith("#SBATCH"):
            for arg in shlex.split(line[len("#SBATCH"):]):
                assert arg.startswith("--"), f"{arg}: the harness reads --name[=value] options only"
                name, _, value = arg[2:].partition("=")
                options[name] = value
    return options


@dataclass
class BatchJob:
    slurm: FakeSlurm
    script: Path
    args: list[str]
    options: dict[str, str]
    env: dict[str, str]
    restart_count: int
    proc: subprocess.Popen = field(init=False)

    @property
    def output(self) -> Path:
        pattern = self.options.get("output", "slurm-%j.out")
        name = pattern.replace("%x", self.options.get("job-name", self.script.name)).replace(
            "%j", str(self.slurm.job_id))
        return self.slurm.submit_dir / name

    def start(self) -> BatchJob:
        spool = self.slurm.root / "spool" / f"job{self.slurm.job_id}"
        spool.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.script, spool / "slurm_script")
        append = self.restart_count > 0 and self.options.get("open-mode") == "append"
        with open(self.output, "a" if append else "w") as out:
            self.proc = subprocess.Popen(["bash", str(spool / "slurm_script"), *self.args],
                                         cwd=self.slurm.submit_dir, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.batch_env(),
                                         start_new_session=True)
        return self

    def batch_env(self) -> dict[str, str]:
        every = expand_hostlist(self.slurm.nodelist)
        nodes = every[:int(self.options.get("nodes", 1))]
        nodelist = self.slurm.nodelist if len(nodes) == len(every) else ",".join(nodes)
        env = {**self.env, "PATH": f"{self.slurm.bin}{os.pathsep}{self.env.get('PATH', '')}",
               STATE_ENV: str(self.slurm.state),
               "SLURM_JOB_ID": str(self.slurm.job_id), "SLURM_JOBID": str(self.slurm.job_id),
               "SLURM_JOB_NAME": self.options.get("job-name", self.script.name),
               "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist,
               "SLURM_NNODES": str(len(nodes)), "SLURM_JOB_NUM_NODES": str(len(nodes)),
               "SLURM_SUBMIT_DIR": str(self.slurm.submit_dir), "SLURM_SUBMIT_HOST": nodes[0],
               "SLURMD_NODENAME": nodes[0], "SLURM_NODEID": "0", "SLURM_PROCID": "0",
               "SLURM_LOCALID": "0", "SLURM_CLUSTER_NAME": "fake"}
        if "cpus-per-task" in self.options:
            env["SLURM_CPUS_PER_TASK"] = self.options["cpus-per-task"]
        if self.restart_count:
            env["SLURM_RESTART_COUNT"] = str(self.restart_count)
        return env

    def send_signal(self) -> signal.Signals:
        """The script's ``--signal``, delivered the way Slurm delivers it; the signal sent."""
        spec = self.options.get("signal", "")
        target, _, rest = spec.rpartition(":")
        name = rest.split("@")[0]
        if target != "B":
            raise AssertionError(f"--signal={spec}: the harness models B: (to the batch shell) only")
        sig = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        os.kill(self.proc.pid, sig)
        return sig

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def log(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def kill(self) -> None:
        """Everything the job runs, if its batch shell still runs (srun and its tasks wait below it)."""
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait(timeout=30)


class FakeSlurm:
    """One job at a time, on the nodes of ``nodelist`` (all this machine); ``root`` holds its files."""

    def __init__(self, root: Path, job_id: int = 4242, nodelist: str = NODELIST) -> None:
        self.root, self.job_id, self.nodelist = root, job_id, nodelist
        self.bin, self.state, self.submit_dir = root / "bin", root / "state", root / "submit"
        for directory in (self.bin, self.state, self.submit_dir):
            directory.mkdir(parents=True, exist_ok=True)
        for command in ("srun", "scontrol"):
            # Python itself, not a shell wrapper: a shell such as dash drops environment variables
            # whose names are not identifiers, and the real commands pass the environment whole.
            stand_in = self.bin / command
            stand_in.write_text(f"#!{sys.executable}\nimport sys\n"
                                f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
                                f"from slurm_harness import STAND_INS\n"
                                f"sys.exit(STAND_INS[{command!r}](sys.argv[1:]))\n")
            stand_in.chmod(0o755)

    def submit(self, script: Path, *args: str, env: dict[str, str]) -> BatchJob:
        return BatchJob(self, script, list(args), sbatch_options(script), env, 0).start()

    def calls(self, command: str) -> list[dict]:
        return recorded(self.state, command)

    def requeue(self, job: BatchJob) -> BatchJob:
        """Start ``job`` again, as Slurm does after the requeue the job asked for."""
        asked = [call["job_id"] for call in self.calls("requeue")]
        assert asked and asked[-1] == str(self.job_id), f"the job asked for no requeue ({asked})"
        again = BatchJob(self, job.script, job.args, job.options, job.env, job.restart_count + 1)
        return again.start()


