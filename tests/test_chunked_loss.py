"""The chunked linear + cross-entropy (``trainer.loss_chunk_tokens``): its loss and its gradients (of the
hidden states, and of every parameter through the model, the head weight included) equal the plain
full-logits loss's within fp32 rounding, for the built-in Llama (untied and tied) and a Hugging Face
family, with document masking and a fine-tuning mask; and 2-rank FSDP2 training with it follows the
plain loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers
from distributed import run_on_ranks
from equivalence import case_config, small_corpus
from hf_models import make_model, make_model_dir, sample_texts, train_tokenizer
from storages import peak_bytes

from shardtrain.config.loader import load_config
from shardtrain.config.schema import ModelConfig
from shardtrain.data.batches import IGNORE_INDEX, Batch
from shardtrain.diagnostics.planner import estimate
from shardtrain.distributed.parallelize import largest_first
from shardtrain.models.hf import HFCausalLM, forward_source, head_transform_reason, transforms_head_output
from shardtrain.models.llama import Llama
from shardtrain.models.registry import build_model
from shardtrain.tasks.language_model import LanguageModelTask, output_head, token_loss_sum
from shardtrain.tasks.losses import (
    AUTO_CHUNK_MIN_VOCAB,
    DEFAULT_CHUNK_TOKENS,
    chunk_tokens_for,
    chunked_cross_entropy,
)
from shardtrain.tasks.task import LossOutput, Task
from shardtrain.train.flops import counted_flops_per_sample

# fp32: the chunked path sums the loss and the head's gradient chunk by chunk, in another order than
# one matmul over all tokens; measured differences are ~1e-7 relative.
TOLERANCE = 1e-6
CHUNK = 24  # tokens: several chunks, the last one short (2 x 31 = 62 tokens)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def masked_batch(vocab: int, document_mask: bool) -> Batch:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (2, 32), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, :9] = IGNORE_INDEX  # a fine-tuning mask: the prompt's tokens take no loss
    targets[1, 20:] = IGNORE_INDEX
    positions = None
    if document_mask:  # three documents in row 0, two in row 1
        starts = [[0, 7, 19], [0, 12]]
        positions = torch.zeros_like(inputs)
        for row, row_starts in enumerate(starts):
            for start, stop in zip(row_starts, row_starts[1:] + [inputs.shape[1]], strict=True):
                positions[row, start:stop] = torch.arange(stop - start)
    return Batch(inputs, targets, positions)


def loss_and_grads(model: torch.nn.Module, batch: Batch, chunk_tokens: int) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = token_loss_sum(model, batch, chunk_tokens)
    (loss / 7.0).backward()  # as the step divides by the token count: backward scales by it
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def check_model(model: torch.nn.Module, vocab: int, tolerance: float = TOLERANCE) -> None:
    assert output_head(model) is not None
    for document_mask in (False, True):
        batch = masked_batch(vocab, document_mask)
        plain_loss, plain_grads = loss_and_grads(model, batch, 0)
        loss, grads = loss_and_grads(model, batch, CHUNK)
        assert rel_error(loss, plain_loss) < tolerance
        assert grads.keys() == plain_grads.keys()
        for name, grad in grads.items():
            assert rel_error(grad, plain_grads[name]) < tolerance, name


@pytest.mark.parametrize("tied", [False, True])
def test_builtin_llama_matches_plain_loss(tied):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=301, dim=36, n_layers=2, n_heads=6, n_kv_heads=2, ffn_hidden_dim=97,
                      max_seq_len=64, tie_embeddings=tied, init_std=0.2)
    check_model(Llama(cfg), cfg.vocab_size)


# Llama 4 (its base model under another name than base_model_prefix says) and Nemotron-H (which
# takes `outputs[0]` for the last hidden state) chunk since 2026-12-02. Nemotron-H's Mamba `dt_bias`
# gradients are ~1e-9: their fp32 rounding is 1e-6 of them.
@pytest.mark.parametrize(("family", "tolerance"), [("llama", TOLERANCE), ("gpt_neox", TOLERANCE),
                                                   ("llama4_text", TOLERANCE), ("nemotron_h", 1e-5)])
def test_hf_family_matches_plain_loss(family, tolerance, tmp_path):
    model = HFCausalLM(ModelConfig(name="hf", path=str(make_model_dir(tmp_path, family))))
    check_model(model, model.dims.vocab_size, tolerance)


def test_helper_matches_cross_entropy_with_bias_and_bf16():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 17, 40, generator=generator)
    weight = torch.randn(250, 40, generator=generator) / 6
    bias = torch.randn(250, generator=generator)
    targets = torch.randint(0, 250, (3, 17), generator=generator)
    targets[1] = IGNORE_INDEX

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (hidden, weight, bias)]
        loss = fn(*leaves)
        (loss * 0.3).backward()
        return [loss.detach()] + [leaf.grad for leaf in leaves]

    def plain(h, w, b):
        return F.cross_entropy(F.linear(h, w, b).float().flatten(0, 1), targets.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")

    def chunked(h, w, b):
        return chunked_cross_entropy(h, w, targets, bias=b, chunk_tokens=10)

    for ours, theirs in zip(grads(chunked, torch.float32), grads(plain, torch.float32), strict=True):
        assert rel_error(ours, theirs) < TOLERANCE
    # bf16: the same logits (the matmul in bf16, then fp32), so the same loss; gradients within bf16
    # rounding (the backward's scale is applied after the bf16 matmuls instead of before).
    ours, theirs = grads(chunked, torch.bfloat16), grads(plain, torch.bfloat16)
    assert rel_error(ours[0], theirs[0]) < TOLERANCE
    for a, b in zip(ours[1:], theirs[1:], strict=True):
        assert a.dtype == b.dtype == torch.bfloat16 and rel_error(a, b) < 1e-2
    # The backward's scale (1/N of the global count) multiplies in fp32 and rounds once, not rounded
    # to bf16 first (found by review: up to 0.2% on every gradient of the step)
    unscaled, scaled = ([t.detach().to(torch.bfloat16).requires_grad_() for t in (hidden, weight, bias)]
                        for _ in range(2))
    chunked(*unscaled).backward()
    (chunked(*scaled) * (1 / 7)).backward()
    for once, then in zip(scaled, unscaled, strict=True):
        assert torch.equal(once.grad, (then.grad.float() * torch.tensor(1 / 7)).to(torch.bfloat16))
    # Evaluation (validation runs under no_grad on parameters that require grad): the same loss, and
    # the loss alone: no autograd function, so none of the gradient buffers and matmuls.
    leaves = [t.detach().requires_grad_() for t in (hidden, weight, bias)]
    with torch.no_grad():
        evaluated = chunked(*leaves)
        assert rel_error(evaluated, plain(hidden, weight, bias)) < TOLERANCE and evaluated.grad_fn is None
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        chunked_cross_entropy(hidden, weight, targets, chunk_tokens=0)
    # A negative target other than ignore_index is an error, as in F.cross_entropy, not class 0.
    wrong = targets.clone()
    wrong[0, 3] = -1
    with pytest.raises((IndexError, RuntimeError), match="-1"):
        chunked_cross_entropy(hidden, weight, wrong, chunk_tokens=10)
    # Its gradients come from forward, without a graph: a second derivative is refused, not zero.
    loss = chunked(*leaves)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(loss, leaves[0], create_graph=True)


def test_one_chunk_of_logits_at_a_time():
    """The forward (where the step's peak is: every block's activations are alive) holds the
    gradients of the hidden states and of the weight, and one chunk's logits at a time: the next
    chunk's logits are not made while the last ones live."""
    tokens, dim, vocab, chunk = 4 * CHUNK, 16, 1000, CHUNK
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))

    def forward() -> None:
        chunked_cross_entropy(hidden, weight, targets, chunk_tokens=chunk)

    gradients = (tokens + vocab) * dim * 4
    one_chunk = chunk * vocab * 4
    # Beside them only per-token vectors (maxima, sums, picked logits, the kept mask): under 1/4 chunk.
    assert gradients + one_chunk <= peak_bytes(forward) < gradients + 1.25 * one_chunk


