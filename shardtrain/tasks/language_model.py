"""The built-in task: a causal language model trained with next-token cross-entropy over token
windows, for the built-in Llama, any local Hugging Face causal LM (``model.*``) or a module the user
brings that maps token ids to logits, on the data of ``data.*``.

It is a task like any other: the framework trains it through the same step, loop and checkpoints.
What is particular to it lives here: the prepared, memory-mapped token windows (and mixtures) with
their vectorised batching, the count of target tokens known before the forward (so the loss is
divided by the global token count before backward, as torchtitan does), and the FLOPs formula.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardtrain.config.schema import ModelConfig
from shardtrain.data.batches import IGNORE_INDEX, Batch, InterleavedWindows, MixtureWindows, TokenWindows
from shardtrain.data.corpus import Corpus, load_corpus
from shardtrain.data.tokenizer import Tokenizer, tokenizer_for, tokenizer_source
from shardtrain.errors import ConfigError, DataError, ModelError
from shardtrain.models.lora import adapter_flops_per_token
from shardtrain.models.masking import check_document_mask_support
from shardtrain.models.registry import build_model
from shardtrain.tasks.losses import AUTO_CHUNK_MIN_VOCAB, chunk_tokens_for, chunked_cross_entropy
from shardtrain.tasks.task import LossOutput, Task

log = logging.getLogger("shardtrain")


def output_head(model: nn.Module) -> nn.Linear | None:
    """The model's head when it can give hidden states instead of logits (``hidden_only=True``) and
    its logits are that head's output and nothing more; None for a module that only maps to logits."""
    head = getattr(model, "output_head", None)
    return head() if callable(head) else None


def embedding_rows(model: nn.Module) -> int | None:
    """How many token ids the model's input embedding holds (``input_embedding``), if it says."""
    embedding = getattr(model, "input_embedding", None)
    weight = getattr(embedding(), "weight", None) if callable(embedding) else None
    return None if weight is None else int(weight.shape[0])


def router_loss_coefficient(model: nn.Module) -> float:
    """The weight of a MoE model's router load-balancing loss in its training loss (its config's
    ``router_aux_loss_coef`` where ``output_router_logits`` asks for it); 0 for other models."""
    return float(getattr(model, "router_loss_coef", 0.0))


def token_loss_sum(model: nn.Module, batch: Batch, chunk_tokens: int = 0) -> torch.Tensor:
    """Summed cross-entropy over the target tokens; ``positions`` (document masking) go to the model.

    ``chunk_tokens`` > 0, for a model with an ``output_head``: the head and the loss chunk by chunk
    (``chunked_cross_entropy``), never the full fp32 logits; otherwise from the model's logits."""
    return token_loss_terms(model, batch, chunk_tokens)[0]


