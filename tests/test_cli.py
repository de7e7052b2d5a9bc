"""The command line end to end: the default run, relaunch under torchrun, two 'nodes', errors."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from cli_utils import SHARDTRAIN, clean_env, read_metrics, run_cli

from shardtrain.config.loader import load_config
from shardtrain.config.schema import CheckpointConfig, Config
from shardtrain.distributed.env import check_not_one_of_many, init_distributed
from shardtrain.errors import ConfigError
from shardtrain.logs import TaggedFormatter, not_for_users
from shardtrain.train.console import format_record, rate
from shardtrain.train.loop import Trainer
from shardtrain.train.metrics import Throughput
from shardtrain.train.optim import lr_factor


def test_default_train_runs_and_loss_falls(tmp_path):
    run_dir = tmp_path / "default"
    proc = run_cli("train", "trainer.max_steps=40", "trainer.eval_every=20", "trainer.log_every=10",
                   "trainer.sample_tokens=16", f"run.dir={run_dir}",
                   # a profiler window cut short by max_steps, closed before the final save and sample
                   "diagnostics.profile_at=39", "diagnostics.profile_steps=5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(run_dir)
    losses = [r["loss"] for r in records]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(losses) == 4 and len(vals) == 2
    assert losses[0] > 3.5  # starts near ln(256) = 5.55 nats per byte
    assert losses[-1] < losses[0] - 1.0 and vals[-1] < vals[0]
    assert vals[-1] < 3.0
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_mib"] > 0 for r in records)
    assert all(r["mfu"] is None for r in records)  # CPU peak unknown: never a made-up MFU
    # The rate logged at step N is the one step N trained at (found by review: the schedule's next,
    # one step ahead of the loss it is plotted beside; the last step logged a rate no step used)
    t = load_config(["trainer.max_steps=40"]).trainer
    assert [r["lr"] for r in records] == pytest.approx(
        [t.lr * lr_factor(r["step"] - 1, t.warmup_steps, t.max_steps, t.min_lr_ratio, t.lr_decay,
                          t.decay_fraction) for r in records], rel=1e-12)
    assert (run_dir / "config.yaml").is_file() and any((run_dir / "tensorboard").iterdir())
    assert read_metrics(run_dir, "sample")[0]["text"].startswith("def ")
    assert "profiler: tracing steps 39-40" in proc.stderr and "rank 0's costliest operators:" in proc.stderr
    trace = json.loads((run_dir / "profiles" / "steps-39-40" / "rank0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names and not any("generate" in str(name) for name in names)
    # The start-up report names config.yaml (the config is not dumped on the console) and says once
    # that MFU is not reported; the step lines leave it out.
    assert f"config: every key, resolved, in {run_dir / 'config.yaml'}" in proc.stderr
    assert "sharding_strategy:" not in proc.stderr
    assert proc.stderr.count("MFU is not reported: no peak FLOP/s is known for this device (cpu)") == 1
    step_lines = [line for line in proc.stderr.splitlines() if "| loss " in line]
    assert len(step_lines) == 4 and "val_loss" in step_lines[-1]
    assert all("GFLOP/s" in line and "MFU" not in line and "unknown" not in line for line in step_lines)


def test_console_line_leaves_out_what_is_unknown():
    record = {"loss": 2.0, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_s": 1000.0, "samples_per_s": 8.0,
              "model_tflops": None, "mfu": None, "peak_memory_mib": 100.0, "data_wait_pct": 1.0}
    assert format_record(10, 100, record) == (
        "step 10/100 | loss 2.0000 | grad_norm 0.500 | lr 1.00e-03 | 1000 tok/s | peak mem 100 MiB | "
        "data wait 1.0%")
    known = format_record(10, 100, {**record, "model_tflops": 0.5, "mfu": 0.25})
    assert "| 1000 tok/s | 500.0 GFLOP/s | MFU 25.0% | peak mem" in known
    averaged = format_record(10, 100, {**record, "val_loss": 1.5, "ema_val_loss": 1.25, "val_acc": 0.5,
                                       "ema_val_acc": 0.75}, ("acc",))
    assert averaged.endswith("| data wait 1.0% | val_loss 1.5000 | val_acc 0.5 | ema_val_loss 1.2500 | "
                             "ema_val_acc 0.75")
    # a value validation alone returns (found by review: logged, not shown)
    assert format_record(10, 100, {"val_loss": 1.5, "val_top1": 0.25}, ("acc",)).endswith(
        "| val_loss 1.5000 | val_top1 0.25")
    # a task's own unit, as its records count it (found by review: samples/s for a DiT's elements)
    task = {key: value for key, value in record.items() if key != "tokens_per_s"}
    assert "| 5120 elements/s |" in format_record(10, 100, {**task, "elements_per_s": 5120.0,
                                                            "elements_seen": 10240, "samples_seen": 80})
    assert "| 8.0 samples/s |" in format_record(10, 100, {**task, "samples_seen": 80})
    # ... and on the progress bar, whose throughput report has no count so far (found by review:
    # the bar showed samples/s for a task counting elements)
    throughput = Throughput("elements", 1, None)
    throughput.add(samples=2, count=4096, flops=0.0)
    assert rate(throughput.report(), throughput.unit).endswith(" elements/s")
    assert rate({"tokens_per_s": 10.0, "samples_per_s": 1.0}, "tokens") == "10 tok/s"
    assert rate({"samples_per_s": 0.25}, "samples") == "0.2 samples/s"  # not "0 samples/s"
    # A task counting samples: samples/s is its count's rate, as samples_seen is its count (found by
    # review: the samples consumed, where the loss counted 9 of 16)
    counted = Throughput("samples", 1, None)
    counted.add(samples=16, count=9, flops=0.0)
    counted.since -= 100.0  # 100 s ago: the rate is 9 / 100 s, within the test's own time
    assert counted.report()["samples_per_s"] == pytest.approx(0.09, rel=1e-2)


# What `shardtrain` answers without training: (arguments, exit status, the line it ends with). The
# paths do not exist.
NO_TRAINING = [
    (["--help"], 0, "show this help message and exit"),
    (["train", "trainer.max_stepz=5"], 2,
     "shardtrain: error: unknown config key 'trainer.max_stepz'; did you mean 'trainer.max_steps'?"),
    (["train", "strategy=ful_shard"], 2, "did you mean 'full_shard'?"),
    (["train", "strategy.sharding_strategy=ZERO3"], 2, "is not a sharding strategy"),
    (["train", "trainer.max_steps=abc"], 2, "trainer.max_steps=abc"),
    (["train", "data=files", "data.paths=[nowhere]"], 2, "data path 'nowhere' does not exist"),
    # data.paths without a source that reads them (the run trained on the standard library), a NaN
    # (it passed every bound)
    (["train", "data.paths=[corpus]"], 2, "is read with data.source=files or prepared; add data=files"),
    (["train", "trainer.lr=nan"], 2, "trainer.lr=nan must be a finite number"),
    (["train", "--devices", "2"], 2, "unrecognized arguments: --devices; see shardtrain train --help"),
    # left over after a subcommand: its help, not the top level's (found by a review)
    (["export-hf", "a", "b", "--bogus"], 2,
     "unrecognized arguments: --bogus; see shardtrain export-hf --help"),
    # argparse's own errors in one line, naming the command's help (found by a review: 4 to 8 lines)
    (["trian"], 2, "did you mean 'train'?; see shardtrain --help"),
    (["plan", "--world-sizes", "two"], 2,
     "shardtrain: error: argument --world-sizes: invalid int value: 'two'; see shardtrain plan --help"),
    (["plan", "trainer.max_stepz=5"], 2, "did you mean 'trainer.max_steps'?"),
    (["plan", "--device-memory", "80XB"], 2, "--device-memory '80XB' is not a size"),
    # 0 and below: planned as if not given, or rows of "division by zero" and exit 0
    (["plan", "--world-sizes", "0", "8"], 2, "--world-sizes 0 8: each must be at least 1"),
    (["plan", "--processes-per-node", "0"], 2, "--processes-per-node 0: each must be at least 1"),
    (["plan", "--world-sizes", "99999999999"], 2, "--world-sizes 99999999999: each must be at most 1,048"),
    (["plan", "--device-memory", "0"], 2, "--device-memory '0' must be more than 0"),
    # a number alone is bytes: 80 planned for 80 bytes, every row "no" (found by review)
    (["plan", "--device-memory", "80"], 2, "--device-memory '80' has no unit, and read as bytes it is under "
                                          "1 MiB; write it with one, like 80GB"),
    (["generate", ".", "--prompts-file", "latin1.txt"], 2, "is not UTF-8 text"),
    # argv bytes that are not UTF-8 (Latin-1 é), as Python keeps them: a traceback at tokenization
    (["generate", "missing", "--prompt", "caf\udce9"], 2, "--prompt is not UTF-8 text"),
    (["generate", "missing", "--prompt", "hi"], 2, "shardtrain: error: 'missing' does not exist"),
    (["generate", "missing", "--prompt", "hi", "--top-p", "0"], 2, "--top-p"),
    (["eval", "missing"], 2, "shardtrain: error: 'missing' does not exist"),
    # found by review: named as the config key, after the checkpoint had loaded
    (["eval", "missing", "--strategy", "ful_shard"], 2, "--strategy 'ful_shard' is not a sharding strategy"),
    (["generate", "missing", "--prompt", "hi", "--strategy", "zero3"], 2,
     "--strategy 'zero3' is not a sharding strategy"),
    (["eval", ".", "--file", "missing.txt"], 2, "shardtrain: error: --file 'missing.txt' does not exist"),
    # they shape --file's reading (found by review: accepted and ignored without one)
    (["eval", ".", "--glob", "*.txt", "--text-field", "body"], 2,
     "--glob and --text-field shape how --file is read, and no --file is given"),
    (["consolidate", "missing", "out.safetensors"], 2,
     "shardtrain: error: checkpoint 'missing' does not exist"),
    (["export-hf", "missing", "out"], 2, "shardtrain: error: checkpoint 'missing' does not exist"),
    (["inspect", "missing"], 2, "shardtrain: error: 'missing' does not exist"),
    (["report", "missing"], 2, "shardtrain: error: run directory 'missing' does not exist"),
    # found by review: the right words for the mistake made
    (["report", "latin1.txt"], 2, "'latin1.txt' is a file; pass the run directory holding it ('.')"),
    (["generate", ".", "--prompts-file", "."], 2, "--prompts-file '.' is a directory; name a text file"),
    (["train", "data.paths=/x"], 2, "shardtrain: error: data.paths=/x is not a list: write data.paths=[/x] "
                                    "(a list is in brackets: key=[a,b])"),
    # found by a new-user trial: Hydra's words first, or none of the way out
    (["train", "run.mlflow=foo"], 2, "shardtrain: error: run.mlflow is a section of settings, not a value: "
                                     "set its keys (run.mlflow.tracking_uri, run.mlflow.experiment, ...)"),
    (["train", "run.trackers=[wandbb]"], 2, "'wandbb' is not a tracker; did you mean 'wandb'? Choose from "),
    (["train", "checkpoint.resume=null"], 2, "this key takes no null (checkpoint.resume=none starts afresh)"),
]
# Runs each in one fresh interpreter, as `python -m shardtrain ARGS` would, and reports what it
# imported: torch and what stands on it take seconds to import.
ANSWER = """
import contextlib, io, json, sys
from shardtrain.cli.main import main
for args in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        try:
            status = main(args)
        except SystemExit as exc:
            status = exc.code
    heavy = [m for m in ("torch", "transformers", "safetensors", "matplotlib") if m in sys.modules]
    print(json.dumps([status, out.getvalue().strip().splitlines()[-1], heavy]))