def test_head_units_put_the_head_first():
    """FSDP2 keeps a unit's last gradient alive through its reduce-scatter: in the head's unit that
    must be the norm's, not the head's (the head's is the largest tensor of the loss's phase)."""
    for tied in (False, True):
        model = Llama(ModelConfig(vocab_size=300, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                                  tie_embeddings=tied))
        head_group = model.extra_shard_groups()[-1]
        ordered = largest_first(head_group)
        assert ordered[-1] is model.norm and ordered[0] in (model.output, model.tok_embeddings)
        assert sorted(map(id, ordered)) == sorted(map(id, head_group))


def test_user_module_without_head():
    class Logits(torch.nn.Module):  # what a user brings: token ids to logits, nothing else
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(11, 11)

        def forward(self, tokens, positions=None):
            return self.embed(tokens)

    model = Logits()
    batch = masked_batch(11, False)
    assert output_head(model) is None
    assert torch.equal(token_loss_sum(model, batch, CHUNK), token_loss_sum(model, batch, 0))


def train_both_ways(out: str, olmo_dir: str) -> None:
    """Inside each rank: the same few FSDP2 steps with the plain and the chunked loss (tied
    embeddings, bf16 mixed precision: the head is its own unit, gathered in bf16); and OLMo, whose
    final norm has no parameters (found by review: its head was alone in its unit, never gathered
    by the chunked loss, which failed)."""
    import os

    from hf_workers import hf_case_config, hf_corpus

    from shardtrain.train.loop import Trainer

    world = int(os.environ["WORLD_SIZE"])
    results = {}
    for name, chunk in (("plain", 0), ("chunked", 16)):
        for precision in ("fp32", "bf16-mixed"):
            cfg = case_config(world, f"{out}/{name}-{precision}", precision=precision, tied=True)
            cfg.trainer = dataclasses.replace(cfg.trainer, max_steps=4, loss_chunk_tokens=chunk)
            cfg.diagnostics.enabled = False
            trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=small_corpus()))
            result = trainer.fit()
            results[name, precision] = (result.losses, result.grad_norms, trainer.task.loss_kind)
        cfg = hf_case_config(olmo_dir, world, f"{out}/olmo-{name}")
        cfg.trainer = dataclasses.replace(cfg.trainer, max_steps=2, loss_chunk_tokens=chunk)
        trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=hf_corpus(olmo_dir)))
        result = trainer.fit()
        results[name, "olmo"] = (result.losses, result.grad_norms, trainer.task.loss_kind)
    if int(os.environ["RANK"]) == 0:
        torch.save(results, f"{out}/results.pt")


