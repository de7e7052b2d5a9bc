"""``data.document_mask``: a packed window's per-token losses equal those of each of its documents
run alone, for the built-in Llama (byte tokens, no end-of-text token) and Hugging Face models
(their tokenizer's end-of-text token after every document), on batches from a prepared dataset."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_models import make_model_dir
from torch import nn

from shardtrain.config.schema import ModelConfig
from shardtrain.data.batches import IGNORE_INDEX, TokenWindows, positions_in_window
from shardtrain.data.prepare import PrepareOptions, prepare
from shardtrain.data.prepared import open_prepared
from shardtrain.errors import ConfigError, DataError, ModelError
from shardtrain.models.hf import HFCausalLM, sequence_state_reason
from shardtrain.models.llama import Llama
from shardtrain.models.masking import check_document_mask_support, document_causal_mask

SEQ_LEN = 64
# Documents of 1 to 5 short lines: a window of 64 tokens holds several, and cuts some at its edges.
TEXTS = [f"y{i} = x * {i % 7}\n" * (1 + i % 5) for i in range(60)]
# Largest per-token difference allowed between a packed window and its documents alone (fp32; the
# summation order differs, measured ~1e-6 at most).
TOLERANCE = 1e-5


def prepared_windows(directory, tokenizer: str) -> TokenWindows:
    (directory / "texts").mkdir(parents=True)
    for i, text in enumerate(TEXTS):
        (directory / "texts" / f"{i:03d}.txt").write_text(text)
    # Small shards: windows cross shard boundaries, so document starts are read from several.
    prepare(PrepareOptions(inputs=[str(directory / "texts")], tokenizer=tokenizer, val_percent=0.0,
                           shard_tokens=300), directory / "prepared", progress=False)
    dataset = open_prepared(directory / "prepared")
    assert len(dataset.manifest["splits"]["train"]["shards"]) > 3
    return TokenWindows(dataset.train, SEQ_LEN, "test data", document_mask=True)


def segments(positions: torch.Tensor) -> list[tuple[int, int]]:
    """The (start, stop) of each document piece in one row of positions."""
    starts = torch.nonzero(positions == 0).flatten().tolist()
    return list(zip(starts, starts[1:] + [len(positions)], strict=True))


def per_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none").view(targets.shape)


@torch.no_grad()
def packed_and_alone(model: nn.Module, windows: TokenWindows) -> tuple[float, float]:
    """Over every window: the largest difference between a token's loss in the packed window with
    document masking and in its document run alone, and the same without the mask."""
    batch = windows.batch(np.arange(windows.num_samples))
    packed = per_token_losses(model(batch.inputs, positions=batch.positions), batch.targets)
    unmasked = per_token_losses(model(batch.inputs), batch.targets)
    alone = torch.zeros_like(packed)
    for row in range(len(batch.inputs)):
        for start, stop in segments(batch.positions[row]):
            piece = slice(start, stop)
            logits = model(batch.inputs[row:row + 1, piece])
            alone[row, piece] = per_token_losses(logits, batch.targets[row:row + 1, piece])[0]
    return (packed - alone).abs().max().item(), (unmasked - alone).abs().max().item()


def test_windows_restart_positions_at_each_document_and_ignore_crossing_targets(tmp_path):
    """Positions count from each document's first token (or the window's); a target that is the
    next document's first token is ignored; every other token is a target as without masking."""
    windows = prepared_windows(tmp_path, "bytes")
    plain = TokenWindows(windows.tokens, SEQ_LEN)
    ids = np.arange(windows.num_samples)
    masked, unmasked = windows.batch(ids), plain.batch(ids)
    assert torch.equal(masked.inputs, unmasked.inputs) and unmasked.positions is None
    starts = windows.tokens.document_starts(0, len(windows.tokens))
    assert len(starts) == len(TEXTS)
    crossings = 0
    for row in ids:
        first = row * SEQ_LEN
        inside = starts[(starts > first) & (starts <= first + SEQ_LEN)] - first
        expected = [t - max([0] + [s for s in inside if s <= t]) for t in range(SEQ_LEN)]
        assert masked.positions[row].tolist() == expected
        ignored = torch.nonzero(masked.targets[row] == IGNORE_INDEX).flatten().numpy()
        assert np.array_equal(ignored, inside - 1)
        crossings += len(inside)
    assert crossings > windows.num_samples  # windows hold several documents
    assert positions_in_window(np.array([3, 5]), 8).tolist() == [0, 1, 2, 0, 1, 0, 1, 2]

    mask = document_causal_mask(torch.tensor([[0, 1, 2, 0, 1]]))[0, 0]
    assert mask.tolist() == [[True, False, False, False, False], [True, True, False, False, False],
                             [True, True, True, False, False], [False, False, False, True, False],
                             [False, False, False, True, True]]


