"""JSON and safetensors files that are damaged or hold the wrong kind of value: one line naming the
file, never a traceback (found by a review of the commands' bad inputs: a list where an object was
expected gave AttributeError, invalid JSON a JSONDecodeError, a truncated adapter a SafetensorError)."""

from __future__ import annotations

import errno
import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from shardtrain.checkpoint.inspect import inspect_path
from shardtrain.checkpoint.peft_adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_weights,
    read_adapter_config,
)
from shardtrain.checkpoint.safetensors_files import indexed_files
from shardtrain.cli.paths import os_failure
from shardtrain.config.compose import compose_config
from shardtrain.config.schema import ModelConfig
from shardtrain.data.prepare import read_manifest
from shardtrain.data.prepared import open_prepared
from shardtrain.errors import CheckpointError, ConfigError, DataError, ModelError, json_object
from shardtrain.models.hf import read_config

NOT_OBJECTS = ("[]", "3", "null", '"text"', "{", "\xff")


@pytest.mark.parametrize("text", NOT_OBJECTS)
def test_json_object_names_the_file_and_the_fix(tmp_path, text):
    file = tmp_path / "settings.json"
    file.write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"^{file} (is not valid JSON \(.+\)|holds a JSON \w+, not an "
                                          r"object); do this$"):
        json_object(file, ConfigError, "do this")
    file.write_text('{"a": 1}')
    assert json_object(file, ConfigError, "do this") == {"a": 1}


def test_each_reader_of_a_json_object_refuses_another_value(tmp_path):
    # A Hugging Face model directory's config.json: at the config (train, plan) and at the model
    # (generate and eval read it there).
    model = tmp_path / "model"
    model.mkdir()
    for text in ("[]", "{"):
        (model / "config.json").write_text(text)
        with pytest.raises(ConfigError, match="config.json (holds a JSON list|is not valid JSON)"):
            compose_config(["model=hf", f"model.path={model}"])
        with pytest.raises(ModelError, match="config.json (holds a JSON list|is not valid JSON)"):
            read_config(ModelConfig(name="hf", path=str(model)))
    # A safetensors index whose weight_map is not names to files.
    index = tmp_path / "model.safetensors.index.json"
    for weight_map in (None, [], {"w": 5}):
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CheckpointError, match="not a valid safetensors index"):
            indexed_files(index)
        report = inspect_path(index)  # damaged (inspect exits 1), not "no checkpoint" (2)
        assert not report.complete and "not a valid safetensors index" in report.problems[0]
    # An index that maps names to files that do not hold them (found by review: "complete", while
    # transformers, which looks each name up in it, fails to load the directory)
    save_file({"a": torch.zeros(2), "b": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"c": torch.zeros(2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    index.write_text(json.dumps({"weight_map": {"a": first, "b": first, "c": second}}))
    assert inspect_path(index).complete
    index.write_text(json.dumps({"weight_map": {"a": first, "b": second, "ghost": second}}))
    report = inspect_path(index)
    assert not report.complete and report.problems == [
        f"{index.name} maps b to {second}, which does not hold it ({first} does)",
        f"{index.name} maps ghost to {second}, which does not hold it",
        f"{index.name} does not name c (in {second})"]
    # A prepared dataset's manifest: a list is no manifest (prepare refuses the directory as one it
    # did not make; training refuses it).
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("[]")
    assert read_manifest(data) is None
    with pytest.raises(DataError, match="manifest.json is not a version-"):
        open_prepared(data)


def test_a_damaged_peft_adapter_is_one_line(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file({"base_model.model.layers.0.q_proj.lora_A.weight": torch.zeros(2, 4)},
              str(adapter / ADAPTER_WEIGHTS))
    for text, message in (("{", "is not valid JSON"), ("[]", "holds a JSON list"),
                          ('{"peft_type": "LORA", "lora_alpha": 8}', "has no number r"),
                          ('{"peft_type": "LORA", "r": 4, "lora_alpha": "8"}', "has no number lora_alpha")):
        (adapter / ADAPTER_CONFIG).write_text(text)
        with pytest.raises(ConfigError, match=message):
            read_adapter_config(adapter)
    (adapter / ADAPTER_CONFIG).write_text('{"peft_type": "IA3"}')  # another kind first, without r
    with pytest.raises(ConfigError, match="is a IA3 adapter; finetune=lora starts from LoRA adapters only"):
        read_adapter_config(adapter)
    (adapter / ADAPTER_CONFIG).write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')
    assert read_adapter_config(adapter)["r"] == 4
    # Found by review: variants on the same lora_A/lora_B weights that compute otherwise (aLoRA's
    # invocation tokens: logits 0.3-0.5 off plain LoRA's) were read as plain LoRA; a field this PEFT
    # does not know is refused unless empty. PEFT's own full config of plain LoRA is read.
    from peft import LoraConfig

    plain = json.loads(json.dumps(LoraConfig(r=4, lora_alpha=8).to_dict(), default=str))
    for key, value, said in (("alora_invocation_tokens", [7, 8],
                              "only plain LoRA (alora_invocation_tokens=None)"),
                             ("use_dora", True, "only plain LoRA (use_dora=False)"),
                             ("lora_bias", True, "only plain LoRA (lora_bias=False)"),
                             ("a_future_variant", {"x": 1}, "only plain LoRA (no a_future_variant)")):
        (adapter / ADAPTER_CONFIG).write_text(json.dumps({**plain, "peft_type": "LORA", key: value}))
        with pytest.raises(ConfigError, match=f"sets {key}=.*: {re.escape(said)} is supported"):
            read_adapter_config(adapter)
    # ... and an initialisation that changed the base too (found by the diff review: PiSSA's trained
    # A and B read onto the original base, 6% off), named with the conversion that makes it plain
    for init in ("pissa", "pissa_niter_4", "olora", "loftq", "corda"):
        (adapter / ADAPTER_CONFIG).write_text(json.dumps({**plain, "peft_type": "LORA",
                                                          "init_lora_weights": init}))
        with pytest.raises(ConfigError, match=f"init_lora_weights='{init}', which changes the base weights "
                                              r"as well: .*path_initial_model_for_weight_conversion"):
            read_adapter_config(adapter)
    for init in (True, False, "gaussian", "eva", "orthogonal"):
        (adapter / ADAPTER_CONFIG).write_text(json.dumps({**plain, "peft_type": "LORA",
                                                          "init_lora_weights": init}))
        assert read_adapter_config(adapter)["init_lora_weights"] == init
    unknown_but_empty = {**plain, "peft_type": "LORA", "a_future_variant": None}
    (adapter / ADAPTER_CONFIG).write_text(json.dumps(unknown_but_empty))
    assert read_adapter_config(adapter)["lora_alpha"] == 8
    assert list(adapter_weights(adapter)) == ["base_model.model.layers.0.q_proj.lora_A.weight"]
    weights = adapter / ADAPTER_WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-8])  # truncated
    with pytest.raises(CheckpointError, match=f"{weights} is not a readable safetensors file"):
        adapter_weights(adapter)


def test_a_refused_permission_names_reading_or_writing(tmp_path, monkeypatch):
    """Found by review: a shard this user cannot read was told to be made writable. (This suite runs
    as root, for whom every file is readable: os.access is what a user's session would answer.)"""
    shard = tmp_path / "__0_0.distcp"
    shard.write_bytes(b"x")
    refused = PermissionError(errno.EACCES, "Permission denied", str(shard))
    assert os_failure(refused).endswith("make the path writable, or choose another (the run directory, the "
                                        "data cache, the output)")
    monkeypatch.setattr(os, "access", lambda path, mode: mode != os.R_OK)
    assert os_failure(refused) == (f"[Errno 13] Permission denied: '{shard}'; make it readable by this "
                                   "user (its owner or mode), or point at a copy you can read")
    # A place to write that does not exist yet is always about writing.
    missing = PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "new" / "out"))
    assert "make the path writable" in os_failure(missing)