def test_two_rank_fsdp_training_follows_plain_loss(tmp_path):
    olmo = transformers.OlmoConfig(vocab_size=300, hidden_size=36, intermediate_size=97, num_hidden_layers=2,
                                   num_attention_heads=6, max_position_embeddings=128, eos_token_id=0,
                                   bos_token_id=None, pad_token_id=None)
    make_model.save_model_dir(tmp_path / "olmo", olmo, train_tokenizer(sample_texts()), seed=0)
    run_on_ranks(train_both_ways, 2, str(tmp_path), str(tmp_path / "olmo"), tmp_path=tmp_path)
    results = torch.load(tmp_path / "results.pt")
    for precision, tolerance in (("fp32", 1e-5), ("bf16-mixed", 1e-2), ("olmo", 1e-5)):
        plain_losses, plain_norms, plain_kind = results["plain", precision]
        losses, norms, kind = results["chunked", precision]
        assert kind.startswith("chunked, 16 tokens") and not plain_kind.startswith("chunked"), plain_kind
        assert len(losses) == len(plain_losses) == (2 if precision == "olmo" else 4)
        for ours, theirs in zip(losses + norms, plain_losses + plain_norms, strict=True):
            assert abs(ours - theirs) <= tolerance * abs(theirs), (precision, losses, plain_losses)


def test_hf_logit_transforms_keep_the_plain_loss():
    """Cohere and Granite scale their logits after the head, HyperCLOVAX on the head's line, MiniCPM3
    its hidden states before it, Gemma 2 soft-caps them: the head alone is not their logits."""
    sizes = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    for plain in (transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)),
                  transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes))):
        assert head_transform_reason(plain, forward_source(plain)) is None
    minicpm3 = dict(sizes, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                    v_head_dim=4)
    for family in (transformers.CohereForCausalLM(transformers.CohereConfig(**sizes)),
                   transformers.GraniteForCausalLM(transformers.GraniteConfig(**sizes)),
                   transformers.HyperCLOVAXForCausalLM(transformers.HyperCLOVAXConfig(**sizes)),
                   transformers.MiniCPM3ForCausalLM(transformers.MiniCPM3Config(**minicpm3)),
                   transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**sizes))):
        reason = head_transform_reason(family, forward_source(family))
        assert "does more to its logits" in reason, type(family).__name__
    # The shapes the source check reads, one change at a time from the plain one.
    plain = ("outputs = self.model(input_ids)\nhidden_states = outputs.last_hidden_state\n"
             "hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)\n"
             "logits = self.lm_head(hidden_states)\nreturn Output(logits=logits,\n)")
    assert not transforms_head_output(plain, "lm_head", "model")
    assert not transforms_head_output(plain.replace("(hidden_states)\n", "(hidden_states).float()\n"),
                                      "lm_head", "model")
    for changed in (plain.replace("(hidden_states)\n", "(hidden_states) * self.scale\n"),
                    plain.replace("keep)\n", "keep)\nhidden_states = hidden_states / 9\n"),
                    plain + "\nlogits *= self.scale", plain + "\nhidden_states /= 2",
                    plain + "\nlogits = torch.tanh(logits)",
                    plain.replace("self.lm_head", "self.other_head")):
        assert transforms_head_output(changed, "lm_head", "model"), changed


