"""``shardtrain`` command line: ``shardtrain train [key=value ...]``."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import select
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

from shardtrain.cli.early_signals import EarlySignals
from shardtrain.cli.paths import check_exists, check_output, os_failure
from shardtrain.config.schema import DEFAULT_PREEMPTION_SIGNALS, Config
from shardtrain.errors import ShardtrainError
from shardtrain.logs import setup_logging

INTERRUPTED = "shardtrain: interrupted"
RESUMES = " (a training run with checkpoints resumes from its newest one when the same command runs again)"
# A closed pipe's status, as a shell gives it (128 + SIGPIPE): `shardtrain inspect X | head`.
BROKEN_PIPE_STATUS = 141
# A worker's lines to the console: under the built-in launcher only log lines reach it.
log = logging.getLogger("shardtrain")


def compose_checked(overrides: list[str]) -> Config:
    """The config's own errors, each answered before the next import it does not need: a misspelt key
    or preset before hydra (0.1 s), anything else the config can tell before torch (seconds)."""
    from shardtrain.config.keys import check_overrides

    check_overrides(overrides)
    from shardtrain.config.compose import compose_config

    return compose_config(overrides)


def restore_stopping_signals(cfg: Config) -> None:
    """A torchrun worker's default action back for each preemption-like signal it inherited ignored
    and does not take as a preemption. The agent ignores the preemption signals (the built-in
    launcher's, train.sbatch's), and an ignored signal is inherited: without checkpoints any of them,
    with them SIGTERM where only SIGUSR1 preempts, must stop the worker (torchrun's stop at a restart
    and scancel's were ignored until the SIGKILL: found by review)."""
    taken = set(cfg.checkpoint.preemption_signals) if cfg.checkpoint.enabled else set()
    for name in sorted({*DEFAULT_PREEMPTION_SIGNALS, *cfg.checkpoint.preemption_signals} - taken):
        if signal.getsignal(getattr(signal, name)) == signal.SIG_IGN:
            signal.signal(getattr(signal, name), signal.SIG_DFL)


def cmd_train(overrides: list[str]) -> int:
    early = EarlySignals(DEFAULT_PREEMPTION_SIGNALS)
    cfg = compose_checked(overrides)
    from shardtrain.cli.launch import BUILT_IN_LAUNCH, launch_log_path, relaunch_if_needed
    from shardtrain.cli.preflight import check_training
    from shardtrain.config.loader import check_runtime, settings_left_to_the_task
    from shardtrain.diagnostics.failures import is_failure, record_exception
    from shardtrain.distributed.env import destroy_distributed, under_torchrun
    from shardtrain.train.loop import Trainer

    check_runtime(cfg)  # every other config error surfaces here, before any process starts
    # Once: by the process the user started (the built-in launcher's workers say nothing of it)
    by_hand = os.environ.get(BUILT_IN_LAUNCH) != "1" and int(os.environ.get("RANK", 0)) == 0
    if by_hand and (unread := settings_left_to_the_task(cfg, overrides)):
        log.warning(unread)
    if cfg.strategy.float8:
        import shardtrain.distributed.float8  # noqa: F401 - registers the conversion (loads torchao)
    if under_torchrun():
        restore_stopping_signals(cfg)
    else:
        check_training(cfg)  # paths: run.dir, an explicit resume, model.init_from
    started = time.time()
    log_file = launch_log_path(Path(cfg.run.dir), started)
    status = relaunch_if_needed(cfg, ["train", *overrides], log_file, early)
    if status is not None:
        return launch_outcome(status, Path(cfg.run.dir), started, log_file)
    preemption = None
    if cfg.checkpoint.enabled:
        # The process that trains (a torchrun worker, or this one alone): the trainer's handler goes
        # in now, not when training starts: start-up takes minutes at scale, and a preemption then
        # is acted on after the first step (a save, then a clean stop).
        from shardtrain.checkpoint.preemption import PreemptionFlag

        preemption = PreemptionFlag(cfg.checkpoint.preemption_signals)
        preemption.take(early.caught, early.hand_over(set(preemption.signals)))
    else:
        early.hand_over()
    rank = int(os.environ.get("RANK", 0))
    trainer = None
    try:
        trainer = Trainer.create(cfg)
        trainer.preemption = preemption
        trainer.fit()
    except BaseException as exc:
        # A failure in training is recorded by the trainer (fit), before its trackers close; this
        # one is a failure to build it.
        if trainer is None and is_failure(exc):
            record_exception(Path(cfg.run.dir), rank, 0, exc)
        raise
    finally:
        destroy_distributed()
    return 0


def launch_outcome(status: int, run_dir: Path, started: float, log_file: Path) -> int:
    """The exit status of a launched training (the first failure's, as one process gives it), and
    its one line when it did not succeed: the rank that failed first (from the failure records
    since ``started``), a rank killed from outside, or an interrupt (Ctrl-C reaches every worker,
    and none recorded a failure)."""
    from shardtrain.cli.launch import (
        ERROR_START,
        failed_worker,
        first_worker_line,
        killed_first,
        killed_reason,
    )
    from shardtrain.diagnostics.failures import describe, failure_records, root_failure

    if status == 0:
        return 0
    records = failure_records(run_dir, started, last_attempt=True)
    failure = root_failure(records)
    killed = killed_first(log_file)
    if killed and killed[1] != "SIGKILL" and (own := [r for r in records if r["rank"] == killed[0]]):
        # an abort after an error its record names: that record, whatever its peers recorded first
        killed, failure = None, min(own, key=lambda record: record["time"])
    if failure is None and not killed and (first_worker_line(log_file) or "").startswith(INTERRUPTED):
        print(f"{INTERRUPTED}{RESUMES}", file=sys.stderr)
        return 130
    if killed:
        reason = killed_reason(*killed)
        status = 128 + signal.Signals[killed[1]].value  # as a shell reports a process it killed
    elif failure is not None:
        reason = describe(failure)
        # The status one process gives for it (2: a framework error), which torchrun's 1 hides.
        status = failure.get("exit_status", status)
    elif status > 128:  # run_under_torchrun: a signal stopped the launch, or killed the agent
        name = signal.Signals(status - 128).name
        reason = (f"torchrun's agent was killed by {name} (from outside, or by the out-of-memory killer); "
                  "its workers were stopped" if name == "SIGKILL" else
                  f"stopped by {name} (sent to the launcher or torchrun's agent); its workers were stopped")
    elif (worker := failed_worker(log_file))[0]:
        # No record (run.dir's disk full, or a worker that died writing it): its error line, which
        # the launcher keeps when the log cannot take it, and the status torchrun reports it gave.
        line, code = worker
        reason = line.removeprefix(ERROR_START)
        status = code if code is not None else status
    else:
        reason = f"the training processes exited with status {status} without an error record"
    print(f"shardtrain: error: {reason}; full log: {log_file}", file=sys.stderr)
    return status


def on_devices(devices: int, argv: list[str]) -> int | None:
    """Run ``shardtrain argv`` on ``devices`` processes under torchrun, or None to run here."""
    from shardtrain.cli.launch import failed_worker, killed_first, killed_reason, own_line, run_under_torchrun
    from shardtrain.distributed.env import under_torchrun
    from shardtrain.errors import ConfigError

    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != devices:
            raise ConfigError(f"--devices {devices} but torchrun started {os.environ['WORLD_SIZE']}")
        return None
    if devices > 1:
        # The workers' stderr (every rank's copy of an error, torchrun's ChildFailedError report) goes
        # to a log; the console gets their log lines, then one line, as `train` gives.
        # Under Slurm beside the job's submission, not in a /tmp that many sites give each job and
        # delete at its end (the "full log:" path of a failure would name nothing).
        try:
            handle, name = tempfile.mkstemp(prefix=f"shardtrain-{argv[0]}-", suffix=".log",
                                            dir=os.environ.get("SLURM_SUBMIT_DIR"))
        except OSError:  # a submission directory this node cannot write (Slurm then runs in /tmp)
            handle, name = tempfile.mkstemp(prefix=f"shardtrain-{argv[0]}-", suffix=".log")
        os.close(handle)
        log_file = Path(name)
        status = run_under_torchrun(devices, argv, (), log_file=log_file)
        if status == 0:
            log_file.unlink(missing_ok=True)
            return 0
        killed = killed_first(log_file)
        if killed and (killed[1] == "SIGKILL" or not own_line(log_file, killed[0])):
            # it left no line: any line in the log is a peer's fallout
            print(f"shardtrain: error: {killed_reason(*killed)}; full log: {log_file}", file=sys.stderr)
            return 128 + signal.Signals[killed[1]].value
        line, code = failed_worker(log_file)  # the first failing worker's line and exit status
        if line is None and code == BROKEN_PIPE_STATUS:
            # `generate --devices N | head`: rank 0's reader went, as a closed pipe ends one process
            # quietly (found by review: "exited with status 1 without an error line", and a log kept)
            log_file.unlink(missing_ok=True)
            return BROKEN_PIPE_STATUS
        if line == INTERRUPTED:
            log_file.unlink(missing_ok=True)
            print(INTERRUPTED, file=sys.stderr)
            return 130
        reason = (line.removeprefix("shardtrain: error: ") if line else
                  f"the {devices} processes exited with status {status} without an error line")
        print(f"shardtrain: error: {reason}; full log: {log_file}", file=sys.stderr)
        # The status the first failing worker gave (2 for a framework error, 1 for an OS one), which
        # torchrun's own 1 hides.
        return code if code is not None else (2 if line else status)
    return None


def read_prompts(args: argparse.Namespace) -> list[str]:
    from shardtrain.errors import ConfigError

    if args.prompts_file:
        path = Path(args.prompts_file).expanduser()
        if path.is_dir():
            raise ConfigError(f"--prompts-file {str(path)!r} is a directory; name a text file, one prompt "
                              "a line")
        if not path.exists():  # a pipe (<(...), /dev/stdin) is read as a file is (found by review)
            raise ConfigError(f"--prompts-file {str(path)!r} does not exist")
        try:
            # A prompt a line, lines ending in \n or \r\n alone: splitlines() also cut a prompt at a
            # form feed (which Python's sources hold) or U+2028. A byte-order mark is no prompt's.
            text = path.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"--prompts-file {str(path)!r} is not UTF-8 text ({exc.reason} at byte "
                              f"{exc.start}); save it as UTF-8") from exc
        except OSError as exc:
            raise ConfigError(f"--prompts-file {str(path)!r} cannot be read ({exc.strerror or exc})") from exc
        prompts = [line.removesuffix("\r") for line in text.split("\n") if line.strip()]
        if not prompts:
            raise ConfigError(f"--prompts-file {str(path)!r} has no prompt lines")
        return prompts
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # argv bytes that are not UTF-8, kept by Python as surrogates
        raise ConfigError("--prompt is not UTF-8 text (the terminal's or script's encoding); give it as "
                          "UTF-8, or put it in a UTF-8 file for --prompts-file") from exc
    return [args.prompt]