"""


def test_log_lines_say_which_library_wrote_them():
    """Every line is tagged (the launcher keeps tagged lines on the console); a library's own line
    says whose it is rather than reading as shardtrain's (torchao's kernel loading on CPU)."""
    formatter = TaggedFormatter("[st 1]")

    def line(name: str, message: str) -> str:
        return formatter.format(logging.LogRecord(name, logging.WARNING, __file__, 1, message, None, None))

    assert line("shardtrain.train.loop", "step 1\nstep 2") == "[st 1] step 1\n[st 1] step 2"
    assert line("torchao.kernel.intmm", "Detected no triton") == "[st 1] torchao: Detected no triton"
    assert line("root", "a warning") == "[st 1] a warning"
    # torch's notice to torchao, printed by every process of a Hugging Face run, is dropped.
    notice = logging.LogRecord("torch.utils._pytree", logging.WARNING, __file__, 1, "%s is an Enum subclass "
                               "and is now natively supported by torch.compile", ("KernelPreference",), None)
    assert not not_for_users(notice)
    other = logging.LogRecord("torch.utils._pytree", logging.WARNING, __file__, 1, "other", None, None)
    assert not_for_users(other)
    # torchao's kernels for other uses than shardtrain's, which a CPU build cannot load: dropped too.
    for name, message in (("torchao", "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library"),
                          ("torchao.kernel.intmm", "Warning: Detected no triton, on systems without")):
        assert not not_for_users(logging.LogRecord(name, logging.WARNING, __file__, 1, message, None, None))
    kept = logging.LogRecord("torchao.float8", logging.WARNING, __file__, 1, "other", None, None)
    assert not_for_users(kept)


def test_a_prompts_file_is_cut_at_line_ends_alone(tmp_path):
    """Found by review: splitlines() cut a prompt at a form feed (Python's sources, the default
    corpus, hold them) and at U+2028, and a byte-order mark began the first prompt."""
    from argparse import Namespace

    from shardtrain.cli.main import read_prompts

    path = tmp_path / "prompts.txt"
    path.write_bytes("\ufeffdef a\r\n\nclass B\fC\n   \nx = 1\u2028y\n".encode())
    prompts = read_prompts(Namespace(prompts_file=str(path), prompt=None))
    assert prompts == ["def a", "class B\fC", "x = 1\u2028y"]
    # a pipe, as a shell's <(...) gives one (found by review: "does not exist")
    read_end, write_end = os.pipe()
    os.write(write_end, b"def \nclass \n")
    os.close(write_end)
    try:
        assert read_prompts(Namespace(prompts_file=f"/dev/fd/{read_end}", prompt=None)) == ["def ", "class "]
    finally:
        os.close(read_end)


def test_answers_without_training_import_no_torch(tmp_path):
    """A typo, a bad argument or a missing path is answered before torch is imported (it takes
    seconds: the answer should take a fraction of one); no wall-clock bound, the imports tell."""
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    proc = subprocess.run([sys.executable, "-c", ANSWER, json.dumps([a for a, _, _ in NO_TRAINING])],
                          capture_output=True, text=True, cwd=tmp_path, env=clean_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(answers) == len(NO_TRAINING)
    for (args, status, last_line), (got_status, got_line, heavy) in zip(NO_TRAINING, answers, strict=True):
        assert (got_status, heavy) == (status, []), (args, got_line)
        assert last_line in got_line, args


def quick_losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


QUICK = ["experiment=quick", "trainer.max_steps=6", "trainer.warmup_steps=12", "trainer.log_every=1",
         "trainer.eval_every=0", "trainer.sample_tokens=0", "trainer.micro_batch_size=2", "run.trackers=[]"]


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
    """Global batch 8: one process with micro-batch 2 and 4 accumulation steps."""
    run_dir = tmp_path_factory.mktemp("single")
    proc = run_cli("train", *QUICK, "trainer.grad_accum_steps=4", f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return quick_losses(run_dir)


def test_devices_relaunches_under_torchrun(tmp_path, single_process_losses):
    run_dir = tmp_path / "two"
    proc = run_cli("train", *QUICK, "trainer.devices=2", "trainer.grad_accum_steps=2",
                   "strategy=shard_grad_op", "trainer.deterministic=true", "trainer.memory_limit_gib=8",
                   f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world size 2" in proc.stderr and "SHARD_GRAD_OP" in proc.stderr
    assert "deterministic kernels" in proc.stderr  # torch's own switch, read back: it is on
    # found by review: a warmup longer than the run kept the rate below trainer.lr without a word
    assert ("trainer.warmup_steps=12 > trainer.max_steps=6: the learning rate rises for the whole run and "
            "peaks at 0.0015, 50% of trainer.lr=0.003") in proc.stderr
    # found by review: a limit a fixed micro-batch never reads was taken without a word
    assert ("trainer.memory_limit_gib=8 is the budget trainer.micro_batch_size=auto plans against (in "
            "training and in `shardtrain plan`); this run's micro-batch is fixed at 2") in proc.stderr
    for a, b in zip(quick_losses(run_dir), single_process_losses, strict=True):
        assert abs(a - b) / b < 1e-5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["trainer.max_step=3"], "did you mean 'trainer.max_steps'?"),
        (["strategy=fulll_shard"], "did you mean 'full_shard'?"),
        (["data.source=files", "data.paths=[/nonexistent/dir]", "trainer.max_steps=1"],
         "data path '/nonexistent/dir' does not exist"),
        (["trainer.devices=2", "trainer.num_nodes=2"], "start torchrun on every node"),
        # found by review: neither named its key, and AUTO not its spelling
        (["checkpoint.resume=AUTO"], "checkpoint.resume='AUTO' does not exist; the choice is spelt in lower "
                                     "case: checkpoint.resume=auto"),
        # found by a trial: it suggested a run directory, which resume=PATH then refuses
        (["checkpoint.resume=/no/such/step-4"],
         "checkpoint.resume='/no/such/step-4' does not exist; name a checkpoint directory (a run's "
         "checkpoints/step-N), auto or none"),
        # relative: anchored where the command runs, as checkpoints record it (found by a review)
        (["model.init_from=nowhere"], "/nowhere' does not exist"),
        # a bare class name is looked up before launch (found by review: after it, by every worker)
        (["strategy.wrap_policy=[TransformerBlok]", "trainer.devices=2"],
         "shardtrain: error: strategy.wrap_policy: Llama has no module of class 'TransformerBlok'"),
    ],
)
def test_bad_input_exits_nonzero_with_message(args, message, tmp_path):
    proc = run_cli("train", *args, f"run.dir={tmp_path}", timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_copies_started_without_torchrun_are_refused(tmp_path, monkeypatch):
    """Found by review: `srun -n 8 shardtrain train` (or a launcher setting WORLD_SIZE alone) ran 8
    worlds of one, each training alone into the same run.dir, without a word."""
    for env, devices, said in (
            ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "3"}, 1,
             "8 copies started by srun, not by torchrun, and each would train alone as a world of one"),
            ({"SLURM_STEP_NUM_TASKS": "2"}, 2, "each would start a torchrun world of its own"),
            ({"WORLD_SIZE": "4", "RANK": "1"}, 1,
             "4 copies started by a launcher that set WORLD_SIZE but not LOCAL_RANK"),
            # found by review: a Kubeflow PyTorchJob's pod (WORLD_SIZE and RANK) with trainer.devices=2
            # trained a world of its own, every pod into the same run.dir
            ({"WORLD_SIZE": "2", "RANK": "1"}, 2,
             "2 copies started by a launcher that set WORLD_SIZE but not LOCAL_RANK")):
        proc = run_cli("train", "trainer.max_steps=1", f"trainer.devices={devices}", f"run.dir={tmp_path}",
                       env=env, timeout=120)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr[-2000:]
        assert "start one torchrun agent per node" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "checkpoints").exists()
    # The library's entry (a task of one's own under mpirun): before any process group exists
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="one of 2 copies started by mpirun"):
        Trainer.create(Config())
    assert not torch.distributed.is_initialized()
    # What is not training may run as many copies (srun -n 4 ... generate, one GPU each), and a
    # WORLD_SIZE left in the environment is torchrun's to replace under the built-in launcher
    init_distributed()
    torch.distributed.destroy_process_group()
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    monkeypatch.setenv("WORLD_SIZE", "8")
    check_not_one_of_many(starts_torchrun=True)


def test_hand_started_and_restarting_worlds_are_checked(tmp_path, monkeypatch):
    """Found by review of the launch paths: each of these ended in a traceback, a refusal that
    blamed the config, or a run that trained from step 0 again after every restart."""
    by_hand = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    for env, args, said in (
            # The error's own advice (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*) on two nodes: every
            # process was counted on one node and the shape refused
            ({**by_hand, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"},
             ["trainer.num_nodes=2", "trainer.devices=1"],
             "give every process LOCAL_WORLD_SIZE (the number of processes on its node)"),
            # No rendezvous named: torch's ValueError as a traceback
            (by_hand, ["trainer.devices=auto"],
             "rank 0 cannot join the process group at (MASTER_ADDR unset):(MASTER_PORT unset)"),
            # torchrun --max-restarts without checkpoints (train.sbatch passes 3): restarts from step 0
            ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
              "TORCHELASTIC_RUN_ID": "t", "TORCHELASTIC_MAX_RESTARTS": "3"},
             ["checkpoint.enabled=false"],
             "torchrun --max-restarts=3 restarts from the newest checkpoint, and checkpoint.enabled=false "
             "saves none")):
        proc = run_cli("train", "experiment=quick", "trainer.max_steps=1", *args, f"run.dir={tmp_path}",
                       env=env, timeout=120)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    # The library's entry checks restarts alike, before any process group
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("TORCHELASTIC_RUN_ID", "t"), ("TORCHELASTIC_MAX_RESTARTS", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="torchrun --max-restarts=1 restarts from the newest checkpoint"):
        Trainer.create(Config(checkpoint=CheckpointConfig(enabled=False)))
    assert not torch.distributed.is_initialized()


def test_a_filesystem_failure_or_a_damaged_file_is_one_line(tmp_path):
    """Found by review: a path the run cannot create (a full disk, a read-only home) and a damaged
    .safetensors file printed a traceback; an existing output file read as an unwritable directory."""
    (tmp_path / "a_file").write_text("x")
    proc = run_cli("train", "experiment=quick", f"data.cache_dir={tmp_path / 'a_file' / 'cache'}",
                   f"run.dir={tmp_path / 'run'}", timeout=180)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (  # named before launch since 2026-12-03
        f"shardtrain: error: data.cache_dir '{tmp_path / 'a_file' / 'cache'}' cannot be written "
        f"('{tmp_path / 'a_file'}' is not a writable directory); choose another path")
    # A run.dir the permissions allow but the filesystem refuses (found by a new-user trial: exit 1
    # with the OS's words, not naming run.dir)
    proc = run_cli("train", "experiment=quick", "run.dir=/proc/shardtrain-run", timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "shardtrain: error: run.dir='/proc/shardtrain-run' cannot be created (No such file or directory); "
        "choose another path"), proc.stderr[-3000:]
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    for command in (["generate", str(damaged), "--prompt", "hi"],
                    ["export-hf", str(damaged), str(tmp_path / "hf")]):
        proc = run_cli(*command, timeout=180)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1].startswith(
            f"shardtrain: error: {damaged} is not a readable safetensors file ("), proc.stderr[-3000:]
    existing = tmp_path / "a_file.safetensors"
    existing.write_text("x")
    proc = run_cli("consolidate", str(tmp_path / "run"), str(existing))
    assert proc.stderr.strip() == (f"shardtrain: error: consolidate output '{existing}' already exists; "
                                   "delete it or choose another name"), proc.stderr


def test_only_a_closed_stdout_ends_a_command_quietly(monkeypatch):
    """A broken pipe ends a command with 141 and no word when its stdout's reader went (`| head`);
    one of another pipe is a failure to say (found by review: every broken pipe was quiet, and under
    --devices its log was removed)."""
    from shardtrain.cli.main import stdout_reader_gone

    read, write = os.pipe()
    with os.fdopen(write, "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        assert not stdout_reader_gone()
        os.close(read)
        assert stdout_reader_gone()
        monkeypatch.undo()


def test_an_export_reads_a_linked_checkpoint_where_the_link_pointed_once(tmp_path):
    """Found by review: export-hf resolved checkpoints/best once for its write, and its self-check
    read through the link again: a training that moved it on between them failed a good export."""
    import argparse

    from shardtrain.cli.main import check_export_paths

    (tmp_path / "step-4").mkdir()
    (tmp_path / "best").symlink_to("step-4")
    args = argparse.Namespace(checkpoint=str(tmp_path / "best"), out=str(tmp_path / "out"))
    check_export_paths(args, "export-hf")
    (tmp_path / "best").unlink()
    (tmp_path / "best").symlink_to("step-6")  # moved on by the training
    assert args.checkpoint == str((tmp_path / "step-4").resolve())


def test_a_compile_failure_is_one_line_with_the_way_out(tmp_path):
    """Found by review: torch.compile's failure (here: no C++ compiler) was inductor's traceback of
    some 130 lines on every rank, exit 1, strategy.compile=false never named."""
    # A new interpreter, not run_cli's fork: inductor reads CXX when it is imported, which the
    # preloaded interpreter has done with the tests' environment; an empty inductor cache, where a
    # kernel an earlier compile left needs no compiler.
    env = clean_env(CXX=str(tmp_path / "no-such-g++"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    args = ["train", "experiment=quick", "trainer.max_steps=2", "strategy.compile=true",
            "trainer.sample_tokens=0", "trainer.eval_every=0", "checkpoint.enabled=false",
            f"run.dir={tmp_path / 'run'}"]
    proc = subprocess.run([*SHARDTRAIN, *args], capture_output=True, text=True, timeout=300, env=env,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("shardtrain: error: strategy.compile=true: torch.compile failed ("), last
    assert last.endswith("set strategy.compile=false to train without it"), last
