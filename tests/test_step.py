"""The training step's own contract at 2 real gloo ranks: a stop request from one rank reaches
every rank through the step's loss all-reduce, and a step with no target tokens fails on all ranks
together (both now decided at the step's one host synchronisation), and that synchronisation is the
step's only read of a tensor's value by the host besides the embedding exchange's split sizes."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from distributed import run_on_ranks
from omegaconf import OmegaConf
from step_workers import agreement_and_empty_steps

from shardtrain.checkpoint.state import TrainState
from shardtrain.config.plan import resolve_plan
from shardtrain.config.schema import Config, StrategyConfig
from shardtrain.distributed.parallelize import ShardingReport
from shardtrain.errors import TrainingError
from shardtrain.tasks.task import LossOutput, Task
from shardtrain.train.loop import Trainer, TrainResult, precision_cautions, root_unit_caution
from shardtrain.train.metrics import MetricsWriter, Throughput
from shardtrain.train.optim import SCHEDULE_SHAPE, build_scheduler, follow_schedule, lr_factor
from shardtrain.train.step import StepStats, check_metric_names, count_ahead, local_flops, run_loss


def test_one_ranks_stop_request_reaches_all_and_empty_steps_are_skipped_everywhere(tmp_path):
    run_on_ranks(agreement_and_empty_steps, 2, str(tmp_path), tmp_path=tmp_path)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["signalled"] is True, (rank, result)  # only the last rank asked
        assert result["quiet"] is False, (rank, result)
        # a step without targets on any rank is skipped on every rank, the weights as they were
        assert result["empty"] == {"skipped": True, "count": 0.0, "unchanged": True}, (rank, result)
        # docs/metrics.md: one host synchronisation per step (the old step read twice), after the
        # update is queued (fused AdamW skips a non-finite step on the device; it read before), and
        # one in each micro-batch's forward where the embedding exchanges rows: its split sizes
        assert result["host_reads"] == ["tolist", "optimizer.step", "tolist"], (rank, result["host_reads"])
        assert result["host_resident_reads"] > 0  # the filter above saw what it filters
        # a micro-batch's count below 0 in a positive total divided the step by a wrong count (review)
        assert result["negative"].startswith("NegativeOnFirstRank.loss returned a count below 0 in 1 "
                                             "micro-batch(es) of the step, their total "), result["negative"]
        assert result["negative_unchanged"] is True
        one_rank = result["one_rank"]
        assert one_rank["CountNoneOnLastRank"] == (
            "TrainingError: CountNoneOnLastRank.count(batch) returned None; a task that defines count() must "
            "give every batch's count (or not define it)"), (rank, one_rank)
        assert one_rank["FlopsFailOnFirstRank"] == (
            "KeyError: 'tokens'" if rank == 0 else "ShardtrainError: KeyError on rank 0: 'tokens'"), \
            (rank, one_rank)
        assert one_rank["CountAndLossFail"] == (
            "TrainingError: CountAndLossFail.count(batch) returned None; a task that defines count() must "
            "give every batch's count (or not define it)"), (rank, one_rank)
        assert one_rank["CountAndLossFail notes"] == [
            "the loss on the same batches then failed too: KeyError: 'labels'"], (rank, one_rank)
        assert one_rank["unchanged"] is True


class TokenCounting(Task):
    count_unit = "tokens"


def bare_trainer(cfg: Config | None = None) -> Trainer:
    """A Trainer holding only what the logging and resume bookkeeping read (no model, no ranks)."""
    trainer = Trainer.__new__(Trainer)
    trainer.cfg = cfg or Config()
    trainer.env = SimpleNamespace(is_main=False, device=torch.device("cpu"))
    trainer.throughput = Throughput("tokens", 1, None)
    trainer.task = TokenCounting()
    trainer.layout = SimpleNamespace(global_batch=2)
    trainer.train_data = SimpleNamespace(wait_s=0.0)
    trainer.result = TrainResult()
    trainer.interval_loss_sum = trainer.interval_count = trainer.count_total = 0.0
    trainer.interval_metrics = {}
    trainer.consecutive_skips = 0
    trainer.step = 0
    trainer.writer = MetricsWriter(Path(), enabled=False)
    trainer.metric_kinds = (("accuracy", True), ("errors", False))
    scheduler = SimpleNamespace(get_last_lr=lambda: [1e-3], base_lrs=[3e-3, 3e-3])
    optimizer = SimpleNamespace(param_groups=[{"lr": 3e-4}])
    trainer.built = SimpleNamespace(scheduler=scheduler, optimizer=optimizer,
                                    plan=SimpleNamespace(precision="fp32"))
    return trainer


def test_the_logged_loss_and_metrics_are_means_over_the_intervals_counts():
    """docs/metrics.md: the loss per target token over the interval, not a mean of the steps' means;
    a skipped step counts in neither, and a (sum, count) metric with count 0 in one step is not NaN."""
    trainer = bare_trainer()
    steps = [StepStats(2.0, 1.0, 10.0, False, metric_sums={"accuracy": (3.0, 4.0), "errors": (5.0, 10.0)}),
             StepStats(float("nan"), float("nan"), 10.0, True,
                       metric_sums={"accuracy": (float("nan"), 4.0), "errors": (float("nan"), 10.0)}),
             StepStats(1.0, 1.0, 30.0, False, metric_sums={"accuracy": (0.0, 0.0), "errors": (3.0, 30.0)})]
    for stats in steps:
        trainer.step += 1
        trainer.account(stats)
    record = trainer.train_record(steps[-1])
    assert record["loss"] == pytest.approx((2.0 * 10 + 1.0 * 30) / 40)  # the skipped step left out
    assert record["accuracy"] == pytest.approx(3 / 4) and record["errors"] == pytest.approx(8 / 40)
    assert trainer.result.skipped_steps == 1
    # the next interval starts empty: a record of skipped steps alone has no mean
    trainer.account(steps[1])
    skipped_only = trainer.train_record(steps[1])
    assert all(math.isnan(skipped_only[name]) for name in ("loss", "accuracy", "errors"))
    # A step with nothing to learn from is skipped, not an error (found by review: it raised, and a
    # resume replayed the same batch); more than max_skipped_steps of them in a row stop the run
    trainer.account(steps[0])
    empty = StepStats(float("nan"), float("nan"), 0.0, True)
    for _ in range(trainer.cfg.trainer.max_skipped_steps):
        trainer.account(empty)
    # (a task's own is told of its count, not of fine-tuning windows: found by a trial)
    with pytest.raises(TrainingError, match=r"consecutive steps had no tokens to learn from \(limit "
                                            r"trainer.max_skipped_steps=5\): TokenCounting.loss returned a "
                                            r"count of 0 for every micro-batch"):
        trainer.account(empty)
    # every field a record has of its own is one a metric may not take
    own = set(record) - {"accuracy", "errors"}
    # the count so far sums the steps' counts unrounded (found by review: a weighted count of 0.3 a
    # step, each rounded, added nothing)
    weighted = bare_trainer()
    for _ in range(10):
        weighted.account(StepStats(1.0, 1.0, 0.3, False))
    assert weighted.result.count_seen == 3
    assert own | {"step", "kind", "time", "val_loss", "ema_val_loss"} <= trainer.record_fields()


@pytest.mark.parametrize("names", [["loss"], ["tokens_per_s"], ["mfu"], ["acc", "val_acc"],
                                   ["acc", "ema_val_acc"], ["loss_avg", "ema_val_loss"]])
def test_a_metric_named_like_a_record_field_is_refused(names):
    fields = bare_trainer().record_fields()
    with pytest.raises(TrainingError, match="named like fields of the metrics record"):
        check_metric_names(Returns(None), tuple((name, False) for name in names), fields)
    check_metric_names(Returns(None), (("accuracy", True), ("val", False)), fields)


class Returns:
    """A task whose loss returns ``out`` (run_loss reads ``loss`` and the class name only)."""

    def __init__(self, out):
        self.out = out

    def loss(self, model, batch):
        return self.out


WEIGHT = torch.ones(3, requires_grad=True)


@pytest.mark.parametrize(("out", "message"), [
    (LossOutput(WEIGHT.sum(), torch.ones(3)), "Returns.loss returned a count as a tensor of shape [3]; "
                                               "return the micro-batch's total count"),
    (LossOutput(WEIGHT.sum(), 3, {"acc": [1, 3]}), "Returns.loss returned metric 'acc' as list; return"),
    (LossOutput(WEIGHT.sum(), 3, {"acc": (torch.ones(2), 3)}), "metric 'acc' with a sum as a tensor of "
                                                                "shape [2]"),
    (LossOutput(WEIGHT.sum().detach(), 3), "Returns.loss returned a loss that does not require grad"),
    # found by review: an AttributeError of NoneType
    (LossOutput(WEIGHT.sum(), 3, None), "Returns.loss returned metrics as NoneType; return a dict"),
])
def test_bad_loss_output_values_are_one_line_naming_the_task(out, message):
    with pytest.raises(TrainingError, match=message.replace("[", r"\[").replace("]", r"\]")):
        run_loss(Returns(out), None, None, training=True)


def test_good_loss_output_values_pass():
    good = LossOutput(WEIGHT.sum(), torch.tensor([3]), {"acc": (torch.tensor(1.0), 3), "x": 2.0})
    out = run_loss(Returns(good), None, None, training=True)
    assert out.loss is good.loss and out.count is good.count  # plain values pass as they are
    assert out.metrics == {"acc": good.metrics["acc"], "x": 2.0}
    # evaluation runs without gradients
    assert run_loss(Returns(LossOutput(WEIGHT.sum().detach(), 3)), None, None) is not None


class Counts:
    """A task whose count(batch) returns ``value``."""

    def __init__(self, value):
        self.value = value

    def count(self, batch):
        return self.value


def test_a_count_ahead_is_one_number_or_one_line_naming_the_task():
    assert [count_ahead(Counts(value), None) for value in (3, 2.5, torch.tensor([4]), np.int64(5))] == [
        3.0, 2.5, 4.0, 5.0]
    for value, found in ((None, "None; a task that defines count() must give every batch's count"),
                         (torch.ones(2), "a tensor of shape [2]; return the micro-batch's total count"),
                         ("7", "str; return")):
        with pytest.raises(TrainingError, match="^" + re.escape(f"Counts.count(batch) returned {found}")):
            count_ahead(Counts(value), None)
    # below 0 it would divide the gradients into an ascent of the loss (found by review)
    with pytest.raises(TrainingError, match=r"^Counts.count\(batch\) returned -2; a count is what the loss "):
        count_ahead(Counts(-2), None)
    # a task's own flops(batch): a number of at least 0 (text was a TypeError from the sum)
    flops = Task.__new__(type("CountsFlops", (Task,), {"flops": lambda self, batch: batch}))
    assert local_flops(flops, [2.0, 3, torch.tensor(4.0)], None) == 9.0  # a one-element tensor too
    for wrong in (None, "1e9", -1.0, True, math.nan, math.inf):
        with pytest.raises(TrainingError, match=rf"^CountsFlops.flops returned {re.escape(repr(wrong))}: "):
            local_flops(flops, [wrong], None)


def test_a_resume_names_the_schedule_settings_it_does_not_follow():
    cfg = Config()
    saved = {key: getattr(cfg.trainer, key) for key in ("lr", *SCHEDULE_SHAPE)}
    assert bare_trainer(cfg).schedule_changes(saved) == []
    assert bare_trainer(cfg).schedule_changes({}) == []  # an older checkpoint without the keys
    cfg.trainer = dataclasses.replace(cfg.trainer, lr=1e-3, max_steps=cfg.trainer.max_steps * 2)
    trainer = bare_trainer(cfg)
    trainer.step = 2
    lr_change, schedule_change = trainer.schedule_changes({**saved, "lr": 3e-3})
    assert lr_change == ("trainer.lr 0.003 -> 0.001: the resumed run keeps the checkpoint's base learning "
                         "rate 0.003; start a new run to change it")
    assert schedule_change.startswith(f"trainer.max_steps {saved['max_steps']} -> {cfg.trainer.max_steps}: "
                                      "the schedule follows the new values from step 3 on")
    # Saved with lr 0.001 by a run that kept its checkpoint's 0.003, resumed with 0.003: no change in
    # effect, none named (a new-user trial was told of a change from 0.001, a rate never used)
    cfg.trainer = dataclasses.replace(Config().trainer, lr=3e-3)
    assert bare_trainer(cfg).schedule_changes({**saved, "lr": 1e-3}, asked_lrs=[3e-3, 3e-3]) == []
    assert bare_trainer(cfg).schedule_changes({**saved, "lr": 1e-3}, asked_lrs=[1e-3, 1e-3])  # a change
    # the decay's shape and share too: a warmup-stable-decay run extended with a new decay
    cfg.trainer = dataclasses.replace(Config().trainer, lr_decay="linear", decay_fraction=0.2)
    (shape_change,) = bare_trainer(cfg).schedule_changes(saved)
    older = {key: value for key, value in saved.items() if key not in ("lr_decay", "decay_fraction")}
    assert bare_trainer(cfg).schedule_changes(older) == [shape_change]  # saved before the keys existed
    assert shape_change.startswith("trainer.lr_decay 'cosine' -> 'linear', "
                                   "trainer.decay_fraction 1.0 -> 0.2: ")


def test_a_resume_runs_its_next_step_at_the_changed_schedules_rate():
    """The optimizer's saved rate is the checkpoint's schedule's for the next step: follow_schedule
    puts the new schedule's there (a review measured step 6 at the old rate, step 7 at the new)."""
    saved_cfg = dataclasses.replace(Config().trainer, lr=1.0, warmup_steps=10, max_steps=20)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=saved_cfg.lr)
    scheduler = build_scheduler(optimizer, saved_cfg)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    saved = optimizer.state_dict(), scheduler.state_dict()
    for cfg in (saved_cfg, dataclasses.replace(saved_cfg, warmup_steps=0)):
        optimizer = torch.optim.AdamW([param], lr=cfg.lr)
        scheduler = build_scheduler(optimizer, cfg)
        optimizer.load_state_dict(saved[0])
        scheduler.load_state_dict(saved[1])
        assert optimizer.param_groups[0]["lr"] == 0.6  # the saved schedule's rate for step 6
        follow_schedule(scheduler)
        expected = lr_factor(5, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio, cfg.lr_decay,
                             cfg.decay_fraction)
        assert optimizer.param_groups[0]["lr"] == expected
        assert (expected == 0.6) == (cfg is saved_cfg), expected  # unchanged: the same rate, exactly


