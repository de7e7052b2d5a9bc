"""Hugging Face Llama interop: export a checkpoint as a ``LlamaForCausalLM`` directory, and start a
run from one (``model.init_from=hf:<dir>``). Both stream one tensor at a time; transformers itself is
not needed for either (it is only used by the tests, as the judge).

Names map one to one; the query and key projections are permuted because shardtrain's RoPE rotates
adjacent pairs (Meta's layout) while transformers rotates the two halves of each head.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from shardtrain.config.schema import ModelConfig
from shardtrain.errors import CheckpointError
from shardtrain.models.llama import ffn_hidden_dim

LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
HF_TO_OURS_LAYER = {v: k for k, v in LAYER_NAMES.items()}
HF_TO_OURS_TOP = {v: k for k, v in TOP_NAMES.items()}


def to_hf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    match = LAYER.match(name)
    if not match or match.group(2) not in LAYER_NAMES:
        raise CheckpointError(f"no Hugging Face name for parameter {name!r}")
    return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}"


def from_hf_name(name: str) -> str | None:
    if name in HF_TO_OURS_TOP:
        return HF_TO_OURS_TOP[name]
    match = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    if match and match.group(2) in HF_TO_OURS_LAYER:
        return f"layers.{match.group(1)}.{HF_TO_OURS_LAYER[match.group(2)]}"
    return None  # e.g. rotary inv_freq buffers in old exports


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection: per head, pairs (0,1),(2,3)... -> halves (0..d/2, d/2..d)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": ffn_hidden_dim(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim // cfg.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
        "dtype": str(dtype).replace("torch.", ""),
        "bos_token_id": None,
        "eos_token_id": None,
    }


def model_config_from_hf(config: dict) -> ModelConfig:
    rope = config.get("rope_parameters") or {}
    return ModelConfig(
        vocab_size=config["vocab_size"], dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        ffn_hidden_dim=config["intermediate_size"],
        max_seq_len=config.get("max_position_embeddings", 2048),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        norm_eps=config.get("rms_norm_eps", 1e-5),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def export_hf(checkpoint: str | Path, out_dir: str | Path, max_shard_size: str = "2GB",
              dtype: str | None = None) -> list[Path]:
    """A transformers-loadable Llama directory from a shardtrain checkpoint (or its safetensors)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from shardtrain.export.consolidate import DTYPES, consolidate
    from shardtrain.generation.inference import model_config_of

    src, out = Path(checkpoint), Path(out_dir)
    cfg = model_config_of(src)
    if cfg.name != "llama":
        raise CheckpointError(f"export-hf supports the built-in llama model, not {cfg.name!r}")
    out.mkdir(parents=True, exist_ok=True)
    # Stream: consolidate shard by shard into a staging area, then rename and permute per tensor.
    staging = out / ".staging"
    staged = [src] if src.is_file() else consolidate(src, staging, max_shard_size=max_shard_size)
    cast = DTYPES[dtype] if dtype else None
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    total = 0
    parts = [p for p in staged if p.suffix == ".safetensors"]
    out_dtype = None
    for index, part in enumerate(parts, start=1):
        tensors = {}
        with safe_open(str(part), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if name.endswith("attention.wq.weight"):
                    t = interleaved_to_halves(t, cfg.n_heads)
                elif name.endswith("attention.wk.weight"):
                    t = interleaved_to_halves(t, cfg.n_kv_heads)
                if name == "output.weight" and cfg.tie_embeddings:
                    continue
                t = (t.to(cast) if cast is not None else t).contiguous()
                out_dtype = t.dtype
                tensors[to_hf_name(name)] = t
        name = "model.safetensors" if len(parts) == 1 else \
            f"model-{index:05d}-of-{len(parts):05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        files.append(out / name)
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
        del tensors
    if cfg.tie_embeddings:
        weight_map.pop("lm_head.weight", None)
    if staging.exists():
        for p in staging.iterdir():
            p.unlink()
        staging.rmdir()
    index_file = out / "model.safetensors.index.json"
    index_file.write_text(json.dumps({"metadata": {"total_size": total},
                                      "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    files.append(index_file)
    config_file = out / "config.json"
    config_file.write_text(json.dumps(hf_config(cfg, out_dtype or torch.float32), indent=2) + "\n")
    files.append(config_file)
    return files


def hf_weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{directory} has no model.safetensors or model.safetensors.index.json "
                          "(only safetensors Hugging Face checkpoints are supported)")


def read_hf_config(directory: Path) -> dict:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{directory} has no config.json: not a Hugging Face model directory")
    config = json.loads(config_file.read_text())
    if config.get("model_type") != "llama":
        raise CheckpointError(f"{directory} holds a {config.get('model_type')!r} model; only llama "
                              "models can be imported")
    return config


def load_hf_into(model: nn.Module, cfg: ModelConfig, directory: str | Path) -> None:
    """``model.init_from=hf:<dir>``: fill the sharded model tensor by tensor, shard by shard."""
    from safetensors import safe_open

    from shardtrain.distributed.parallelize import shard_like

    directory = Path(directory).expanduser()
    theirs = model_config_from_hf(read_hf_config(directory))
    fields = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "tie_embeddings")
    mismatched = [f"model.{f}={getattr(cfg, f)} but the checkpoint has {getattr(theirs, f)}"
                  for f in fields if getattr(cfg, f) != getattr(theirs, f)]
    if ffn_hidden_dim(cfg) != ffn_hidden_dim(theirs):
        mismatched.append(f"model.ffn_hidden_dim={ffn_hidden_dim(cfg)} but the checkpoint has "
                          f"{ffn_hidden_dim(theirs)}")
    if mismatched:
        raise CheckpointError(f"{directory} does not fit the model config: " + "; ".join(mismatched))
    params = dict(model.named_parameters())
    loaded = set()
    with torch.no_grad():
        for file in hf_weight_files(directory):
            with safe_open(str(file), framework="pt") as f:
                for hf_name in f.keys():
                    name = from_hf_name(hf_name)
                    if name is None or name not in params:
                        continue
                    full = f.get_tensor(hf_name)
                    if name.endswith("attention.wq.weight"):
                        full = halves_to_interleaved(full, cfg.n_heads)
                    elif name.endswith("attention.wk.weight"):
                        full = halves_to_interleaved(full, cfg.n_kv_heads)
                    param = params[name]
                    if tuple(full.shape) != tuple(param.shape):
                        raise CheckpointError(f"{hf_name}: shape {list(full.shape)}, the model wants "
                                              f"{list(param.shape)}")
                    param.copy_(shard_like(full.to(param.dtype), param))
                    loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{directory} lacks weights for {missing[:6]}")
