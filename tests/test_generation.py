"""Generation: sharded == consolidated, gathers do not grow with length, KV cache == no cache, byte
tokens printed as whole characters, and every numeric flag of generate/eval range-checked up front."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from cli_utils import SHARDTRAIN, clean_env, run_cli
from distributed import run_on_ranks
from generation_workers import count_all_gathers
from hf_models import make_model_dir

import shardtrain.cli.launch
import shardtrain.generation.inference
from shardtrain.cli.main import build_parser, main
from shardtrain.config.schema import DataConfig, ModelConfig
from shardtrain.data.corpus import load_corpus
from shardtrain.data.tokenizer import ByteStream, ByteTokenizer, HFTokenizer
from shardtrain.errors import DataError, GenerationError
from shardtrain.generation.generate import generate, generation_mode, kv_cache_bytes, prompt_ids
from shardtrain.generation.inference import data_changed_since
from shardtrain.generation.ranges import EVAL_RANGES, GENERATE_RANGES, Range
from shardtrain.models.llama import Llama

QUICK = ["experiment=quick", "trainer.eval_every=0", "trainer.sample_tokens=0", "run.trackers=[]"]


def test_sharded_generation_equals_consolidated(tmp_path):
    run_dir = tmp_path / "run"
    trained = run_cli("train", *QUICK, "trainer.max_steps=40", f"run.dir={run_dir}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    ckpt = run_dir / "checkpoints" / "step-40"
    assert run_cli("consolidate", str(ckpt), str(tmp_path / "m.safetensors")).returncode == 0
    for options in (["--temperature", "0"], ["--temperature", "0.9", "--top-k", "20", "--top-p", "0.9",
                                              "--seed", "3"]):
        sharded = run_cli("generate", str(ckpt), "--prompt", "def ", "--max-new-tokens", "48",
                          "--devices", "2", *options)
        single = run_cli("generate", str(tmp_path / "m.safetensors"), "--prompt", "def ",
                         "--max-new-tokens", "48", *options)
        assert sharded.returncode == 0 and single.returncode == 0, sharded.stderr[-2000:]
        assert sharded.stdout == single.stdout  # token for token (decoded the same way)
        assert sharded.stdout.startswith("def ") and len(sharded.stdout.encode()) >= 4 + 48
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def \nclass \n")
    multi = run_cli("generate", str(tmp_path / "m.safetensors"), "--prompts-file", str(prompts),
                    "--max-new-tokens", "8")
    assert multi.returncode == 0 and multi.stdout.count("\n") >= 2
    # gathered at 2 ranks: each rank generates its share of the prompts, rank 0 prints all in order
    split = run_cli("generate", str(ckpt), "--prompts-file", str(prompts), "--max-new-tokens", "8",
                    "--devices", "2", "--mode", "gathered")
    assert split.returncode == 0, split.stderr[-2000:]
    assert "2 prompts split over 2 ranks" in split.stderr and split.stdout == multi.stdout
    # a prompt only rank 1 generates is too long: every rank stops with its one line, none waits
    prompts.write_text("def \n" + "x" * 5000 + "\n")
    too_long = run_cli("generate", str(ckpt), "--prompts-file", str(prompts), "--max-new-tokens", "8",
                       "--devices", "2", "--mode", "gathered", timeout=120)
    assert too_long.returncode == 2, too_long.stderr[-2000:]
    # the prompts before it are printed first, as a single process prints them (found by review)
    assert too_long.stdout.startswith("def ") and multi.stdout.startswith(too_long.stdout)
    # one line on the console, as `train` gives (found by review: every rank's copy, then torchrun's
    # traceback); both ranks' copies and torchrun's report in the log it names
    (line,) = [line for line in too_long.stderr.splitlines() if line.startswith("shardtrain: ")]
    assert line.startswith("shardtrain: error: prompt 2: the prompt (5000 tokens) is longer")
    assert "Traceback" not in too_long.stderr
    log = Path(line.rpartition("; full log: ")[2])
    kept = log.read_text()
    assert all(kept.count(f"shardtrain: error: [rank {rank}] prompt 2: the prompt (5000 tokens)") == 1
               for rank in (0, 1)), kept[-2000:]  # each worker's line names its rank
    # the status given and the line shown are the first failing worker's, read from torchrun's report
    (first, status) = shardtrain.cli.launch.root_cause(log)
    assert status == 2 and first in (0, 1)
    assert shardtrain.cli.launch.failed_rank_line(log, first) == line.partition("; full log: ")[0]
    log.unlink()
    # A reader that goes (`| head`) ends it quietly with a shell's status and no log left, as at one
    # process (found by review: "exited with status 1 without an error line", a log kept each time)
    piped = subprocess.Popen([*SHARDTRAIN, "generate", str(ckpt), "--prompt", "a" * 20, "--max-new-tokens",
                              "200", "--devices", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=clean_env(), stdin=subprocess.DEVNULL)
    assert piped.stdout.read(5) == b"aaaaa"
    piped.stdout.close()
    _, said = piped.communicate(timeout=120)
    assert piped.returncode == 141 and b"error" not in said, said[-2000:]
    evaluated = run_cli("eval", str(ckpt), "--samples", "16", "--devices", "2")
    assert evaluated.returncode == 0 and "perplexity" in evaluated.stdout, evaluated.stderr[-2000:]
    # A micro-batch far past the samples: the same score (found by review: its padding was allocated,
    # a 74 GiB traceback)
    huge = run_cli("eval", str(ckpt), "--samples", "16", "--batch-size", "10000000000")
    assert huge.returncode == 0, huge.stderr[-2000:]
    assert huge.stdout.splitlines()[-1] == evaluated.stdout.splitlines()[-1]


def test_generation_stops_where_the_models_generation_config_says(tmp_path):
    """Found by review: only tokenizer_config.json's eos_token ended generation, so a chat model whose
    turn ends on another token (Gemma's <end_of_turn>, listed in generation_config.json) ran on to
    --max-new-tokens. The stop ids are transformers' generate's: the end of text and those listed."""
    directory = make_model_dir(tmp_path / "model", "llama")
    plain = HFTokenizer(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [plain.eos_id, 7, 10**9]}))
    tokenizer = HFTokenizer(directory)
    assert tokenizer.stop_ids == {plain.eos_id, 7}  # an id outside the vocabulary is no stop
    # Found by review: a generation_config.json that did not parse was ignored (no stops but the end
    # of text, silently)
    (directory / "generation_config.json").write_text('{"eos_token_id": [2, 7')
    with pytest.raises(DataError, match=r"generation_config.json cannot be read \(JSONDecodeError\)"):
        HFTokenizer(directory)
    # Without generation_config.json, config.json's (or its text part's), as transformers takes them
    # (found by review: generation ran past a Llama 3 config's end of turn)
    (directory / "generation_config.json").unlink()
    model_config = json.loads((directory / "config.json").read_text())
    for written in ({**model_config, "eos_token_id": [plain.eos_id, 9]},
                    {key: value for key, value in model_config.items() if key != "eos_token_id"}
                    | {"text_config": {"eos_token_id": 9}}):
        (directory / "config.json").write_text(json.dumps(written))
        assert HFTokenizer(directory).stop_ids == {plain.eos_id, 9}
    (directory / "config.json").write_text(json.dumps(model_config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [plain.eos_id, 7, 10**9]}))
    model = Llama(ModelConfig(vocab_size=tokenizer.vocab_size, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                              max_seq_len=64))
    free = generate(model, [1, 2, 3], 12)
    assert len(free) == 12
    stopped = generate(model, [1, 2, 3], 12, stop_tokens={free[4]})
    assert stopped == free[:free.index(free[4])]
    assert ByteTokenizer().stop_ids == frozenset()
    # Found by a new-user trial: a base model fine-tuned on ChatML conversations ends its turns with
    # <|im_end|>, which its generation_config does not list: `generate --chat` ran on to
    # --max-new-tokens. The template's end of an assistant's turn is a stop for chat.
    assert tokenizer.turn_end_ids == {tokenizer.encode("<|im_end|>", special_tokens=False)[0]}
    assert ByteTokenizer().turn_end_ids == frozenset()
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert HFTokenizer(directory).turn_end_ids == frozenset()


def test_eval_of_a_hugging_face_directory_without_a_file_says_it_is_one(tmp_path, monkeypatch, capsys):
    """Found by review: named by a relative path, it was said to be a file consolidated by an older
    shardtrain (the config's resolved path was compared with the path as typed)."""
    make_model_dir(tmp_path / "model", "llama")
    monkeypatch.chdir(tmp_path)
    for named in ("model", "./model", str(tmp_path / "model")):
        assert main(["eval", named]) == 2
        assert capsys.readouterr().err.endswith(
            f"{named} does not record the data its run trained on (a Hugging Face model directory); name "
            "the text to score with --file\n")


def test_gathered_and_unit_by_unit_generation(tmp_path):
    run_on_ranks(count_all_gathers, 2, str(tmp_path), tmp_path=tmp_path)
    r = torch.load(tmp_path / "counts.pt")
    counts, tokens = r["counts"], r["tokens"]
    assert counts["gathered", 4] > 0  # the weights were gathered ...
    assert counts["gathered", 24] == counts["gathered", 4]  # ... once, whatever the number of tokens
    # Unit by unit under FULL_SHARD: the same tokens as the gathered copy ...
    assert tokens["sharded", 24] == tokens["gathered", 24]
    assert tokens["sharded", 4] == tokens["gathered", 4]
    # ... for one all-gather per unit per new token: every block and the head unit, which training
    # keeps gathered after forward and generation does not (the embeddings exchange rows instead:
    # strategy.embedding_lookup).
    per_token = (counts["sharded", 24, "c10d"] - counts["sharded", 4, "c10d"]) / 20
    assert per_token == r["layers"] + 1, (counts, r["units"])
    assert r["skipped"] == ""  # training-time sampling that would not fit is skipped


@pytest.mark.parametrize("family", ["bamba", "jamba", "gemma2"])
def test_hugging_face_cached_generation_equals_full_recompute(family, tmp_path):
    """Found by review: the cache was transformers' DynamicCache without the model's config, which
    gives every layer keys and values: a hybrid's Mamba layers failed (IndexError). With a sliding
    window (Gemma 2's, 16 tokens here) the cache keeps the window only."""
    from hf_models import family_config

    from shardtrain.models.hf import HFCausalLM

    family_config(family).save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = HFCausalLM(ModelConfig(name="hf", path=str(tmp_path))).eval()
    prompt = [1, 2, 3, 5, 8]
    assert generate(model, prompt, 20, use_cache=True) == generate(model, prompt, 20, use_cache=False)


def test_kv_cache_generation_equals_full_recompute(tmp_path):
    torch.manual_seed(0)
    model = Llama(ModelConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, max_seq_len=128)).eval()
    prompt = list(b"import os\n")
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 50, "seed": 7}):
        cached = generate(model, prompt, 40, use_cache=True, **sampling)
        full = generate(model, prompt, 40, use_cache=False, **sampling)
        assert cached == full
    # Up to the last position, and no further, in both modes: the last new token is never fed back
    # (the cache refused one token too early; without it a window slid past the model's length).
    room = 128 - len(prompt) + 1
    for use_cache in (True, False):
        assert len(generate(model, prompt, room, use_cache=use_cache)) == room
        with pytest.raises(GenerationError, match="exceeds the model's 128 positions; ask for fewer"):
            generate(model, prompt, room + 1, use_cache=use_cache)
    # A prompt too long by itself is to be shortened; a token id past the embedding (another model's
    # tokenizer) is refused, not an IndexError (found by review).
    with pytest.raises(GenerationError, match=r"the prompt \(129 tokens\) is longer than the model's 128 "
                                              "positions; shorten it"):
        generate(model, [1] * 129, 1)
    with pytest.raises(GenerationError, match="holds token id 256 and the model embeds 256 ids: the "
                                              "tokenizer is not this model's"):
        generate(model, [1, 256], 1)
    # A tiny temperature is (almost) greedy, not an overflow to NaN in the softmax.
    for tiny in (1e-40, 1e-50, 1e-320):  # below fp32's smallest number too (found by review: NaN)
        assert generate(model, prompt, 8, temperature=tiny, seed=3) == generate(model, prompt, 8)
    # An empty prompt starts where documents start in training: after the end-of-text token, or at
    # a new line where documents are concatenated as they are (the bytes); it was token id 10 for
    # every tokenizer. generate itself takes no empty prompt.
    assert prompt_ids(ByteTokenizer(), "") == [10] and prompt_ids(ByteTokenizer(), "a") == [97]
    hf = HFTokenizer(make_model_dir(tmp_path / "qwen", "qwen2"))
    assert hf.eos_id is not None and prompt_ids(hf, "") == [hf.eos_id]
    with pytest.raises(GenerationError, match="an empty prompt"):
        generate(model, [], 4)
    # and the cached forward's logits equal the full forward's, chunked prefill included
    x = torch.randint(0, 256, (2, 30))
    cache = model.new_cache(30)
    with torch.no_grad():
        parts = [model(x[:, :10], cache=cache), model(x[:, 10:11], cache=cache),
                 model(x[:, 11:], cache=cache)]
        torch.testing.assert_close(torch.cat(parts, dim=1), model(x), rtol=1e-5, atol=1e-5)