def test_a_resume_says_each_changed_setting_once_and_nothing_when_none_changed():
    cfg = Config()
    saved = TrainState(step=4, tokens_seen=0, consumed_samples=8, global_batch=2, scheduler={},
                       world_size=1, strategy="FULL_SHARD", mesh_shape=[1], mesh_dim_names=["shard"],
                       mixed_precision="fp32", config=OmegaConf.to_container(OmegaConf.structured(cfg)),
                       config_hash="", versions={}, saved_at="", train_samples=100)
    trainer = bare_trainer(cfg)
    trainer.train_data = SimpleNamespace(windows=SimpleNamespace(num_samples=100))
    trainer.step = 4
    assert trainer.resume_changes(saved, asked_lrs=[3e-3, 3e-3]) == []
    changed = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, seed=cfg.trainer.seed + 1,
                                                                   warmup_steps=cfg.trainer.warmup_steps + 5),
                                  finetune=dataclasses.replace(cfg.finetune, alpha=cfg.finetune.alpha * 2))
    trainer = bare_trainer(changed)
    trainer.train_data = SimpleNamespace(windows=SimpleNamespace(num_samples=90))
    trainer.step = 4
    order, schedule, adapters = trainer.resume_changes(saved, asked_lrs=[3e-3, 3e-3])
    assert order.startswith("the data order differs from the checkpoint's (trainer.seed "
                            f"{cfg.trainer.seed} -> {cfg.trainer.seed + 1}; training samples 100 -> 90 "
                            "(the data changed since the save))")
    assert schedule.startswith("the learning-rate schedule differs from the checkpoint's "
                               "(trainer.warmup_steps")
    assert adapters.startswith("the adapters' settings differ from the checkpoint's (finetune.alpha ")
    assert "from step 5 on" in adapters
    # Found by a review of resumes with changes: these changed what the run computes without a word
    # (the optimizer's settings were even ignored: the load put the saved ones back).
    changed = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, rope_theta=5e5),
                                  trainer=dataclasses.replace(cfg.trainer, weight_decay=0.01))
    trainer = bare_trainer(changed)
    trainer.train_data = SimpleNamespace(windows=SimpleNamespace(num_samples=100))
    trainer.step = 4
    trainer.layout = SimpleNamespace(global_batch=4)
    trainer.built.plan.precision = "bf16-pure"
    model, precision, batch, optimizer = trainer.resume_changes(saved, asked_lrs=[3e-3, 3e-3])
    assert model.startswith("the model's settings differ from the checkpoint's (model.rope_theta 10000.0 -> "
                            "500000.0)")
    assert precision == ("the precision differs from the checkpoint's (fp32 -> bf16-pure): its weights and "
                         "optimizer state are read into bf16 (stored in fp32 before)")
    assert batch.startswith("the global batch differs from the checkpoint's (2 -> 4 samples a step)")
    assert optimizer.startswith("the optimizer's settings differ from the checkpoint's (trainer.weight_decay "
                                "0.1 -> 0.01)")
    other = dataclasses.replace(cfg.model, tokenizer="other/tokenizer.json")
    trainer.cfg = dataclasses.replace(cfg, model=other)
    trainer.layout, trainer.built.plan.precision = SimpleNamespace(global_batch=2), "fp32"
    [order] = trainer.resume_changes(saved, asked_lrs=[3e-3, 3e-3])
    assert "model.tokenizer 'auto' -> 'other/tokenizer.json'" in order, order
    # The same setting, and a tokenizer edited or replaced there since the save (found by review:
    # unsaid); a checkpoint from before the record holds none
    trainer.cfg, trainer.tokenizer_name = cfg, "tokenizers:0123456789abcdef"
    assert trainer.resume_changes(saved, asked_lrs=[3e-3, 3e-3]) == []
    [edited] = trainer.resume_changes(dataclasses.replace(saved, tokenizer="tokenizers:fedcba9876543210"),
                                      asked_lrs=[3e-3, 3e-3])
    assert edited.startswith("the tokenizer differs from the checkpoint's (tokenizers:fedcba9876543210 -> "
                             "tokenizers:0123456789abcdef): the model's token ids stand for other"), edited
    # Another torch release (the GPU machines' 2.11 and the CPU's 2.13 share checkpoints); another
    # build or patch of the same release says nothing
    trainer.cfg = cfg
    this = torch.__version__.split("+")[0].split(".")
    for version, said in ((f"{this[0]}.{this[1]}.9+cu130", False), (f"{this[0]}.{int(this[1]) - 1}.0", True)):
        saved.versions = {"torch": version}
        told = trainer.resume_changes(saved, asked_lrs=[3e-3, 3e-3])
        assert told == ([f"the checkpoint was saved under torch {version}, this run has {torch.__version__}: "
                         "Distributed Checkpoint promises no compatibility across torch releases; it loaded, "
                         "and the first steps' loss should go on from the saved run's"] if said else []), told
    # A mixture's block order is NumPy's Generator.permutation, not promised across NumPy releases
    # (found by review of mixtures): another release is said for a mixture, not for one dataset
    import numpy as np

    from shardtrain.data.batches import MixtureWindows

    part = SimpleNamespace(seq_len=8, num_samples=50, sample_kind="windows")
    older = f"{np.__version__.split('.')[0]}.{int(np.__version__.split('.')[1]) + 1}.0"
    saved.versions = {"numpy": older}
    assert trainer.resume_changes(saved, asked_lrs=[3e-3, 3e-3]) == []  # one dataset
    trainer.train_data = SimpleNamespace(windows=MixtureWindows([part, part], [1.0, 1.0]))
    [numpy] = trainer.resume_changes(saved, asked_lrs=[3e-3, 3e-3])
    assert numpy.startswith(f"the checkpoint was saved under NumPy {older}, this run has {np.__version__}: "
                            "a mixture's order within each block"), numpy
    saved.versions = {"numpy": np.__version__}
    assert trainer.resume_changes(saved, asked_lrs=[3e-3, 3e-3]) == []


