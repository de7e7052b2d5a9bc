"""Text <-> token ids for data, generation and evaluation: bytes, or a Hugging Face fast tokenizer.

The built-in model reads raw bytes (256 ids, no special tokens). A Hugging Face model reads its own
``tokenizer.json`` through the ``tokenizers`` library (the Rust tokenizer transformers' fast tokenizers
wrap; nothing is downloaded), with the end-of-text token and chat template its
``tokenizer_config.json`` names. ``model.tokenizer`` picks one (``tokenizer_for``).
"""

from __future__ import annotations

import codecs
import hashlib
import json
from pathlib import Path
from typing import Protocol

import numpy as np
import tokenizers
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream

from shardtrain.config.schema import ModelConfig
from shardtrain.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# What ``export-hf`` copies from a Hugging Face model directory besides the weights and config.json.
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


class TextStream(Protocol):
    def push(self, token: int) -> str: ...

    def flush(self) -> str: ...


class Tokenizer(Protocol):
    name: str  # identity: "bytes", or "tokenizers:<sha256 of tokenizer.json, 16 hex digits>"
    source: str  # "bytes" or the path it was loaded from
    vocab_size: int
    eos_id: int | None  # appended after every document; None: documents are concatenated as they are
    stop_ids: frozenset[int]  # where generation ends: the end of text, and a model's end of turn
    chat_template: str | None

    def encode(self, text: str, special_tokens: bool = True) -> list[int]: ...

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...

    def encode_documents(self, documents: list[bytes]) -> list[list[int]] | list[np.ndarray]: ...

    def decode(self, ids: list[int]) -> str: ...

    def stream(self) -> TextStream: ...