def test_text_stream_prints_whole_characters():
    stream = ByteStream()
    pieces = [stream.push(byte) for byte in "héllo €".encode()]
    # nothing is printed until a character's last byte has arrived, then the whole character
    assert pieces == ["h", "", "é", "l", "l", "o", " ", "", "", "€"]
    assert "".join(pieces) + stream.flush() == "héllo €"
    bad = ByteStream()
    # a byte that starts no character, and a character cut short by the next byte or by the end
    pieces = [bad.push(byte) for byte in b"a\xff\xe2\x82A\xe2\x82"]
    assert "".join(pieces) == "a\ufffd\ufffdA" and bad.flush() == "\ufffd"


def test_a_metaspace_stream_keeps_the_space_after_the_prompt(tmp_path):
    """Found by review: the stream started at the first generated token, and a Metaspace decoder
    (Llama 2, Mistral v0.3) drops the space of a sequence's first word: "Hello" + "world again"
    printed "Helloworld again" where the decode is "Hello world again"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2, "\u2581again": 3},
                                       unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    words.decoder = decoders.Metaspace(prepend_scheme="first")
    words.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path / "tokenizer.json")
    prompt = tokenizer.encode("Hello", special_tokens=False)
    assert prompt == [1] and tokenizer.decode([1, 2, 3]) == "Hello world again"
    stream = tokenizer.stream(prompt)
    assert "Hello" + "".join(stream.push(i) for i in (2, 3)) + stream.flush() == "Hello world again"


def numeric_flags(command: str) -> list[argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices[command]._actions if a.type in (int, float)]


def outside(allowed: Range, kind: type) -> list[float]:
    """Values just outside ``allowed``, below and (when bounded) above."""
    step = 1 if kind is int else 0.5
    values = [allowed.low if allowed.low_open else allowed.low - step]
    if allowed.high != math.inf:
        values.append(allowed.high + step)
    return values + ([math.nan, math.inf] if kind is float else [])  # inf: found by the walkthrough


CASES = [(command, ranges, action, value)
         for command, ranges in (("generate", GENERATE_RANGES), ("eval", EVAL_RANGES))
         for action in numeric_flags(command) if action.option_strings[0] in ranges
         for value in outside(ranges[action.option_strings[0]], action.type)]


def test_every_numeric_flag_has_a_range():
    for command, ranges in (("generate", GENERATE_RANGES), ("eval", EVAL_RANGES)):
        flags = {a.option_strings[0] for a in numeric_flags(command)}
        assert flags == set(ranges), f"{command}: declare each numeric flag's range in generation/ranges.py"
        for action in numeric_flags(command):  # and the defaults are inside them (None: the run's)
            assert action.default is None or action.default in ranges[action.option_strings[0]], \
                action.option_strings[0]


@pytest.mark.parametrize(("command", "ranges", "action", "value"), CASES,
                         ids=[f"{c}{a.option_strings[0]}={v}" for c, _, a, v in CASES])
def test_out_of_range_flag_is_one_line_before_any_process(command, ranges, action, value, monkeypatch,
                                                          capsys):
    def launched(*args, **kwargs):
        raise AssertionError("a process was launched or a checkpoint loaded before the range check")

    monkeypatch.setattr(shardtrain.cli.launch, "run_under_torchrun", launched)
    monkeypatch.setattr(shardtrain.generation.inference, "load_for_inference", launched)
    flag = action.option_strings[0]
    text = str(action.type(value))
    prompt = ["--prompt", "def "] if command == "generate" else []
    assert main([command, "missing-ckpt", *prompt, "--devices", "2", flag, text]) == 2
    err = capsys.readouterr().err
    shown = f"{action.type(value):g}" if action.type is float else text
    expected = "finite" if math.isinf(value) else ranges[flag]
    assert err == f"shardtrain: error: {flag} {shown} must be {expected}\n"


def test_a_file_on_several_devices_is_refused_before_any_process(tmp_path, monkeypatch, capsys):
    """Found by review: N workers started (generate.sbatch: 8) to refuse a consolidated file."""
    def launched(*args, **kwargs):
        raise AssertionError("a process was launched before the file was refused")

    monkeypatch.setattr(shardtrain.cli.launch, "run_under_torchrun", launched)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    for command in (["generate", str(weights), "--prompt", "def "], ["eval", str(weights)]):
        assert main([*command, "--devices", "2"]) == 2
        assert capsys.readouterr().err == (
            "shardtrain: error: a consolidated safetensors file is loaded by one process; use the sharded "
            "checkpoint directory with --devices N, or --devices 1\n")


def test_range_message_names_flag_and_range(capsys):
    assert main(["generate", "ckpt", "--prompt", "x", "--top-p", "1.5"]) == 2
    assert capsys.readouterr().err == "shardtrain: error: --top-p 1.5 must be in (0, 1]\n"
    # an int too large for a float is one line too (found by review: OverflowError's traceback)
    assert main(["generate", "ckpt", "--prompt", "x", "--seed", "1" + "0" * 400]) == 2
    assert capsys.readouterr().err.endswith(" must be in [0, 9223372036854775807]\n")
    # sampling flags at the greedy default would change nothing (found by review)
    assert main(["generate", "ckpt", "--prompt", "x", "--top-p", "0.9", "--seed", "3"]) == 2
    assert capsys.readouterr().err == (
        "shardtrain: error: --top-p, --seed shape sampling, and --temperature 0 (the default) picks the most "
        "likely token: they would change nothing; give --temperature above 0 to sample, or drop them\n")


def test_cpu_ranks_of_a_machine_share_its_memory_for_the_gathered_copy():
    """Each local process builds its own copy in the host's one memory: the choice compares the
    copy with a share of it (it compared with all of it, N copies against one host)."""
    model = Llama(ModelConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, max_seq_len=128))
    alone = generation_mode(model, torch.float32, torch.device("cpu"))
    crowded = generation_mode(model, torch.float32, torch.device("cpu"), local_processes=10**9)
    assert alone.mode == "gathered" and crowded.mode == "sharded"
    assert crowded.free_bytes < 2**20  # the host's available memory over a billion processes
    # A mode asked for says so (found by the walkthrough: --mode sharded read as forced by memory)
    asked = generation_mode(model, torch.float32, torch.device("cpu"), "sharded")
    assert asked.mode == "sharded" and asked.reason().startswith("as asked; the gathered model needs ")
    assert alone.reason().startswith("the gathered model needs ")
    # The KV cache of the generation counts beside the copy (found by review: left to the headroom):
    # keys and values, 2 layers x 2 key/value heads x 8 dimensions x 4 bytes a position
    assert kv_cache_bytes(model, 10, torch.float32) == 2 * 2 * 2 * 8 * 4 * 10
    long = generation_mode(model, torch.float32, torch.device("cpu"), positions=100)
    assert long.cache_bytes == kv_cache_bytes(model, 100, torch.float32) and not long.cache_fits_nowhere()
    assert "and its KV cache 25.0 KiB, " in long.reason(), long.reason()
    # past the model's 128 positions nothing is generated (check_prompt refuses it): not counted
    assert generation_mode(model, torch.float32, torch.device("cpu"), positions=10**9).cache_bytes == \
        kv_cache_bytes(model, 128, torch.float32)
    crowded = generation_mode(model, torch.float32, torch.device("cpu"), local_processes=10**9, positions=128)
    assert crowded.mode == "sharded" and crowded.cache_fits_nowhere()  # the cache is whole in either mode


def test_eval_says_when_the_runs_data_now_gives_other_samples(tmp_path):
    """Found by review: eval without --file reads the run's data settings again (relative data.paths,
    this Python's standard library, files edited since) and scored whatever they gave without a
    word; the checkpoint's training sample count tells."""
    (tmp_path / "data").mkdir()
    for index in range(40):
        (tmp_path / "data" / f"{index}.txt").write_text(f"document {index} " * 50)
    data = DataConfig(source="files", paths=[str(tmp_path / "data")], file_glob="*.txt",
                      cache_dir=str(tmp_path / "cache"))
    corpus = load_corpus(data)
    samples = corpus.train_windows(64).num_samples
    state = argparse.Namespace(train_samples=samples, train_part_samples=None,
                               config={"trainer": {"seq_len": 64}, "data": {"document_mask": False}})
    assert data_changed_since(state, corpus) is None
    assert data_changed_since(argparse.Namespace(train_samples=None), corpus) is None  # older checkpoints
    (tmp_path / "data" / "new.txt").write_text("another document " * 400)
    changed = data_changed_since(state, load_corpus(data))
    short = argparse.Namespace(train_samples=samples, train_part_samples=None,
                               config={"trainer": {"seq_len": 10**7}, "data": {}})
    assert "now gives 0 training samples" in data_changed_since(short, corpus)  # not one window: said
    # training data that cannot be read is said, not raised: eval scores the held-out split (found by
    # the diff review: a damaged training split stopped eval; here the first corpus's cache, prepared
    # again since under it, read for record windows)
    unreadable = argparse.Namespace(train_samples=samples, train_part_samples=None,
                                    config={"trainer": {"seq_len": 64}, "data": {"packing": "records"}})
    said = data_changed_since(unreadable, corpus)
    assert said.startswith(f"the run's training data ({tmp_path / 'data'}) cannot be read to check it is "
                           "the run's (") and said.endswith("; the held-out split is scored as it is"), said
    assert changed.startswith(f"the run's data ({tmp_path / 'data'}) now gives ") and changed.endswith(
        f"training samples, where the run trained on {samples}: its files changed since, or data.paths or "
        "the standard library resolve to others here, so the held-out split scored is not the run's; name "
        "the text to score with --file"), changed