def test_built_in_llama_packed_window_equals_documents_alone(tmp_path):
    torch.manual_seed(0)
    model = Llama(ModelConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, max_seq_len=128)).eval()
    masked, unmasked = packed_and_alone(model, prepared_windows(tmp_path, "bytes"))
    print(f"built-in Llama: packed vs alone {masked:.2e}, without the mask {unmasked:.2e}")
    assert masked < TOLERANCE
    assert unmasked > 100 * TOLERANCE  # the comparison can fail: attention across documents shows
    # Positions a task got wrong are refused, not read from the rotary table's end (negative) or
    # past it; a head size RoPE cannot rotate is refused by name where a ModelConfig is made in code.
    tokens = torch.zeros(1, 4, dtype=torch.long)
    for wrong in ([[0, 1, -1, 0]], [[0, 1, 128, 0]]):
        with pytest.raises(RuntimeError, match="a position is outside 0..model.max_seq_len-1 \\(127\\)"):
            model(tokens, positions=torch.tensor(wrong))
    with pytest.raises(ModelError, match="must have the tokens' shape"):
        model(tokens, positions=torch.arange(3)[None])
    with pytest.raises(ConfigError, match="the head size.*must be even"):
        Llama(ModelConfig(dim=30, n_heads=2, n_kv_heads=1))


@pytest.mark.parametrize(("family", "sizes"), [("llama", {}), ("gpt_neox", {}),
                                               ("mistral", {"sliding_window": 4}),
                                               ("gemma2", {"sliding_window": 4})],
                         ids=["llama", "gpt_neox", "mistral_sliding_window", "gemma2_eager_sliding_window"])
def test_hf_packed_window_equals_documents_alone(family, sizes, tmp_path):
    """transformers models, given restarted position_ids, from which transformers builds its own
    mask: GPT-NeoX (partial rotary, a fused QKV projection, its own attention code), Mistral with a
    4-token sliding window, which must still apply inside each document, and Gemma 2 the same in its
    eager attention (no SDPA: the mask is built for the family's own code)."""
    from transformers import AutoModelForCausalLM

    directory = make_model_dir(tmp_path / "model", family, **sizes)
    model = HFCausalLM(ModelConfig(name="hf", path=str(directory)))
    model.hf.load_state_dict(AutoModelForCausalLM.from_pretrained(str(directory)).state_dict())
    windows = prepared_windows(tmp_path, str(directory))
    assert windows.tokens.document_starts(0, len(windows.tokens)).size == len(TEXTS)
    masked, unmasked = packed_and_alone(model.eval(), windows)
    print(f"{family}: packed vs alone {masked:.2e}, without the mask {unmasked:.2e}")
    assert masked < TOLERANCE
    assert unmasked > 100 * TOLERANCE


def test_document_mask_needs_document_starts_and_a_model_that_takes_positions():
    with pytest.raises(DataError, match="needs to know where documents begin"):
        TokenWindows(np.zeros(100, dtype=np.uint16), 16, "evaluation data", document_mask=True)

    class NoPositions(nn.Module):
        def forward(self, tokens):
            return tokens

    with pytest.raises(ModelError, match=r"NoPositions.forward does not.*data.document_mask=false"):
        check_document_mask_support(NoPositions())
    check_document_mask_support(Llama(ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1)))


def test_models_that_carry_state_along_the_sequence_are_refused():
    """Masking attention cannot separate documents in recurrent, convolution or state-space layers:
    such Hugging Face models are recognised from their config and refused."""
    import transformers

    class Recurrent(nn.Module):
        def forward(self, tokens, positions=None):
            return tokens

        def document_mask_refusal(self):
            return "it is recurrent"

    with pytest.raises(ModelError, match="cannot keep this model's documents apart: it is recurrent"):
        check_document_mask_support(Recurrent())
    refused = {name: sequence_state_reason(getattr(transformers, name)()) for name in (
        "JambaConfig", "Qwen3NextConfig", "RecurrentGemmaConfig", "MambaConfig", "Lfm2Config",
        "OPTConfig", "BioGptConfig", "GptOssConfig", "BloomConfig", "MptConfig", "XGLMConfig")}
    assert all(refused.values()), refused
    # OPT, BioGPT and GPT-OSS mask causally over the whole window, positions or not (found by
    # reviews: GPT-OSS's logits 0.27 off)
    assert "without the documents' positions" in refused["OPTConfig"]
    assert "without the documents' positions" in refused["GptOssConfig"]
    assert "linear_attention" in refused["Qwen3NextConfig"] and "mamba_" in refused["JambaConfig"]
    for name in ("LlamaConfig", "MistralConfig", "GPTNeoXConfig", "Gemma3TextConfig", "Qwen3MoeConfig"):
        assert sequence_state_reason(getattr(transformers, name)()) is None, name