def cmd_generate(args: argparse.Namespace, argv: list[str]) -> int:
    from shardtrain.config.strategy import normalize_strategy_name
    from shardtrain.generation.ranges import GENERATE_RANGES, check_ranges, check_sampling

    check_ranges(args, GENERATE_RANGES)  # argument errors surface here, before any process starts
    check_sampling(args)
    normalize_strategy_name(args.strategy, given_as="--strategy ")
    prompts = read_prompts(args)
    args.checkpoint = check_exists(args.checkpoint)
    from shardtrain.generation.inference import check_processes_for

    check_processes_for(Path(args.checkpoint), args.devices)  # before N processes start for nothing
    status = on_devices(args.devices, argv)
    if status is not None:
        return status
    from contextlib import nullcontext

    from torch.distributed import all_gather_object

    from shardtrain.config.sizes import human_bytes
    from shardtrain.distributed.env import destroy_distributed
    from shardtrain.errors import GenerationError
    from shardtrain.generation.generate import (
        check_prompt,
        gathered_copy,
        generate,
        generation_mode,
        out_of_memory_explained,
        positions_needed,
        prompt_ids,
        sharded_inference,
    )
    from shardtrain.generation.inference import load_for_inference

    try:
        loaded = load_for_inference(args.checkpoint, args.strategy, args.dtype,
                                    verify_checksums=not args.skip_checksums, average=args.ema)
        tokenizer = loaded.tokenizer()
        # The KV cache of the longest generation (a chat template's few tokens around it aside)
        longest = 0 if args.no_cache else positions_needed(
            max(len(prompt_ids(tokenizer, prompt)) for prompt in prompts), args.max_new_tokens)
        choice = generation_mode(loaded.model, loaded.compute_dtype, loaded.env.device, args.mode,
                                 loaded.env.local_world_size, positions=longest)
        if choice.cache_fits_nowhere():
            cache, free = human_bytes(choice.cache_bytes), human_bytes(choice.free_bytes)
            raise GenerationError(f"the KV cache of the longest generation ({cache}) does not fit a rank's "
                                  f"free memory ({free}) in either mode (each rank holds all of it); ask for "
                                  "fewer --max-new-tokens, shorten the longest prompt, or use --no-cache")
        main_rank = loaded.env.is_main
        if main_rank:
            log.info(f"generation: {choice.mode} ({choice.reason()})")
        with out_of_memory_explained(choice.mode):
            runner = (nullcontext(gathered_copy(loaded.model, loaded.factory, loaded.env.device,
                                                loaded.compute_dtype))
                      if choice.mode == "gathered" else sharded_inference(loaded.model))

        def show(text: str) -> None:
            if main_rank and text:
                sys.stdout.write(text)
                sys.stdout.flush()

        def render(prompt: str) -> tuple[str, list[int]]:
            if args.chat:  # the prompt as the user's turn, in the model's chat template
                text = tokenizer.render_chat([{"role": "user", "content": prompt}])
                return text, tokenizer.encode(text, special_tokens=False)
            return prompt, prompt_ids(tokenizer, prompt)

        # A chat turn ends at the template's end of turn too (a base model fine-tuned on
        # conversations: its generation_config names only the end of text).
        stops = tokenizer.stop_ids | (tokenizer.turn_end_ids if args.chat else frozenset())

        def run(model, index: int, ids: list[int], on_text) -> None:
            stream = tokenizer.stream(ids)  # tokens -> whole characters, continuing the prompt's
            with out_of_memory_explained(choice.mode):
                generate(model, ids, args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         seed=args.seed + index, use_cache=not args.no_cache,
                         vocab_limit=tokenizer.vocab_size, stop_tokens=stops,
                         on_token=lambda token: on_text(stream.push(token)), device=loaded.env.device,
                         rank0_tokens=choice.mode != "gathered")
            on_text(stream.flush() + "\n")

        world = loaded.env.world_size
        with runner as model:
            if choice.mode == "gathered" and world > 1 and len(prompts) > 1:
                # Every rank holds the whole model: each generates its share of the prompts (the
                # same tokens as anywhere else: the seed is the prompt's), rank 0 prints them in order.
                if main_rank:
                    log.info(f"generation: {len(prompts)} prompts split over {world} ranks")
                mine, failed = {}, None
                for index in range(loaded.env.rank, len(prompts), world):
                    try:
                        text, ids = render(prompts[index])
                        parts = [text]
                        run(model, index, ids, parts.append)
                    # A prompt too long, or any failure on this rank's own prompts (out of memory, a
                    # chat template that raises): every rank raises it below, none waits in the gather.
                    except Exception as exc:
                        failed = (index, str(exc) if isinstance(exc, ShardtrainError)
                                  else f"{type(exc).__name__}: {exc}")
                        break
                    mine[index] = "".join(parts)
                every: list = [None] * world
                all_gather_object(every, (mine, failed))
                errors = sorted(error for _, error in every if error is not None)
                # The prompts before the first that failed, each generated before its rank's first
                # failure, are shown first (found by review: a CUDA OOM on one prompt printed none)
                for index in range(errors[0][0] if errors else len(prompts)):
                    show(next(part[index] for part, _ in every if index in part))
                if errors:
                    raise GenerationError(f"prompt {errors[0][0] + 1}: {errors[0][1]}")
            else:  # one prompt, or unit by unit (every rank takes part in every forward)
                for index, prompt in enumerate(prompts):
                    text, ids = render(prompt)
                    # Before the prompt is shown: the error then starts a line of its own, and names
                    # the prompt as the split path's does.
                    try:
                        check_prompt(model, ids, args.max_new_tokens)
                    except GenerationError as exc:
                        named = f"prompt {index + 1}: {exc}" if len(prompts) > 1 else str(exc)
                        raise GenerationError(named) from exc
                    show(text)
                    run(model, index, ids, show)
    finally:
        destroy_distributed()
    return 0