def test_running_out_of_memory_is_one_line_naming_what_to_change(tmp_path, monkeypatch, capsys):
    """Found by review: an accelerator's out-of-memory error was a traceback, or exit 2 naming
    nothing to change on the split path of --devices N (which now says this same line)."""
    import shardtrain.generation.generate as generation

    directory = make_model_dir(tmp_path / "model", "llama")

    def exhausted(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")

    # A KV cache that fits no rank's memory in either mode is refused before any generation
    monkeypatch.setattr(generation, "free_memory_bytes", lambda device: 1000)
    assert main(["generate", str(directory), "--prompt", "x", "--max-new-tokens", "4"]) == 2
    assert "does not fit a rank's free memory (1000 B) in either mode (each rank holds all of it); ask for " \
        "fewer --max-new-tokens" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setattr(generation, "generate", exhausted)
    for mode, fix in (("gathered", "use --mode sharded (a rank then holds about two units of the model), "),
                      ("sharded", "use fewer --max-new-tokens")):
        command = ["generate", str(directory), "--prompt", "x", "--max-new-tokens", "4", "--mode", mode]
        assert main(command) == 2
        assert ("shardtrain: error: out of memory generating (CUDA out of memory. Tried to allocate "
                f"2.00 GiB) in mode {mode}; {fix}") in capsys.readouterr().err
    # The CPU allocator's refusal of one allocation is a RuntimeError of its own: the same line
    monkeypatch.setattr(generation, "generate", lambda *args, **kwargs: torch.empty(2**48, dtype=torch.uint8))
    command = ["generate", str(directory), "--prompt", "x", "--max-new-tokens", "4", "--mode", "sharded"]
    assert main(command) == 2
    err = capsys.readouterr().err
    assert "can't allocate memory: you tried to allocate 281474976710656 bytes" in err
    assert "in mode sharded; use fewer --max-new-tokens" in err and "Traceback" not in err