def token_loss_terms(model: nn.Module, batch: Batch, chunk_tokens: int = 0,
                     router_loss: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_loss_sum``, and with ``router_loss`` the same forward's router load-balancing loss
    (a MoE model's, ``router_loss_coefficient``; unscaled, over the batch's tokens, not its
    padding), else None."""
    kwargs = {} if batch.positions is None else {"positions": batch.positions}
    if router_loss:
        kwargs.update(router_loss=True, token_mask=batch.token_mask())
    head = output_head(model) if chunk_tokens > 0 else None
    if head is not None:
        kwargs["hidden_only"] = True
    out = model(batch.inputs, **kwargs)
    out, routers = out if router_loss else (out, None)
    if head is not None:
        return chunked_cross_entropy(out, head.weight, batch.targets, bias=head.bias,
                                     chunk_tokens=chunk_tokens, ignore_index=IGNORE_INDEX), routers
    loss = F.cross_entropy(out.float().flatten(0, 1), batch.targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    # Tensor-parallel logits are a DTensor split along the vocabulary; under the step's
    # ``loss_parallel`` the summed loss is replicated over the group: every rank's local value is it.
    return (loss.to_local() if isinstance(loss, DTensor) else loss), routers


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: the model's own formula, else 6 per parameter."""
    if hasattr(model, "flops_per_token"):
        return float(model.flops_per_token(seq_len))
    return 6.0 * sum(p.numel() for p in model.parameters())


class LanguageModelTask(Task):
    """``model``: a factory of the module to train (default: ``model.*``'s built-in or Hugging Face
    model); ``wrap_policy``: its block classes (default: ``strategy.wrap_policy``); ``corpus``: the
    token data (default: ``data.*``, prepared and memory-mapped)."""

    count_unit = "tokens"

    def __init__(self, *, model: Callable[[], nn.Module] | None = None,
                 wrap_policy: Sequence[type | str] | None = None, corpus: Corpus | None = None) -> None:
        super().__init__()
        if isinstance(model, nn.Module):  # callable, so it ran forward() with no input (found by review)
            name = type(model).__name__
            raise ConfigError(f"LanguageModelTask(model=...) takes a factory that builds the module, not a "
                              f"built {name}: pass model={name} or model=lambda: {name}(...) (the framework "
                              "builds it on the meta device, then shards it)")
        self.model_factory = model
        self.blocks = wrap_policy
        self.given_corpus = corpus
        self.corpus = corpus
        self.tokenizer: Tokenizer | None = None
        self.flops_per_token = 0.0
        self.loss_kind = ""  # which loss ``loss`` takes, known once the model is built
        self.train_windows: TokenWindows | MixtureWindows | None = None  # this binding's

    def bind(self, cfg) -> None:
        super().bind(cfg)
        self.tokenizer = tokenizer_for(cfg.model)
        # The corpus of this run's data.* (the object passed to another run, a sweep, read that
        # run's corpus, tokenized with its tokenizer); one given to the constructor stays.
        self.corpus = self.given_corpus
        self.train_windows = None

    def load_corpus(self) -> Corpus:
        if self.corpus is None:
            self.corpus = load_corpus(self.cfg.data, self.tokenizer)
        return self.corpus

    def new_model(self, model_cfg: ModelConfig) -> nn.Module:
        """The module to train as it is made (the factory's, else ``model.*``'s), before
        ``build_model``'s checks against the tokenizer and the data."""
        return self.model_factory() if self.model_factory is not None else build_model(model_cfg)

    def build_model(self) -> nn.Module:
        model = self.new_model(self.cfg.model)
        rows = embedding_rows(model)
        if rows is not None and self.tokenizer is not None and self.tokenizer.vocab_size > rows:
            # An id past the rows is an IndexError deep in the first step on a CPU, a device-side
            # assert on one rank of an accelerator (its peers waiting in a collective).
            raise DataError(f"the tokenizer ({tokenizer_source(self.cfg.model)}) has ids up to "
                            f"{self.tokenizer.vocab_size - 1} but the model's input embedding has {rows} "
                            "rows; use the model's own tokenizer (model.tokenizer=auto), or resize the "
                            "model's embeddings to the tokenizer first")
        refusal = getattr(model, "training_refusal", None)  # a Hugging Face config unfit for it
        if refusal is not None and (reason := refusal()):
            raise ModelError(reason)
        if self.cfg.data.document_mask:
            check_document_mask_support(model)
        full = flops_per_token(model, self.cfg.trainer.seq_len)
        self.flops_per_token = adapter_flops_per_token(model, full, self.cfg.finetune)
        if self.cfg.trainer.loss_chunk_tokens not in (0, "auto") and output_head(model) is None:
            reason = getattr(model, "head_transform", None) or "the model gives only logits"
            log.info("trainer.loss_chunk_tokens: the plain full-logits loss instead (%s)", reason)
        self.loss_kind = self.describe_loss(model)
        return model

    def describe_loss(self, model: nn.Module) -> str:
        """Which cross-entropy ``loss`` takes for this model, and why (the start-up report); nothing
        for a subclass whose loss is its own."""
        if type(self).loss is not LanguageModelTask.loss:
            return ""
        return self.loss_choice(model)[1]

    def loss_choice(self, model: nn.Module) -> tuple[int, str]:
        """Tokens per chunk of ``loss``'s head and cross-entropy for this model (0: the whole logits
        at once), and why, in the start-up report's words."""
        # An unbound task (eval and generation use it without a training config) takes the plain loss.
        if self.cfg is None:
            return 0, "plain, from the model's logits"
        # Under tensor parallelism the logits stay vocabulary-sharded (loss_parallel): never chunked.
        # A task's own plan may leave the head whole, which is not known before it is applied.
        if self.cfg.strategy.tensor_parallel > 1 and self.tensor_parallel_hook() is not None:
            return 0, ("plain, on the logits the task's tensor-parallel plan gives (vocabulary-sharded "
                       "if it splits the head)")
        if self.cfg.strategy.tensor_parallel > 1:
            return 0, "on the vocabulary-sharded logits (tensor parallel)"
        head = output_head(model)
        if head is None:
            return 0, "plain, from the model's logits"
        setting, vocab = self.cfg.trainer.loss_chunk_tokens, head.weight.shape[0]
        chunk = chunk_tokens_for(setting, vocab)
        if chunk:
            return chunk, f"chunked, {chunk} tokens at a time (vocabulary {vocab:,})"
        why = f", auto: below {AUTO_CHUNK_MIN_VOCAB:,}" if setting == "auto" else ""
        return 0, f"plain, full logits (vocabulary {vocab:,}{why})"

    def wrap_policy(self) -> Sequence[type | str] | None:
        return self.blocks

    def train_samples(self) -> TokenWindows | MixtureWindows:
        # Made once a binding: describe() reads them too, and making them again said a too-long
        # record's warning twice (found by a trial)
        if self.train_windows is None:
            self.train_windows = self.load_corpus().train_windows(
                self.cfg.trainer.seq_len, self.cfg.data.document_mask, self.cfg.data.packing)
        return self.train_windows

    def val_samples(self) -> TokenWindows | InterleavedWindows:
        return self.load_corpus().val_windows(self.cfg.trainer.seq_len, self.cfg.data.document_mask,
                                              packing=self.cfg.data.packing)

    def example_batch(self, micro_batch_size: int) -> Batch:
        """Token ids of zeros (what the memory of a step depends on is their shape), with the
        per-token positions document masking adds."""
        tokens = torch.zeros(micro_batch_size, self.cfg.trainer.seq_len, dtype=torch.long)
        return Batch(tokens, tokens, torch.zeros_like(tokens) if self.cfg.data.document_mask else None)

    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        chunk_tokens, _ = self.loss_choice(model)
        count = (batch.targets != IGNORE_INDEX).sum()
        # A MoE model's router load-balancing loss trains with it, not in evaluation (val_loss and
        # eval stay the cross-entropy, in nats a token)
        coefficient = router_loss_coefficient(model) if model.training else 0.0
        loss, routers = token_loss_terms(model, batch, chunk_tokens, router_loss=coefficient > 0)
        if routers is None:
            return LossOutput(loss, count)
        # transformers' training loss over one batch is mean cross-entropy + coefficient x router loss;
        # here each micro-batch's router loss is weighed by its targets, so that over one micro-batch
        # the two are equal, and the router loss is logged as its mean over the micro-batches that
        # have targets (one of padding alone weighs nothing in either)
        trained = (count > 0).float()
        return LossOutput(loss + coefficient * routers.float() * count, count,
                          metrics={"router_loss": (routers.detach().float() * trained, trained)})

    def count(self, batch: Batch) -> float:
        return int((batch.targets != IGNORE_INDEX).sum())

    def flops(self, batch: Batch) -> float:
        return self.flops_per_token * batch.inputs.numel()

    def text_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def empty_count_hint(self, throughout: bool) -> str:
        if throughout:
            return ("the data's targets are masked throughout, as fine-tuning records longer than "
                    "trainer.seq_len leave them; raise trainer.seq_len or check the data")
        return "fine-tuning windows of prompts alone?"

    def describe(self) -> str:
        t = self.cfg.trainer
        loss = f"; loss {self.loss_kind}" if self.loss_kind else ""
        windows = self.train_samples()
        mixture = (f"; {windows.describe(dataset_names(self.cfg.data.paths))}"
                   if isinstance(windows, MixtureWindows) else "")
        return f"{self.load_corpus().describe()}; windows of {t.seq_len} tokens{mixture}{loss}"


def dataset_names(paths: Sequence[str]) -> list[str]:
    """The datasets' directory names, or their paths where two share a name."""
    names = [Path(path).name or path for path in paths]
    return names if len(set(names)) == len(names) else list(paths)