def cmd_eval(args: argparse.Namespace, argv: list[str]) -> int:
    from shardtrain.config.strategy import normalize_strategy_name
    from shardtrain.generation.ranges import EVAL_RANGES, check_ranges

    check_ranges(args, EVAL_RANGES)  # argument errors surface here, before any process starts
    normalize_strategy_name(args.strategy, given_as="--strategy ")
    if not args.file and (given := [flag for flag, value in (("--glob", args.glob != "*"),
                                                              ("--text-field", args.text_field)) if value]):
        # They shape --file's reading: without it, the run's own held-out data (found by review)
        from shardtrain.errors import ConfigError

        one = len(given) == 1
        raise ConfigError(f"{' and '.join(given)} shape{'s' if one else ''} how --file is read, and no "
                          "--file is given (the run's held-out data is read as it trained); add --file, or "
                          f"drop {'it' if one else 'them'}")
    args.checkpoint = check_exists(args.checkpoint)
    if args.file and not any(ch in args.file for ch in "*?["):  # a glob pattern is matched later
        args.file = check_exists(args.file, "--file")
    from shardtrain.generation.inference import check_processes_for

    check_processes_for(Path(args.checkpoint), args.devices)  # before N processes start for nothing
    status = on_devices(args.devices, argv)
    if status is not None:
        return status
    import math

    from shardtrain.config.schema import DataConfig
    from shardtrain.data.batches import eval_batches
    from shardtrain.data.corpus import load_corpus, windows_of
    from shardtrain.data.documents import is_prepared_dataset
    from shardtrain.data.tokenizer import reads_bytes
    from shardtrain.distributed.env import destroy_distributed
    from shardtrain.errors import ConfigError, GenerationError
    from shardtrain.generation.inference import data_changed_since, load_for_inference
    from shardtrain.models.hf_directory import is_model_directory
    from shardtrain.tasks.language_model import LanguageModelTask
    from shardtrain.train.step import evaluate

    try:
        loaded = load_for_inference(args.checkpoint, args.strategy, args.dtype,
                                    verify_checksums=not args.skip_checksums, average=args.ema)
        # Where the run's own evaluations are repeated (its held-out split), as they scored it: the
        # fixed 256 x 128 defaults scored other windows than the val_loss it logged.
        # A checkpoint directory and a consolidated file record them (not a Hugging Face directory).
        run = {} if args.file or (args.seq_len is not None and args.samples is not None) else \
            loaded.eval_settings()
        if args.seq_len is None:
            args.seq_len = int(run.get("seq_len", EVAL_SEQ_LEN))
        if args.samples is None:
            args.samples = int(run.get("eval_samples", EVAL_SAMPLES))
        positions = getattr(loaded.model, "max_seq_len", None)
        if positions is not None and args.seq_len > positions:
            raise ConfigError(f"--seq-len {args.seq_len} exceeds the model's {positions} positions; "
                              f"use --seq-len {positions} or less")
        tokenizer = loaded.tokenizer()
        # Scored as the run's evaluations scored: a model trained on documents each attending
        # within itself is scored so (the loss of packed windows differs otherwise).
        mask = loaded.cfg.data.document_mask
        packing = loaded.cfg.data.packing  # windows of whole records for fine-tuning data, as training's
        if args.file and is_prepared_dataset(Path(args.file)):  # its validation split, as training reads it
            corpus = load_corpus(DataConfig(source="prepared", paths=[args.file]), tokenizer, need=("val",))
            windows = corpus.val_windows(args.seq_len, mask, what="evaluation data", packing=packing)
            source = f"validation split of {args.file}"
        elif args.file:
            # Records' text in the field the run's data named, unless --text-field names another
            # (found by review: the default 'text' alone, and the error's fix not taken here)
            field = args.text_field or loaded.cfg.data.text_field
            if Path(args.file).is_file():
                given = DataConfig(source="files", paths=[args.file], val_percent=0.0, file_glob="*",
                                   text_field=field)
                data = load_corpus(given, tokenizer, need=("train",)).train
            else:
                given = DataConfig(source="files", paths=[args.file], val_percent=100.0, file_glob=args.glob,
                                   text_field=field)
                data = load_corpus(given, tokenizer, need=("val",)).val
            # packed as the run's data were (found by a trial: a raw file of fine-tuning records was
            # cut anywhere, an answer scored without its prompt)
            windows = windows_of(data, args.seq_len, "evaluation data", mask, packing)
            source = args.file
        else:
            if not loaded.data_known:
                # (asked of the path, not compared with the config's resolved one: a relative path
                # was said to be an old shardtrain's file, found by review)
                hf_directory = is_model_directory(Path(args.checkpoint).expanduser())
                why = ("a Hugging Face model directory" if hf_directory else
                       "consolidated by an older shardtrain")
                raise ConfigError(f"{args.checkpoint} does not record the data its run trained on ({why}); "
                                  "name the text to score with --file")
            corpus = load_corpus(loaded.cfg.data, tokenizer)
            # a mixture's held-out windows interleaved, as training's evaluations read them
            windows = corpus.val_windows(args.seq_len, mask, what="evaluation data", packing=packing)
            source = f"held-out split of {corpus.root}"
            if loaded.env.is_main and (changed := data_changed_since(loaded.state, corpus)):
                log.warning(changed)
        # No micro-batch larger than the samples a rank scores: the padding of --batch-size 10^10
        # for 2 samples was allocated (a traceback), and a forward over it computed nothing.
        scored_here = -(-min(args.samples, windows.num_samples) // loaded.env.world_size)
        batches = eval_batches(windows, args.samples, min(args.batch_size, scored_here),
                               loaded.env.world_size, loaded.env.rank)
        task = LanguageModelTask()
        loss, _, scored = evaluate(loaded.model, task, batches, loaded.env.device)
        if not math.isfinite(loss) and scored:
            # It printed "loss nan" and exited 0 (found by review)
            raise GenerationError(f"{source}: the loss is {loss} (its weights hold NaN or inf, or its "
                                  "activations overflowed the compute dtype); check the checkpoint "
                                  "(shardtrain inspect), or evaluate in fp32 (--dtype fp32)")
        if scored == 0:  # a loss of nan, exit 0 before
            windows_scored = min(args.samples, windows.num_samples)
            raise ConfigError(f"{source}: the {windows_scored} windows scored hold no targets (fine-tuning "
                              "records whose prompts fill the windows); raise --seq-len or --samples")
        # Fine-tuning records score their answers only: the loss is per target, not per token read.
        masked = windows.targets_masked
        if loaded.env.is_main:
            n = (windows.inputs_in(args.samples) if hasattr(windows, "inputs_in")
                 else min(args.samples, windows.num_samples) * args.seq_len)  # a mixture's: whole windows
            unit = "byte" if reads_bytes(tokenizer) else "token"
            targets = (f", {scored:.0f} of them targets (the fine-tuning records' answers, which the loss "
                       "scores)" if masked else
                       # (found by review: the count read as the loss's, which is per target)
                       f", {scored:.0f} of them scored (no target across a document's end)"
                       if mask and scored != n else "")
            masked_documents = ", each document attending within itself (data.document_mask)" if mask else ""
            print(f"eval on {source}: {n} {unit}s in windows of {args.seq_len}{masked_documents}{targets}")
            unit = f"target {unit}" if masked else unit
            print(f"loss {loss:.4f} nats/{unit} | {loss / math.log(2):.4f} bits/{unit} | "
                  f"perplexity {math.exp(loss) if loss < 709.0 else math.inf:.3f} per {unit}")
    finally:
        destroy_distributed()
    return 0


def check_export_paths(args: argparse.Namespace, command: str) -> bool:
    """export-hf's and export-peft's paths, checked before torch is imported (a quoted ``~`` is
    expanded once, so that the path checked is the path written), the checkpoint's resolved; True
    where the export will make its output directory (``finish_export`` then removes it with its
    files)."""
    args.out, args.checkpoint = os.path.expanduser(args.out), os.path.expanduser(args.checkpoint)
    check_output(Path(args.out), Path(args.checkpoint), f"{command} output", file_allowed=False)
    check_exists(args.checkpoint, "checkpoint")
    # Resolved once: the export and its self-check read the same checkpoint, where a link a training
    # moves on between them (its checkpoints/best) failed the check of a good export (found by review)
    args.checkpoint = os.path.realpath(args.checkpoint)
    return not Path(args.out).exists()


def finish_export(args: argparse.Namespace, files: list[Path], verify, loaded_by: str, made: bool) -> int:
    """What every export does after writing: list the files, then run its self-check ``verify``
    (unless --no-verify) and say what it measured. Files the check fails (or that it cannot check)
    are removed, with ``args.out`` where the export ``made`` it: left whole, with config.json, they
    passed for a finished export, and blocked the export again that the message advised (found by
    review)."""
    from shardtrain.checkpoint.safetensors_files import remove_written
    from shardtrain.errors import CheckpointError
    from shardtrain.export.verify import EXPORT_TOLERANCE

    for file in files:
        print(file)
    if args.no_verify:
        return 0
    try:
        difference = verify(args.checkpoint, args.out)
    except BaseException as exc:  # Ctrl-C too: unchecked files would pass for an export, and block the next
        remove_written(Path(args.out), files, made)
        if isinstance(exc, CheckpointError):
            raise CheckpointError(f"{exc}; the export's files are removed (--no-verify writes them "
                                  "unchecked)") from exc
        raise
    print(f"verified: {loaded_by} logits match the checkpoint's, largest relative difference "
          f"{difference:.1e} (limit {EXPORT_TOLERANCE:.0e})")
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    made = check_export_paths(args, "export-hf")
    from functools import partial

    if args.merge:  # a LoRA checkpoint: each target's weight plus alpha/r * B @ A
        from shardtrain.errors import ConfigError
        from shardtrain.export.merge import export_merged, verify_merged_export

        if args.ema:
            raise ConfigError("export-hf --merge --ema: a LoRA run keeps no weight average "
                              "(trainer.ema_decay is refused with adapters); drop --ema")

        verified = not args.skip_checksums
        files = export_merged(args.checkpoint, args.out, args.max_shard_size, args.dtype, verified)
        return finish_export(args, files, partial(verify_merged_export, verify_checksums=verified),
                             "transformers'", made)
    from shardtrain.checkpoint import layout
    from shardtrain.export.hf import export_hf
    from shardtrain.export.verify import verify_export

    key = layout.AVERAGE_KEY if args.ema else None
    files = export_hf(args.checkpoint, args.out, args.max_shard_size, args.dtype, key=key,
                      verify_checksums=not args.skip_checksums)
    return finish_export(args, files, partial(verify_export, key=key), "transformers'", made)


def cmd_export_peft(args: argparse.Namespace) -> int:
    made = check_export_paths(args, "export-peft")
    from functools import partial

    from shardtrain.export.peft import export_peft, verify_peft_export

    verified = not args.skip_checksums
    return finish_export(args, export_peft(args.checkpoint, args.out, verified),
                         partial(verify_peft_export, verify_checksums=verified), "peft.PeftModel's", made)


MOST_RANKS = 1 << 20  # plan's world sizes: beyond any machine, within a process group's counts


def cmd_plan(args: argparse.Namespace) -> int:
    from shardtrain.config.sizes import parse_size
    from shardtrain.errors import ConfigError, LayoutError

    # Checked, not dropped: 0 read as "not given" planned the machine's own layout instead.
    for flag, values in (("--world-sizes", args.world_sizes or []),
                         ("--processes-per-node", [] if args.processes_per_node is None
                          else [args.processes_per_node])):
        if any(value < 1 for value in values):
            raise ConfigError(f"{flag} {' '.join(map(str, values))}: each must be at least 1")
        if any(value > MOST_RANKS for value in values):  # a ProcessGroup's int32: a TypeError traceback
            raise ConfigError(f"{flag} {' '.join(map(str, values))}: each must be at most {MOST_RANKS:,}")
    simulation_only = [flag for flag, given in (
        ("--strategies", args.strategies is not None), ("--ac", args.ac != "config"),
        ("--full-depth", args.full_depth), ("--markdown", args.markdown)) if given]
    if simulation_only and not args.simulate:
        raise ConfigError(f"{', '.join(simulation_only)} shape{'s' if len(simulation_only) == 1 else ''} "
                          "plan --simulate's cases; add --simulate (the formulas' table shows every "
                          "strategy, with and without checkpointing)")
    memory = parse_size(args.device_memory, "--device-memory") if args.device_memory is not None else None
    cfg = compose_checked(args.overrides)
    from shardtrain.checkpoint.peft_adapter import resolve_adapter_settings
    from shardtrain.cli.preflight import check_model_splits, check_wrap_policy
    from shardtrain.config.classpath import import_object
    from shardtrain.config.loader import check_runtime, planned_by_formulas
    from shardtrain.config.plan import launch_shape
    from shardtrain.diagnostics.planner import plan_table
    from shardtrain.tasks.task import task_from_config

    if args.processes_per_node:
        # The nodes planned for, not this machine's: the layout checks (a tensor-parallel group
        # within a node) are against them.
        cfg.trainer.devices = args.processes_per_node
    try:
        # The machines planned for may have what this one lacks; with --world-sizes each row says
        # whether its layout is possible there (a shard group or tensor-parallel degree that does
        # not fit the config's own world was refused for every row).
        check_runtime(cfg, runs_here=False, rows_judge_layouts=bool(args.world_sizes))
    except LayoutError as exc:
        # the layout against the world and node sizes (found by a review: told by its words, a
        # reshard group's refusal went without the hint)
        if args.processes_per_node or cfg.trainer.devices != "auto":
            raise
        # The layout checks judged this machine's processes (found by review: from a login node)
        raise ConfigError(f"{exc} (judged for this machine's {launch_shape(cfg)[0]} process(es) per "
                          "node; plan for other nodes with --processes-per-node N)") from exc
    # model.adapter's settings (its rank, its targets) as train takes them, and its refusals (found by
    # review: plan planned an adapter train refused, at the default rank)
    resolve_adapter_settings(cfg)
    per_node, world = launch_shape(cfg)
    local = args.processes_per_node or per_node
    language_model = planned_by_formulas(import_object(cfg.task.path, "task"), cfg.strategy.tensor_parallel)
    if language_model:  # the formulas would give figures for a split that cannot exist
        task = task_from_config(cfg)
        check_model_splits(cfg, task)
        check_wrap_policy(cfg, task)
    if not args.simulate and not language_model:
        split = (" split by the model's own tensor-parallel plan" if cfg.strategy.tensor_parallel > 1 else "")
        raise ConfigError(f"shardtrain plan's formulas know decoder language models{split} only; for "
                          f"task={cfg.task.path} use shardtrain plan --simulate (it runs the task's "
                          "model on its example batch, split as the run splits it)")
    if not args.simulate:
        sizes = args.world_sizes or sorted({1, 2, 4, 8, world})
        if list(cfg.strategy.wrap_policy) != ["auto"]:
            # The formulas know the model's own blocks as units; the simulation builds the run's own.
            print(f"note: the formulas take the model's blocks as FSDP units, not strategy.wrap_policy="
                  f"[{','.join(map(str, cfg.strategy.wrap_policy))}]; shardtrain plan --simulate shards "
                  "the model as that policy does")
        if cfg.strategy.activation_checkpointing in ("selective", "every_k"):
            # (found by review: the rows were those of none and all, the run's own mode unsaid)
            print(f"note: the table's activation checkpointing is none and all; strategy.activation_"
                  f"checkpointing={cfg.strategy.activation_checkpointing} lies between them: shardtrain plan "
                  "--simulate counts it")
        print(plan_table(cfg, sizes, memory, local))
        return 0

    from shardtrain.config.plan import normalize_strategy_name, resolve_precision
    from shardtrain.train.simulate import simulation_rows, simulation_table

    if cfg.trainer.micro_batch_size == "auto":
        raise ConfigError("shardtrain plan --simulate runs one micro-batch size: set "
                          "trainer.micro_batch_size=N (without --simulate, plan shows what auto would "
                          "choose at each world size)")

    strategies = [normalize_strategy_name(s) for s in args.strategies or [cfg.strategy.sharding_strategy]]
    checkpointing = {"both": ["none", "all"], "config": [cfg.strategy.activation_checkpointing]}.get(
        args.ac, [args.ac])
    rows = simulation_rows(cfg, args.world_sizes or [world], strategies, checkpointing, local,
                           probe=not args.full_depth)
    batch = (f"{cfg.trainer.micro_batch_size} x {cfg.trainer.seq_len} tokens" if language_model else
             f"{cfg.trainer.micro_batch_size} samples of task {cfg.task.path}")
    micro_batches = (f"the micro-batches trainer.global_batch_size={cfg.trainer.global_batch_size} gives "
                     "at each world size" if cfg.trainer.global_batch_size
                     else f"{cfg.trainer.grad_accum_steps} micro-batch(es)")
    print(f"simulated one training step of rank 0 (micro-batch {batch}, {micro_batches}, "
          f"{resolve_precision(cfg.strategy.mixed_precision, accelerated=True)}, {local} "
          f"process{'es' if local > 1 else ''} per node); GiB per rank, the planner's estimate in brackets")
    print(simulation_table(rows, memory, markdown=args.markdown))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from shardtrain.data.prepare import PrepareOptions, prepare
    from shardtrain.errors import ConfigError

    for wrong, flag, value, bound in ((args.workers < 1, "--workers", args.workers, "at least 1"),
                                      (not 0 <= args.val_percent <= 100, "--val-percent", args.val_percent,
                                       "between 0 and 100"),
                                      (args.max_bytes < 0, "--max-bytes", args.max_bytes, "not negative")):
        if wrong:
            raise ConfigError(f"{flag} {value} must be {bound}")
    from shardtrain.cli.paths import check_not_in_checkpoint

    check_not_in_checkpoint(Path(args.out), "prepare's output")  # keep_last would delete it with that
    options = PrepareOptions(inputs=args.inputs, tokenizer=args.tokenizer, text_field=args.text_field,
                             file_glob=args.glob, val_percent=args.val_percent,
                             max_bytes=args.max_bytes, workers=args.workers)
    result = prepare(options, args.out, progress=sys.stderr.isatty())
    splits = result.manifest["splits"]
    if result.up_to_date:
        print(f"{args.out}: up to date (prepared from the same inputs and tokenizer); nothing to do")
        return 0
    tokens = sum(s["tokens"] for s in splits.values())
    # By tokens: a split of empty documents is refused by training as one of none is
    if not splits["val"]["tokens"]:
        print(f"warning: {args.out} has no validation tokens (--val-percent {args.val_percent:g} of "
              f"{splits['train']['documents']} documents): training on it refuses to run without; "
              "prepare again with a larger --val-percent, or more inputs", file=sys.stderr)
    if not splits["train"]["tokens"]:  # said as the empty validation split is (found by a trial)
        print(f"warning: {args.out} has no training tokens (--val-percent {args.val_percent:g} held out "
              f"all {splits['val']['documents']} documents): training on it refuses to run; it serves as an "
              "evaluation set (shardtrain eval CKPT --file DIR), or prepare again with a smaller "
              "--val-percent", file=sys.stderr)
    print(f"{args.out}: {splits['train']['documents']:,} train + {splits['val']['documents']:,} validation "
          f"documents, {splits['train']['tokens']:,} + {splits['val']['tokens']:,} tokens "
          f"({result.manifest['dtype']}, tokenizer {result.manifest['tokenizer']['name']}) in "
          f"{result.seconds:.1f}s, {tokens / max(result.seconds, 1e-9):,.0f} tokens/s with "
          f"{args.workers} worker(s)")
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    args.out, args.checkpoint = os.path.expanduser(args.out), os.path.expanduser(args.checkpoint)
    check_output(Path(args.out), Path(args.checkpoint), "consolidate output")
    check_exists(args.checkpoint, "checkpoint")
    from shardtrain.export.consolidate import consolidate

    files = consolidate(args.checkpoint, args.out, args.max_shard_size, args.dtype, args.key,
                        verify=not args.skip_checksums)
    for file in files:
        print(file)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    args.path = check_exists(args.path)
    from shardtrain.checkpoint.inspect import inspect_path

    report = inspect_path(args.path)
    print(report.render())
    return 0 if report.complete else 1


def cmd_report(args: argparse.Namespace) -> int:
    from shardtrain.report.runs import check_run_dir

    for run_dir in args.run_dirs:  # answered before the plotting library's 2 s of imports
        check_run_dir(Path(run_dir))
    import matplotlib

    matplotlib.use("Agg")  # files only: never a display, whatever MPLBACKEND says
    from shardtrain.report.html import write_report

    report = write_report(args.run_dirs, args.out, args.png_dir)
    print(f"{report.html_path}: {len(report.runs)} run(s), {len(report.panels)} panels "
          f"({len(report.png_paths)} PNGs in {report.png_paths[0].parent})")
    return 0


# `eval`'s windows where no run's evaluation is repeated (--file, a Hugging Face directory).
EVAL_SAMPLES, EVAL_SEQ_LEN = 256, 128
SKIP_CHECKSUMS_HELP = ("do not check a checkpoint directory's recorded checksums before reading it "
                       "(they hash its model and optimizer shards, which DCP writes in one file a rank)")
EMA_HELP = ("the checkpoint's weight average (a run with trainer.ema_decay) instead of its weights; "
            "a checkpoint directory only")


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors as the framework's: one line and exit status 2, naming the command's help
    (its usage block ran to four to eight lines, the top level's for a subcommand's flag: found by a
    review). Subcommands' parsers are of this class too (argparse makes them of their parent's)."""

    def error(self, message: str) -> NoReturn:
        from shardtrain.config.suggest import closest

        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:  # a misspelt subcommand: its closest name
            options = re.findall(r"'([^']*)'", choice.group(2))
            message = f"{message}{closest(choice.group(1), options)}"
        self.exit(2, f"shardtrain: error: {message}; see {self.prog} --help\n")

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:  # noqa: ANN001 (argparse's)
        """argparse's, but arguments left over after a subcommand are that subcommand's error, naming
        its help (the top level raised it, naming ``shardtrain --help``: found by a review)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(parsed, "command", None)
            parser = self.subcommands().get(command, self)
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def subcommands(self) -> dict[str, argparse.ArgumentParser]:
        return {name: parser for action in self._actions if isinstance(action, argparse._SubParsersAction)
                for name, parser in action.choices.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="shardtrain",
        description="Train models with FSDP2. Every setting is a key=value override "
        "(see docs/configuration.md).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train a model (default: a small Llama on the Python standard library)",
        description="Examples: shardtrain train | shardtrain train trainer.devices=2 "
        "strategy=hybrid_shard | shardtrain train experiment=quick trainer.max_steps=50",
    )
    train.add_argument("overrides", nargs="*", help="key=value config overrides")

    prep = sub.add_parser(
        "prepare", help="raw text, JSON Lines, Parquet or a datasets directory -> a prepared dataset",
        description="Tokenizes every document once into memory-mappable token shards with a "
        "manifest (docs/data.md). The same output for any --workers; run again on unchanged inputs, "
        "it does nothing.")
    prep.add_argument("inputs", nargs="+", help="files, directories, glob patterns; .jsonl(.gz), "
                      ".parquet, a save_to_disk directory, or text files (one document each)")
    prep.add_argument("--out", required=True, help="the prepared dataset's directory")
    prep.add_argument("--tokenizer", default="bytes",
                      help="bytes (default), a tokenizer.json, or a Hugging Face model directory")
    prep.add_argument("--text-field", default="text", help="JSON field / column holding the text")
    prep.add_argument("--glob", default="*", help="files taken from input directories")
    prep.add_argument("--val-percent", type=float, default=5.0,
                      help="documents held out for validation, by a hash of their file and line")
    prep.add_argument("--max-bytes", type=int, default=0, help="stop after this much text (0 = all)")
    prep.add_argument("--workers", type=int, default=1, help="tokenizing processes")

    cons = sub.add_parser(
        "consolidate",
        help="sharded checkpoint -> model-only safetensors (streamed: one file or shards, 256 MiB in memory)",
        description="Reads shardtrain, Lightning (meta.pt + .metadata + *.distcp) and plain DCP "
        "checkpoints. OUT ending in .safetensors: one file; otherwise a directory with "
        "model.safetensors, or HF-style shards + model.safetensors.index.json with --max-shard-size.",
    )
    cons.add_argument("checkpoint", help="checkpoint directory (the one holding .metadata)")
    cons.add_argument("out", help="output .safetensors file or directory")
    cons.add_argument("--max-shard-size", default=None, help="e.g. 5GB, 500MB (default: one file)")
    cons.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                      help="cast weights (default: as saved)")
    cons.add_argument("--skip-checksums", action="store_true",
                      help="do not verify the checkpoint's recorded file checksums first")
    cons.add_argument("--key", default=None,
                      help="top-level key holding the weights (default: state_dict. for Lightning, "
                      "else model.)")

    gen = sub.add_parser(
        "generate", help="generate text from a checkpoint (sharded at any world size, or safetensors)",
        description="Weights are gathered once for the whole generation (any strategy, FULL_SHARD "
        "included) when they fit the device, else the sharded model runs unit by unit (--mode); "
        "output streams as it is generated.",
    )
    gen.add_argument("checkpoint", help="checkpoint directory, or a consolidated .safetensors file")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt")
    source.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate after each prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = no nucleus filter")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i)")
    gen.add_argument("--no-cache", action="store_true", help="recompute the whole context per token")
    gen.add_argument("--chat", action="store_true",
                     help="each prompt is a user message, rendered with the tokenizer's chat template")
    gen.add_argument("--devices", type=int, default=1, help="processes (sharded checkpoints)")
    gen.add_argument("--strategy", default="FULL_SHARD", help="how the checkpoint is sharded on load")
    gen.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                     help="compute dtype; auto: bf16 on accelerators with bf16 units, fp32 on CPUs")
    gen.add_argument("--skip-checksums", action="store_true", help=SKIP_CHECKSUMS_HELP)
    gen.add_argument("--ema", action="store_true", help=EMA_HELP)
    gen.add_argument("--mode", default="auto", choices=["auto", "gathered", "sharded"],
                     help="gathered: one copy of the model, no collectives per token; sharded: each "
                     "unit all-gathered per token; auto: gathered when it fits the free memory")

    ev = sub.add_parser("eval", help="validation loss and perplexity of a checkpoint")
    ev.add_argument("checkpoint", help="checkpoint directory, or a consolidated .safetensors file")
    ev.add_argument("--file", default=None, help="a file or directory to evaluate on, or a prepared "
                    "dataset's validation split (default: the held-out split of the checkpoint's "
                    "training data)")
    ev.add_argument("--glob", default="*", help="files to take from a --file directory")
    ev.add_argument("--text-field", default=None, help="JSON field / column holding the text of --file's "
                    "records (default: the run's data.text_field)")
    ev.add_argument("--samples", type=int, default=None,
                    help="windows to evaluate (default: the checkpoint's trainer.eval_samples, so "
                    f"that the loss on its held-out split is the val_loss it logged; else {EVAL_SAMPLES})")
    ev.add_argument("--seq-len", type=int, default=None,
                    help=f"tokens per window (default: the checkpoint's trainer.seq_len; else "
                    f"{EVAL_SEQ_LEN})")
    ev.add_argument("--batch-size", type=int, default=8, help="windows per forward on each process")
    ev.add_argument("--devices", type=int, default=1, help="processes (sharded checkpoints)")
    ev.add_argument("--strategy", default="FULL_SHARD", help="how the checkpoint is sharded on load")
    ev.add_argument("--skip-checksums", action="store_true", help=SKIP_CHECKSUMS_HELP)
    ev.add_argument("--ema", action="store_true", help=EMA_HELP)
    ev.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                     help="compute dtype; auto: bf16 on accelerators with bf16 units, fp32 on CPUs")

    hf = sub.add_parser("export-hf", help="checkpoint -> Hugging Face model directory",
                        description="config.json + safetensors (with index) + tokenizer that transformers' "
                        "AutoModelForCausalLM.from_pretrained loads: the built-in model as a Llama, "
                        "a model=hf run as its own architecture.")
    hf.add_argument("checkpoint", help="checkpoint directory, or a consolidated .safetensors file")
    hf.add_argument("out", help="output directory")
    hf.add_argument("--max-shard-size", default="2GB",
                    help="largest safetensors file; bigger models are split, with an index (e.g. 5GB)")
    hf.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                    help="floating-point weights cast to it (default: as stored in the checkpoint)")
    hf.add_argument("--no-verify", action="store_true",
                    help="skip the check that transformers reproduces the checkpoint's logits")
    hf.add_argument("--merge", action="store_true",
                    help="a finetune=lora checkpoint: write the merged model (each target's weight plus "
                    "alpha/r * B @ A), checked against the checkpoint's model with its adapters")
    hf.add_argument("--ema", action="store_true", help=EMA_HELP)
    hf.add_argument("--skip-checksums", action="store_true", help=SKIP_CHECKSUMS_HELP)

    pe = sub.add_parser("export-peft", help="LoRA checkpoint -> PEFT adapter directory",
                        description="adapter_config.json + adapter_model.safetensors that "
                        "peft.PeftModel.from_pretrained(base, OUT) loads onto the transformers base.")
    pe.add_argument("checkpoint", help="checkpoint directory of a finetune=lora run")
    pe.add_argument("out", help="output directory")
    pe.add_argument("--no-verify", action="store_true",
                    help="skip the check that PEFT's model reproduces the checkpoint's logits")
    pe.add_argument("--skip-checksums", action="store_true", help=SKIP_CHECKSUMS_HELP)

    plan = sub.add_parser(
        "plan", help="estimate per-rank memory for each strategy and world size",
        description="Same key=value overrides as train. Parameters, gradients and optimizer state are "
        "exact for FSDP2's layout; activations and communication buffers are estimates "
        "(docs/memory-planner.md).",
    )
    plan.add_argument("overrides", nargs="*", help="key=value config overrides")
    plan.add_argument("--device-memory", default=None, help="memory per device, e.g. 80GB")
    plan.add_argument("--world-sizes", type=int, nargs="+", default=None,
                      help="world sizes to show (default 1 2 4 8 and the config's; with --simulate, "
                      "the config's)")
    plan.add_argument("--processes-per-node", type=int, default=None,
                      help="processes per node planned for: the hybrid strategies' shard group, the "
                      "tensor-parallel node checks, and the config's world size (default: trainer.devices)")
    plan.add_argument("--simulate", action="store_true",
                      help="run one training step per case at the real world size in this process "
                      "(fake process group, fake tensors, FSDP2's memory tracker; docs/scaling.md)")
    plan.add_argument("--strategies", nargs="+", default=None,
                      help="with --simulate: strategies to simulate (default: the config's)")
    plan.add_argument("--ac", choices=["config", "none", "selective", "all", "both"], default="config",
                      help="with --simulate: activation checkpointing of the cases (default: the config's)")
    plan.add_argument("--full-depth", action="store_true",
                      help="with --simulate: simulate every layer instead of two probe depths")
    plan.add_argument("--markdown", action="store_true", help="with --simulate: a markdown table")

    rep = sub.add_parser(
        "report", help="plot runs: losses, throughput, memory, data wait, gradients, checkpoints",
        description="One self-contained HTML page (no network needed to view it) and a PNG per "
        "panel, from each run directory's metrics.jsonl and config.yaml; several runs are overlaid "
        "with their config differences listed. Works on a running or resumed run (docs/report.md).")
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run.dir of each training run")
    rep.add_argument("--out", default="report.html", help="the HTML file to write (default report.html)")
    rep.add_argument("--png-dir", default=None,
                     help="where the PNGs go (default: <out without .html>_files/ beside the page)")

    insp = sub.add_parser("inspect", help="describe a checkpoint and check that it is whole",
                          description="Exit status 0 when complete with no problem found, 1 when "
                          "incomplete or damaged, 2 when the path is no checkpoint at all.")
    insp.add_argument("path", help="checkpoint directory, .safetensors file or index .json")
    return parser