def test_a_quoted_home_is_the_path_written(tmp_path, monkeypatch):
    """Found by review: the output was checked as $HOME/m.safetensors and written to ./~/m.safetensors."""
    import torch.distributed.checkpoint as dcp

    from shardtrain.cli.main import main

    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=str(tmp_path / "ckpt"))
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main(["consolidate", str(tmp_path / "ckpt"), "~/m.safetensors", "--skip-checksums"]) == 0
    assert (tmp_path / "home" / "m.safetensors").is_file() and not (tmp_path / "~").exists()


def test_a_checkpoint_of_a_newer_format_is_not_damage(tmp_path):
    """Found by review: a newer shardtrain's format was 'unknown', which resume=auto took for damage:
    it skipped the checkpoint, resumed an older one, and later moved the newer one aside."""
    from shardtrain.checkpoint.state import STATE_FILE, TrainState
    from shardtrain.errors import CheckpointFromNewerVersion, CheckpointUnverifiable

    (tmp_path / STATE_FILE).write_text(json.dumps({"format": "shardtrain-checkpoint-v2",
                                                   "versions": {"shardtrain": "9.0"}}))
    with pytest.raises(CheckpointFromNewerVersion, match=r"is in format 'shardtrain-checkpoint-v2', written "
                                                         r"by shardtrain 9.0; this one .* reads "
                                                         r"'shardtrain-checkpoint-v1'"):
        TrainState.read(tmp_path)
    (tmp_path / STATE_FILE).write_text(json.dumps({"format": "someone-else"}))
    with pytest.raises(CheckpointError, match="unknown format 'someone-else'") as refused:
        TrainState.read(tmp_path)
    assert not isinstance(refused.value, CheckpointUnverifiable)  # another tool's: skipped as before
    # A field a later shardtrain added within the same format is read past (docs/checkpoints.md)
    from omegaconf import OmegaConf

    from shardtrain.config.schema import Config
    TrainState(step=2, tokens_seen=0, consumed_samples=4, global_batch=2, scheduler={}, world_size=1,
               strategy="FULL_SHARD", mesh_shape=[1], mesh_dim_names=["dp_shard"], mixed_precision="fp32",
               config=OmegaConf.to_container(OmegaConf.structured(Config())), config_hash="abc",
               versions={"shardtrain": "9.0"}, saved_at="now").write(tmp_path)
    raw = json.loads((tmp_path / STATE_FILE).read_text())
    from shardtrain.checkpoint.state import state_digest
    later = {**raw, "added_later": {"any": 1}}
    (tmp_path / STATE_FILE).write_text(json.dumps({**later, "sha256": state_digest(later)}))
    assert TrainState.read(tmp_path).step == 2