def test_auto_chunks_large_vocabularies_only():
    """The default, ``trainer.loss_chunk_tokens=auto``: the plain loss on small vocabularies (the
    default model's 256, where chunking measured slower), chunks from 32k up; the planner agrees."""
    assert chunk_tokens_for("auto", 256) == 0
    assert chunk_tokens_for("auto", AUTO_CHUNK_MIN_VOCAB - 1) == 0
    assert chunk_tokens_for("auto", AUTO_CHUNK_MIN_VOCAB) == DEFAULT_CHUNK_TOKENS
    assert chunk_tokens_for(0, 128_000) == 0 and chunk_tokens_for(64, 256) == 64
    assert load_config([]).trainer.loss_chunk_tokens == "auto"
    shape = ["model.vocab_size=32000", "model.dim=64", "model.n_layers=1", "trainer.micro_batch_size=2",
             "trainer.seq_len=1024"]
    peaks = {}
    for setting in ("auto", 0, DEFAULT_CHUNK_TOKENS):
        cfg = load_config([*shape, f"trainer.loss_chunk_tokens={setting}"])
        with torch.device("meta"):
            model = build_model(cfg.model)
        peaks[setting] = estimate(cfg, model, "FULL_SHARD", 2, 2).peak
    assert peaks["auto"] == peaks[DEFAULT_CHUNK_TOKENS] < peaks[0]


def test_the_start_up_report_names_the_loss_and_why():
    """LanguageModelTask.describe (the start-up report's task line) says which loss the built
    model gets: chunked and its chunk, plain and why, or the tensor-parallel sharded one."""
    big = "model.vocab_size=32000"
    cases = [([big], "chunked, 256 tokens at a time (vocabulary 32,000)"),
             ([], "plain, full logits (vocabulary 256, auto: below 32,000)"),
             (["trainer.loss_chunk_tokens=0", big], "plain, full logits (vocabulary 32,000)"),
             (["trainer.loss_chunk_tokens=64"], "chunked, 64 tokens at a time (vocabulary 256)"),
             (["strategy.tensor_parallel=2", "trainer.devices=2", "model.ffn_hidden_dim=96"],
              "on the vocabulary-sharded logits (tensor parallel)")]
    for overrides, expected in cases:
        task = LanguageModelTask()
        task.bind(load_config(["model=llama_tiny", *overrides]))
        with torch.device("meta"):
            task.build_model()
        assert task.loss_kind == expected, overrides

    class OwnPlan(LanguageModelTask):  # may leave the head whole: the report does not say sharded
        def parallelize_tensors(self, model, tp_mesh, sequence_parallel: bool) -> None:
            pass

    task = OwnPlan()
    task.bind(load_config(["model=llama_tiny", *cases[-1][0]]))
    with torch.device("meta"):
        task.build_model()
    assert task.loss_kind.startswith("plain, on the logits the task's tensor-parallel plan gives")


class HeadLossTask(Task):
    """A task of its own on a tiny Llama, its loss the plain cross-entropy of the logits."""

    def build_model(self) -> torch.nn.Module:
        return Llama(ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=300, max_seq_len=16))

    def train_dataset(self):
        tokens = torch.randint(0, 300, (8, 9), generator=torch.Generator().manual_seed(0))
        return [{"tokens": row[:-1], "targets": row[1:]} for row in tokens]

    def loss(self, model, batch):
        logits = model(batch["tokens"]).float()
        return LossOutput(F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="sum"),
                          batch["targets"].numel())


class ChunkedHeadLossTask(HeadLossTask):
    """The same loss by the chunked helper, which computes the head's gradients in its forward."""

    def loss(self, model, batch):
        hidden = model(batch["tokens"], hidden_only=True)
        total = chunked_cross_entropy(hidden, model.output.weight, batch["targets"], chunk_tokens=8)
        return LossOutput(total, batch["targets"].numel())


def test_the_flop_counter_counts_a_chunked_loss_as_the_plain_one():
    """Found by review: counted as 3x its forward, a loss computing its gradients in its forward was
    counted twice over (and the helper's addmm_, which the counter skips, lost a third of the
    head's); forward and backward are counted now, the same for both."""
    plain, chunked = (counted_flops_per_sample(cls(), 4) for cls in (HeadLossTask, ChunkedHeadLossTask))
    assert plain[1] is None and chunked[1] is None
    assert plain[0] == chunked[0] > 0