def test_bf16_reductions_and_weights_are_said_at_start_up():
    """From a review of the seeds' rules: bf16-pure (bf16 reductions, no fp32 master weights) and a
    bf16 reduce_dtype were taken without a word. LoRA's fp32 adapters on a bf16 base are not bf16
    weights that train; one rank reduces nothing."""
    from torch import nn

    pure = resolve_plan(StrategyConfig(mixed_precision="bf16-pure"), 2, 2)
    model = nn.Linear(4, 4).to(torch.bfloat16)
    reduce, weights = precision_cautions(model, pure, 2)
    assert reduce.startswith("gradients are reduced in bf16 over 2 data-parallel ranks")
    assert weights.startswith("trainable weights are stored in bf16 (no fp32 master weights)")
    assert precision_cautions(model, pure, 1) == [weights]
    model.weight.requires_grad_(False)
    model.bias.requires_grad_(False)
    assert precision_cautions(model, pure, 1) == []
    mixed = resolve_plan(StrategyConfig(mixed_precision="bf16-mixed"), 2, 2)
    assert precision_cautions(nn.Linear(4, 4), mixed, 8) == []
    reduced = resolve_plan(StrategyConfig(mixed_precision="bf16-mixed", reduce_dtype="bf16"), 2, 2)
    assert [c[:32] for c in precision_cautions(nn.Linear(4, 4), reduced, 8)] == [reduce[:32]]
    # Accumulated whole between micro-batches, the sum is bf16 at one rank too (found by review);
    # sharded accumulation adds each micro-batch's reduced shard to the fp32 gradient
    alone = resolve_plan(StrategyConfig(mixed_precision="bf16-mixed", reduce_dtype="bf16"), 1, 1)
    assert alone.grad_accumulation == "unsharded" and precision_cautions(nn.Linear(4, 4), alone, 1, 1) == []
    assert precision_cautions(nn.Linear(4, 4), alone, 1, 4) == [
        "gradients are accumulated in bf16 over 4 micro-batches (strategy.grad_accumulation=unsharded "
        "holds each whole gradient in the reduce dtype between them); strategy.reduce_dtype=fp32 "
        "accumulates in fp32"]
    assert reduced.grad_accumulation == "sharded"
    assert len(precision_cautions(nn.Linear(4, 4), reduced, 2, 4)) == 1