class ByteStream:
    """Bytes -> whole characters: an unfinished UTF-8 character is held back until it is complete,
    bytes that can never form one become U+FFFD."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(bytes([token]))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def generation_stops(directory: Path, vocab_size: int) -> frozenset[int]:
    """The ids a model's ``generation_config.json`` ends generation at (``eos_token_id``, one or a
    list), as transformers' ``generate`` does: a chat model's end of turn is often not the
    tokenizer's end of text (Gemma's ``<end_of_turn>``, Llama 3's ``<|eot_id|>``)."""
    try:
        ids = json.loads((directory / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return frozenset()
    ids = ids if isinstance(ids, list) else [ids]
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size)


class ByteTokenizer:
    """The built-in model's tokens: the 256 byte values of the UTF-8 text."""

    name = "bytes"
    source = "bytes"
    vocab_size = 256
    eos_id = None
    stop_ids: frozenset[int] = frozenset()
    chat_template = None

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        raise DataError("the byte tokenizer has no chat template; chat needs a tokenizer with one "
                        "(a Hugging Face model's tokenizer_config.json or chat_template.jinja)")

    def encode_documents(self, documents: list[bytes]) -> list[np.ndarray]:
        # The bytes are the tokens: a view, where a list of ints costs ~36 bytes a byte (a large
        # single-document file ran out of memory).
        return [np.frombuffer(doc, dtype=np.uint8) for doc in documents]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def stream(self) -> ByteStream:
        return ByteStream()


class HFStream:
    """Token ids -> text as it becomes final (``tokenizers``' DecodeStream: byte-level BPE tokens that
    end inside a character print nothing until the character is whole)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=False)

    def push(self, token: int) -> str:
        return self._stream.step(self._tokenizer, token) or ""

    def flush(self) -> str:
        return ""


def raise_exception(message: str) -> None:
    raise TemplateError(message)


def compile_chat_template(template: str):
    """The environment transformers renders chat templates in: sandboxed, blocks trimmed, with the
    ``raise_exception`` templates call to refuse a conversation."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.globals["raise_exception"] = raise_exception
    try:
        return environment.from_string(template)
    except TemplateError as exc:
        raise DataError(f"the tokenizer's chat template does not compile: {exc}") from exc


def special_token(config: dict, key: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value


class HFTokenizer:
    """A ``tokenizer.json`` (and the ``tokenizer_config.json`` beside it, when present)."""

    def __init__(self, path: str | Path) -> None:
        self.source = str(path)  # what load_tokenizer takes to load it again (prepare's workers)
        path = Path(path).expanduser()
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise DataError(
                f"{path}: no {TOKENIZER_FILE}; shardtrain reads fast tokenizers (save one with "
                "transformers' tokenizer.save_pretrained(dir) or tokenizers' Tokenizer.save(path))")
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises a bare Exception for a malformed file
            raise DataError(f"{file}: not a readable tokenizer ({str(exc).splitlines()[0]})") from exc
        self.name = "tokenizers:" + hashlib.sha256(file.read_bytes()).hexdigest()[:16]
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        config_file = file.parent / TOKENIZER_CONFIG_FILE
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.eos_token = special_token(config, "eos_token")
        self.bos_token = special_token(config, "bos_token")
        self.eos_id = self._tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        if self.eos_token and self.eos_id is None:
            raise DataError(f"{config_file}: eos_token {self.eos_token!r} is not in {file}'s vocabulary")
        self.stop_ids = frozenset({self.eos_id} - {None}) | generation_stops(file.parent, self.vocab_size)
        template = file.parent / "chat_template.jinja"
        self.chat_template = (template.read_text() if template.is_file()
                              else config.get("chat_template"))
        if isinstance(self.chat_template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default")
        self._chat = compile_chat_template(self.chat_template) if self.chat_template else None

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """With the tokenizer's own special tokens (e.g. a leading BOS), as transformers encodes;
        ``special_tokens=False`` for text that already has them (a rendered chat template)."""
        return self._tokenizer.encode(text, add_special_tokens=special_tokens).ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """``messages`` ([{"role": ..., "content": ...}]) as the model's chat template writes them,
        rendered as transformers renders it (a sandboxed Jinja environment), with the prompt of the
        assistant's turn at the end when ``add_generation_prompt``."""
        if not self.chat_template:
            raise DataError(f"the tokenizer {self.name} has no chat template (none in "
                            f"{TOKENIZER_CONFIG_FILE} or chat_template.jinja)")
        try:
            return self._chat.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as exc:
            raise DataError(f"the chat template of {self.name} failed: {exc}") from exc

    def encode_documents(self, documents: list[bytes]) -> list[list[int]]:
        texts = [doc.decode("utf-8", errors="replace") for doc in documents]
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def stream(self) -> HFStream:
        return HFStream(self._tokenizer)


def token_dtype(vocab_size: int) -> type:
    """The smallest unsigned type that holds every id: uint16 up to 65,536 tokens, else uint32."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def load_tokenizer(source: str) -> Tokenizer:
    """``bytes``, or a tokenizer.json file or the directory holding one (a model directory)."""
    return ByteTokenizer() if source == "bytes" else HFTokenizer(source)


def tokenizer_source(cfg: ModelConfig) -> str:
    """What ``model.tokenizer`` resolves to: "bytes" or a path."""
    if cfg.tokenizer != "auto":
        return cfg.tokenizer
    if cfg.name == "hf":
        return str(cfg.path)
    return "bytes"


def tokenizer_for(cfg: ModelConfig) -> Tokenizer:
    """The tokenizer of a model config, checked against the model's vocabulary where it is known."""
    source = tokenizer_source(cfg)
    tokenizer = load_tokenizer(source)
    if cfg.name == "llama" and tokenizer.vocab_size > cfg.vocab_size:
        raise DataError(f"the tokenizer ({source}) has {tokenizer.vocab_size} tokens but "
                        f"model.vocab_size={cfg.vocab_size}; raise model.vocab_size to at least "
                        f"{tokenizer.vocab_size}")
    return tokenizer
