"""Fine-tuning data: only completion tokens are targets, and sharded training with accumulation
still equals the one-process reference, because the loss is normalised by the global count of
targets (not averaged per micro-batch, which this data makes visibly different).

Prompt/completion pairs with prompts and completions of very different lengths are prepared with
the byte tokenizer; windows of 32 tokens then hold anywhere from no target to 32. At 2 processes x 2
micro-batches and 4 processes x 2 micro-batches (global batch 8), FULL_SHARD, fp32: losses and grad
norms of 5 steps and the final weights within relative 1e-5 of the reference loop (measured: printed).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cli_utils import run_cli
from distributed import run_on_ranks
from equivalence import GLOBAL_BATCH, case_config, max_errors, reference_run, run_cases

from shardtrain.data.batches import IGNORE_INDEX, GlobalOrder, TokenWindows
from shardtrain.data.prepare import PrepareOptions, prepare
from shardtrain.data.prepared import open_prepared
from shardtrain.distributed.sharded_model import init_full_parameter
from shardtrain.models.llama import Llama

TOL = 1e-5
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def records(count: int = 160, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    def text(low, high):
        return " ".join(rng.choice(WORDS, rng.integers(low, high)))
    return [{"prompt": f"Q: {text(2, 30)}\n", "completion": f"A: {text(1, 12)}\n"} for _ in range(count)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    source = root / "pairs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records()))
    prepare(PrepareOptions(inputs=[str(source)], val_percent=20.0), root / "prepared", progress=False)
    return root / "prepared"


def test_only_completions_are_targets(dataset):
    data = open_prepared(dataset)
    tokens, mask = np.asarray(data.train), data.train.targets(slice(0, len(data.train)))
    text = bytes(tokens.astype(np.uint8)).decode()
    starts = [i for i in range(len(text)) if text.startswith("Q: ", i)]
    answers = [i for i in range(len(text)) if text.startswith("A: ", i)]
    assert len(starts) == len(answers) == data.train.documents > 100
    for q, a in zip(starts, answers):
        assert not mask[q:a].any() and mask[a:text.index("\n", a) + 1].all()
    windows = TokenWindows(data.train, 32)
    y = windows.batch(np.arange(windows.num_samples)).targets
    share = (y != IGNORE_INDEX).float().mean().item()
    assert 0.1 < share < 0.6, share  # the prompts' tokens are no targets


def micro_batch_mean_differs(tokens) -> float:
    """Relative difference between the gradient of the global-token mean and of the mean of the
    4 micro-batches' own means, on the first global batch at the initial weights."""
    cfg = case_config(1, "unused")
    model = Llama(cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            init_full_parameter(model, name, p, cfg.trainer.seed)
    windows = TokenWindows(tokens, cfg.trainer.seq_len)
    x, y = windows.batch(GlobalOrder(windows.num_samples, cfg.trainer.seed).take(0, GLOBAL_BATCH))[:2]

    def gradient(loss):
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    global_mean = gradient(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    per_micro = gradient(sum(F.cross_entropy(model(xs).flatten(0, 1), ys.flatten())
                             for xs, ys in zip(x.chunk(4), y.chunk(4))) / 4)
    return ((per_micro - global_mean).norm() / global_mean.norm()).item()


def test_sharded_fine_tuning_with_accumulation_matches_reference(dataset, tmp_path):
    tokens = open_prepared(dataset).train
    difference = micro_batch_mean_differs(tokens)
    print(f"gradient of per-micro-batch means vs the global-token mean: {difference:.2e} apart")
    assert difference > 1e-2  # so averaging per micro-batch would fail the comparison below
    reference = reference_run(train_tokens=tokens)
    failures, table = [], []
    for world in (2, 4):
        out = tmp_path / f"{world}p"
        cases = {"full_shard_accum": dict(strategy="FULL_SHARD", accum=2)}
        run_on_ranks(run_cases, world, cases, str(out), str(dataset), tmp_path=out)
        errors = max_errors(torch.load(out / "full_shard_accum.pt"), reference)
        table.append(f"{world}p x 2 micro-batches: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
        failures += [f"{world}p {k} {v:.2e}" for k, v in errors.items() if not v <= TOL]
    print("\n".join(table))
    assert not failures, failures


def test_flops_count_every_processed_token_not_only_targets():
    """MFU under fine-tuning masks: the model computes every input token (the prompt's too), so the
    FLOPs the step reports are per input token; the count that normalises the loss is the targets'."""
    from shardtrain.data.batches import Batch
    from shardtrain.tasks.language_model import LanguageModelTask

    task = LanguageModelTask()
    task.flops_per_token = 6.0
    targets = torch.full((2, 8), IGNORE_INDEX)
    targets[:, 6:] = 1  # only the answers' last two tokens are trained on
    batch = Batch(inputs=torch.zeros(2, 8, dtype=torch.long), targets=targets)
    assert task.flops(batch) == 6.0 * 16 and task.count(batch) == 4


def test_eval_of_fine_tuning_data_says_what_it_scores(dataset, tmp_path):
    """Found by a new-user trial: `eval` on fine-tuning records reported tokens read and a loss 'per
    token', while the loss scores the answers' tokens only: it now counts those and names the unit."""
    run_dir = tmp_path / "run"
    # the stream cut anywhere: these records are longer than the 32-byte windows scored below
    trained = run_cli("train", "experiment=quick", "data.source=prepared", f"data.paths=[{dataset}]",
                      "data.packing=stream",
                      "trainer.max_steps=2", "checkpoint.interval=2", "trainer.eval_every=0",
                      "trainer.sample_tokens=0", "run.trackers=[]", f"run.dir={run_dir}")
    assert trained.returncode == 0, trained.stderr[-2000:]
    evaluated = run_cli("eval", str(run_dir / "checkpoints" / "step-2"), "--samples", "8", "--seq-len", "32")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    read, scored = evaluated.stdout.splitlines()
    windows = TokenWindows(open_prepared(dataset).val, 32)
    targets = int((windows.batch(np.arange(8)).targets != IGNORE_INDEX).sum())
    assert 0 < targets < 8 * 32
    assert read.endswith(f"256 bytes in windows of 32, {targets} of them targets (the fine-tuning records' "
                         "answers, which the loss scores)"), read
    assert "nats/target byte" in scored and scored.endswith("per target byte"), scored
    # --file takes a prepared dataset (its validation split), which it refused as a training input
    named = run_cli("eval", str(run_dir / "checkpoints" / "step-2"), "--file", str(dataset), "--samples", "8",
                    "--seq-len", "32")
    assert named.returncode == 0, named.stderr[-2000:]
    named_read, named_scored = named.stdout.splitlines()
    assert named_read == f"eval on validation split of {dataset}: {read.partition(': ')[2]}", named_read
    assert named_scored == scored
    # A raw file is packed as the run's data were: whole records (the default) pad their windows
    # (found by a trial: cut anywhere, an answer scored without its prompt)
    records_run = tmp_path / "records"
    trained = run_cli("train", "experiment=quick", "data.source=prepared", f"data.paths=[{dataset}]",
                      "trainer.max_steps=1", "checkpoint.interval=1", "trainer.eval_every=0",
                      "trainer.sample_tokens=0", "run.trackers=[]", f"run.dir={records_run}")
    assert trained.returncode == 0, trained.stderr[-2000:]
    raw = run_cli("eval", str(records_run / "checkpoints" / "step-1"), "--file",
                  str(dataset.parent / "pairs.jsonl"), "--samples", "8", "--seq-len", "32")
    assert raw.returncode == 0, raw.stderr[-2000:]
    assert "records of the evaluation data are longer than" in raw.stderr, raw.stderr  # records' windows
    # Records of another text field: read with --text-field (found by review: the error's fix,
    # "--text-field", was no option of eval)
    lines = [json.dumps({"body": f"def f{i}(): return {i}\n" * 4}) + "\n" for i in range(40)]
    (tmp_path / "bodies.jsonl").write_text("".join(lines))
    bodies = [str(records_run / "checkpoints" / "step-1"), "--file", str(tmp_path / "bodies.jsonl"),
              "--samples", "4", "--seq-len", "32"]
    refused = run_cli("eval", *bodies)
    assert refused.returncode == 2 and "no 'text' field (fields: body)" in refused.stderr, refused.stderr
    named_field = run_cli("eval", *bodies, "--text-field", "body")
    assert named_field.returncode == 0, named_field.stderr[-2000:]


def test_fine_tuning_windows_hold_whole_records(dataset, caplog):
    """Found by review: the stream cut every seq_len tokens, and a window starting inside a record
    trained its answer without its prompt. data.packing=auto gives fine-tuning data windows of
    whole records: each starts at a record, holds the records that fit, the rest padding; a record
    longer than a window is cut to one of its own, and said at start-up."""
    from shardtrain.data.batches import InterleavedWindows, RecordWindows, pack_records, packing_of
    from shardtrain.data.corpus import windows_of

    tokens = open_prepared(dataset).train
    starts = set(tokens.document_starts(0, len(tokens)).tolist())
    with caplog.at_level("WARNING", logger="shardtrain"):
        windows = windows_of(tokens, 128, "training data", False, "auto")
    assert isinstance(windows, RecordWindows) and windows.num_samples < windows.records
    lengths = windows.stops - windows.starts
    assert set(windows.starts.tolist()) <= starts and (lengths <= 129).all()
    assert windows.truncated > 0 and f"{windows.truncated} of the {windows.records} records" in caplog.text
    # eval's count of the training windows (data_changed_since) warns nothing: the warning is training's
    caplog.clear()
    with caplog.at_level("WARNING", logger="shardtrain"):
        quiet = windows_of(tokens, 128, "training data", False, "auto", warn=False)
    assert quiet.truncated == windows.truncated
    assert not caplog.records
    batch = windows.batch(np.arange(windows.num_samples))
    for row, (start, stop) in enumerate(zip(windows.starts, windows.stops)):
        filled = int(stop - start) - 1
        assert int(batch.lengths[row]) == filled  # what a MoE router loss leaves out after it
        assert (batch.inputs[row, :filled].numpy() == np.asarray(tokens[int(start):int(stop) - 1])).all()
        assert (batch.targets[row, filled:] == IGNORE_INDEX).all()  # padding: no target
        # the first record's prompt is in the window: its first target comes after a prompt token
        assert batch.targets[row, 0] == IGNORE_INDEX
    # the targets are the windows' records' own completion tokens, each once (the first token of a
    # window, a record's first, is never one)
    marked = sum(int(tokens.targets(slice(int(a) + 1, int(b))).sum())
                 for a, b in zip(windows.starts, windows.stops))
    assert int((batch.targets != IGNORE_INDEX).sum()) == marked > 0
    # the greedy packing itself: records of 3, 4, 10 and 2 tokens in windows of 8
    assert [a.tolist() for a in pack_records(np.array([0, 3, 7, 17]), 19, 8)[:2]] == [[0, 7, 17], [7, 15, 19]]
    assert pack_records(np.array([0, 3, 7, 17]), 19, 8)[2] == 1
    # ... equal to a record-by-record walk on random records, empty and overlong ones among them (the
    # packing finds each window's end for all records at once: the walk held two Python ints a record)
    rng = np.random.default_rng(0)
    for count, window in ((1, 4), (50, 8), (3000, 64)):
        lengths = rng.integers(0, 3 * window, count)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        begins, stops, truncated = pack_records(starts, int(lengths.sum()), window)
        walked, begin = [], None
        for start, length in zip(starts.tolist(), lengths.tolist()):
            if begin is not None and start + length - begin <= window:
                walked[-1][1] = start + length
            else:
                begin = start
                walked.append([start, min(start + length, start + window)])
        assert [[a, b] for a, b in zip(begins.tolist(), stops.tolist())] == walked
        assert truncated == int((lengths > window).sum())
    # an empty record (the byte tokenizer's empty document) that begins a window before a record too
    # long to join it is a window of no tokens: a row of padding, counted as no input (it raised)
    empty = RecordWindows(ListedRecords(np.arange(40) % 200, np.array([0, 0, 20, 20])), 8)
    spans = [(int(a), int(b)) for a, b in zip(empty.starts, empty.stops)]
    assert spans == [(0, 0), (0, 9), (20, 20), (20, 29)]
    padded = empty.batch(np.arange(empty.num_samples))
    assert padded.lengths[[0, 2]].tolist() == [0, 0] and (padded.targets[[0, 2]] == IGNORE_INDEX).all()
    assert padded.lengths[[1, 3]].tolist() == [8, 8] and empty.inputs_in(4) == 16
    assert not isinstance(windows_of(tokens, 64, "training data", False, "stream"), RecordWindows)
    # as resolved, for a resume's comparison and best.validation: a mixture's validation parts too
    assert packing_of(windows) == packing_of(InterleavedWindows([windows, windows])) == "records"
    assert packing_of(TokenWindows(tokens, 64)) == "stream"
    # stream windows are full: no lengths (nothing to mask); a padding row has 0 of them
    stream = TokenWindows(tokens, 64)
    assert stream.batch(np.arange(4)).lengths is None
    assert stream.batch(np.array([0, -1])).lengths.tolist() == [64, 0]


class ListedRecords:
    """Tokens in memory with records beginning at ``starts``: what a prepared split gives windows."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray) -> None:
        self.tokens, self.starts = tokens, starts

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, span: slice) -> np.ndarray:
        return self.tokens[span]

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        return self.starts[(self.starts >= start) & (self.starts < stop)]