def test_a_root_unit_holding_most_parameters_is_said():
    """From a review of the seeds' rules: a wrap policy matching only small modules (Llama's
    Attention) left the MLPs in the root, gathered whole all step, without a word."""
    report = ShardingReport(wrap_classes=["Attention"],
                            unit_params={"layers.0.attention": 400, "layers.1.attention": 400,
                                         "<root>": 1200})
    two = resolve_plan(StrategyConfig(), 2, 2)
    said = root_unit_caution(report, two)
    assert said.startswith("the root unit holds 60% of the parameters (1,200): outside every unit of the "
                           "wrap policy (Attention)"), said
    assert root_unit_caution(report, resolve_plan(StrategyConfig(), 1, 1)) is None  # nothing is sharded
    report.unit_params["<root>"] = 800
    assert root_unit_caution(report, two) is None


def test_the_weights_average_warms_up_its_decay():
    """trainer.ema_warmup: step s's decay is min(ema_decay, s / (9 + s)) (diffusers': 0.1 at the first
    update); without it, ema_decay."""
    from torch import nn

    from shardtrain.train.ema import WeightAverage

    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ramped, plain = WeightAverage(model, 0.9, warmup=True), WeightAverage(model, 0.9)
    assert [ramped.decay_at(s) for s in (1, 9, 81, 1000)] == [0.1, 0.5, 0.9, 0.9]
    assert plain.decay_at(1) == 0.9
    with torch.no_grad():
        model.weight.fill_(3.0)
    ramped.update(1)
    plain.update(1)
    assert torch.allclose(ramped.averages[0], torch.full((2, 2), 0.1 * 1.0 + 0.9 * 3.0))
    assert torch.allclose(plain.averages[0], torch.full((2, 2), 0.9 * 1.0 + 0.1 * 3.0))