def overrides_first(argv: list[str]) -> list[str]:
    """``plan``'s key=value overrides moved before its options: ``--world-sizes`` and
    ``--strategies`` take several values and swallowed the overrides after them (``--world-sizes 2
    trainer.seq_len=4096`` was "invalid int value"), and overrides after another option were
    unrecognised. No value of plan's options holds a '='."""
    command = next((i for i, token in enumerate(argv) if not token.startswith("-")), None)
    if command is None or argv[command] != "plan":
        return argv
    # A stable sort: the overrides first, each group in its own order.
    rest = sorted(argv[command + 1:], key=lambda token: "=" not in token or token.startswith("-"))
    return [*argv[:command + 1], *rest]


def main(argv: list[str] | None = None) -> int:
    argv = overrides_first(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        return run_command(args, argv)
    finally:
        # The command's objects (models, process groups held by DeviceMeshes and the checkpointer)
        # are garbage now; free them while the interpreter is whole. Left to finalisation, gloo's
        # worker threads can abort the process ("terminate called without an active exception").
        gc.collect()


def run() -> NoReturn:
    """The ``shardtrain`` command's process (``python -m shardtrain``, every worker torchrun starts):
    ``main``, then an exit that skips finalisation's collections."""
    # A standard output that is not UTF-8 (PYTHONIOENCODING=ascii, a Latin-1 locale) gets "?" for a
    # character it cannot hold: generated text or a path ended the command in a UnicodeEncodeError
    # traceback (found by review)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    status = main()
    # main has collected the command's garbage. What is still alive (torch's and the model's
    # objects) dies with the process; left tracked, finalisation walks it in several full
    # collections: 0.7 s a worker of even a tiny model, paid by every process of every run.
    gc.freeze()
    sys.exit(status)


def run_command(args: argparse.Namespace, argv: list[str] | None) -> int:
    try:
        if args.command == "train":
            return cmd_train(args.overrides)
        if args.command == "consolidate":
            return cmd_consolidate(args)
        if args.command == "prepare":
            return cmd_prepare(args)
        if args.command == "inspect":
            return cmd_inspect(args)
        if args.command == "report":
            return cmd_report(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "export-hf":
            return cmd_export_hf(args)
        if args.command == "export-peft":
            return cmd_export_peft(args)
        if args.command == "generate":
            return cmd_generate(args, list(argv if argv is not None else sys.argv[1:]))
        if args.command == "eval":
            return cmd_eval(args, list(argv if argv is not None else sys.argv[1:]))
    except ShardtrainError as exc:
        say(error_line(str(exc)))
        return 2
    except BrokenPipeError as exc:
        if not stdout_reader_gone():  # another pipe's (a worker's, a socket's): a failure to say
            say(error_line(os_failure(exc) or str(exc)))
            return 1
        # `shardtrain inspect X | head`: the reader has gone, and so do we, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return BROKEN_PIPE_STATUS
    except KeyboardInterrupt:
        say(INTERRUPTED + (RESUMES if args.command == "train" else ""))
        return 130
    except Exception as exc:
        # A full disk or a read-only path is one line, as the framework's own errors are; anything
        # else is a bug, and its traceback is what finds it.
        if (line := os_failure(exc)) is None:
            raise
        say(error_line(line))
        return 1
    return 1


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (a broken pipe that ends a command
    quietly, as ``| head`` expects); a broken pipe elsewhere is a failure (found by review)."""
    poller = select.poll()
    try:
        poller.register(sys.stdout.fileno(), select.POLLOUT)
    except (OSError, ValueError, AttributeError):  # no descriptor (a capture): not a closed pipe
        return False
    return any(events & select.POLLERR for _, events in poller.poll(0))


def say(line: str) -> None:
    """``line`` on stderr in one write: print's two (the text, then the newline) interleaved with
    the peers' when every rank of ``--devices N`` failed at once, and the launcher's one error line
    was two ranks' run together (found by review)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def error_line(message: str) -> str:
    """A command's last line for an error. A worker of a multi-process world names its rank: the
    launcher (and whoever reads the log) tells the first failure's line from its peers' by it."""
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK")
    tag = f"[rank {rank}] " if rank is not None and world.isdigit() and int(world) > 1 else ""
    return f"shardtrain: error: {tag}{message}"