def test_graph_breaks_are_named_in_one_line():
    """Found by review: a graph break in a compiled block (which runs a checkpointed block eagerly
    for the rest of the run) was never said; after the first compiled step it is, once."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from shardtrain.train.step import graph_break_counts, graph_breaks_note

    counters["graph_break"].clear()
    assert graph_breaks_note() is None

    def noisy(x):
        y = x * 2
        print(end="")  # dynamo cannot trace it: the graph breaks here
        return y + 1

    torch._dynamo.reset()
    torch.compile(noisy, backend="eager")(torch.ones(2))
    note = graph_breaks_note()
    assert note.startswith("strategy.compile=true: 1 graph break(s) in the compiled blocks (1 x Failed to "
                           "trace builtin operator): those parts run eagerly"), note
    # counted since a run's start: an earlier compile's in the process are not its (diff review)
    assert graph_breaks_note(graph_break_counts()) is None
    counters["graph_break"].clear()


def test_a_models_own_error_met_while_compiling_is_no_compile_failure():
    """Found by the diff review: a wrong shape traced with fake tensors (dynamo's TorchRuntimeError)
    was reported as torch.compile's failure, advising strategy.compile=false for a bug that fails
    eagerly too."""
    from shardtrain.train.step import compile_failure

    with pytest.raises(RuntimeError) as info:
        torch.compile(torch.nn.Linear(4, 4), backend="eager")(torch.randn(2, 5))
    assert type(info.value).__name__ == "TorchRuntimeError" and not compile_failure(info.value)
