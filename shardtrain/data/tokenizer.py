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
import re
from collections.abc import Callable, Sequence
from functools import cached_property, partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import tokenizers
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream

from shardtrain.config.schema import ModelConfig
from shardtrain.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# End-of-text tokens of common vocabularies (GPT-2, Llama 3, Llama 2/Mistral, Gemma, Qwen's chat).
COMMON_END_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
# What ``export-hf`` copies from a Hugging Face model directory besides the weights and config.json.
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, "special_tokens_map.json",
                   GENERATION_CONFIG_FILE, "chat_template.jinja")


class TextStream(Protocol):
    def push(self, token: int) -> str: ...

    def flush(self) -> str: ...


class Tokenizer(Protocol):
    name: str  # identity: "bytes", or "tokenizers:<sha256 of tokenizer.json, 16 hex digits>"
    source: str  # "bytes" or the path it was loaded from
    vocab_size: int
    eos_id: int | None  # appended after every document; None: documents are concatenated as they are
    stop_ids: frozenset[int]  # where generation ends: the end of text, and a model's end of turn
    turn_end_ids: frozenset[int]  # the chat template's end of an assistant's turn (generate --chat)
    chat_template: str | None

    def encode(self, text: str, special_tokens: bool = True) -> list[int]: ...

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...

    def encode_documents(self, documents: list[bytes]) -> list[list[int]] | list[np.ndarray]: ...

    def decode(self, ids: list[int]) -> str: ...

    def stream(self, prompt_ids: Sequence[int] = ()) -> TextStream: ...


class ByteStream:
    """Bytes -> whole characters: an unfinished UTF-8 character is held back until it is complete,
    bytes that can never form one become U+FFFD."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(bytes([token]))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


# Text whose UTF-8 bytes a byte-level tokenizer encodes one id each: ASCII, two-, three-byte
# characters and control bytes.
BYTE_PROBE = "def é(x):\n\t日本 \x00~"


def reads_bytes(tokenizer: Tokenizer) -> bool:
    """Whether each id is one byte of the UTF-8 text: the byte tokenizer, or the ``tokenizer.json``
    an export of a byte-level model carries (eval's loss is then per byte, as training's was)."""
    if tokenizer.name == "bytes":
        return True
    return tokenizer.vocab_size == 256 and tokenizer.encode(BYTE_PROBE, special_tokens=False) == list(
        BYTE_PROBE.encode())


def byte_level_tokenizer() -> tokenizers.Tokenizer:
    """The byte tokenizer as a ``tokenizers`` one (each byte of the UTF-8 text its own id), for the
    ``tokenizer.json`` of an exported built-in model: transformers and shardtrain then read it alike.
    Byte-level BPE's printable stand-ins for the bytes, no merges, no regex split."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    stand_in = {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE({stand_in[b]: b for b in range(256)}, []))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return tokenizer


def generation_stops(directory: Path, vocab_size: int) -> frozenset[int]:
    """The ids a model's ``generation_config.json`` ends generation at (``eos_token_id``, one or a
    list), as transformers' ``generate`` does: a chat model's end of turn is often not the
    tokenizer's end of text (Gemma's ``<end_of_turn>``, Llama 3's ``<|eot_id|>``). Without that file,
    the model's ``config.json``'s (its text part's, for a multimodal one), as transformers derives
    its generation settings from it (found by review: generation ran past the end of turn)."""
    file = directory / GENERATION_CONFIG_FILE
    try:
        config = json.loads(file.read_bytes())
    except FileNotFoundError:
        config = model_config_stops(directory)
    except (OSError, ValueError) as exc:  # ignored, generation would run past the model's end of turn
        why = getattr(exc, "strerror", None) or type(exc).__name__
        raise DataError(f"{file} cannot be read ({why}); mend it, or remove it to stop at the "
                        "tokenizer's end of text only") from exc
    ids = config.get("eos_token_id") if isinstance(config, dict) else None
    ids = ids if isinstance(ids, list) else [ids]
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size)


def model_config_stops(directory: Path) -> dict:
    """``{"eos_token_id": ...}`` of the model's ``config.json`` in ``directory`` (or of its
    ``text_config``), or {} where it has none (or the file is not there or not read: the model's
    own loading names it)."""
    try:
        config = json.loads((directory / "config.json").read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    text = config.get("text_config")
    ids = config.get("eos_token_id", text.get("eos_token_id") if isinstance(text, dict) else None)
    return {"eos_token_id": ids}


class ByteTokenizer:
    """The built-in model's tokens: the 256 byte values of the UTF-8 text."""

    name = "bytes"
    source = "bytes"
    vocab_size = 256
    eos_id = None
    stop_ids: frozenset[int] = frozenset()
    turn_end_ids: frozenset[int] = frozenset()
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

    def stream(self, prompt_ids: Sequence[int] = ()) -> ByteStream:
        """The prompt is whole characters (it was text): nothing of it is pending."""
        return ByteStream()


class HFStream:
    """Token ids -> text as it becomes final (``tokenizers``' DecodeStream: byte-level BPE tokens that
    end inside a character print nothing until the character is whole), continuing ``prompt_ids``:
    Metaspace decoders (Llama 2, Mistral) drop the space of a sequence's first word, so a stream
    started at the first generated token printed "Helloworld" for "Hello" + " world" (found by
    review). The prompt is stepped through and its text discarded (DecodeStream's own prefill
    argument is newer than the tokenizers we accept)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=False)
        for token in prompt_ids:
            self._stream.step(tokenizer, token)
        self._prompt = list(prompt_ids)
        self._ids: list[int] = []
        self._printed: list[str] = []

    def push(self, token: int) -> str:
        self._ids.append(token)
        text = self._stream.step(self._tokenizer, token) or ""
        self._printed.append(text)
        return text

    def flush(self) -> str:
        """What the ids decode to beyond what was printed: a character the last tokens left
        unfinished, as U+FFFD (as the byte tokenizer's stream ends one)."""
        decode = partial(self._tokenizer.decode, skip_special_tokens=False)
        whole, prompt = decode(self._prompt + self._ids), decode(self._prompt)
        printed = "".join(self._printed)
        added = whole[len(prompt):] if whole.startswith(prompt) else decode(self._ids)
        return added[len(printed):] if added.startswith(printed) else ""


def raise_exception(message: str) -> None:
    raise TemplateError(message)


def template_json(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                  separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson`` filter: JSON as written, not Jinja's, which escapes ``<`` ``>`` ``&``
    and ``'`` for HTML (a tool's schema in a prompt read ``\u003c``; found by review)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def compile_chat_template(template: str, source: str):
    """The environment transformers renders chat templates in: sandboxed, blocks trimmed, with the
    ``raise_exception`` templates call to refuse a conversation and its ``tojson`` (``source``: the
    tokenizer's path, for the message). Not its ``strftime_now``: a template that finds it writes
    today's date, and a dataset prepared on two days (two nodes' caches) would differ; without it,
    Llama 3's templates write the date they default to."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.globals["raise_exception"] = raise_exception
    environment.filters["tojson"] = template_json
    try:
        return environment.from_string(template)
    except TemplateError as exc:
        raise DataError(f"the chat template of {source} does not compile ({exc}); repair it (its "
                        f"tokenizer_config.json's chat_template, or chat_template.jinja)") from exc


def special_token(config: dict, key: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value


# Documents longer than this (in characters) are encoded in pieces of about this size, a few at a
# time (in parallel).
PIECE_CHARS = 1 << 18
PIECES_AT_ONCE = 4
CUT_CONTEXT = 64  # characters either side of a cut that its pre-tokenization is judged on
Affixes = tuple[list[int], list[int]]

# An assistant message whose end in a rendered conversation shows the template's end of turn.
TURN_PROBE = "shardtrain turn probe"

# Texts whose line starts a tokenizer must encode as it encodes them within the text, for a long
# document to be encoded a piece at a time: code, prose, blank lines, indentation, digits, accents.
SPLIT_PROBES = ("def f(x):\n    return x + 1\n\n\nprint(f(41))\n",
                "Hello world.\nSecond line, with words\n\tTabbed: 12345\n  Été, naïve\nend",
                "a\nb\n\nc \n d\r\ne")


def line_pieces(text: str, size: int, cuttable: Callable[[str, int], bool] = lambda text, cut: True
                ) -> list[str]:
    """``text`` in pieces of at least ``size`` characters (the last may be shorter), each cut after
    a lone line end (``\n`` or Windows' ``\r\n``) between non-space characters, where
    ``cuttable(text, cut)`` agrees: there a regex pre-tokenizer's token ends and the next starts
    (GPT-2's splits the last character off a run of whitespace before a word, so a run of blank
    lines or an indentation is not cut)."""
    pieces, start = [], 0
    while len(text) - start > size:
        cut = text.find("\n", start + size - 1)
        while cut != -1 and not (lone_line_end(text, cut) and cuttable(text, cut + 1)):
            cut = text.find("\n", cut + 1)
        if cut == -1:
            break
        pieces.append(text[start:cut + 1])
        start = cut + 1
    pieces.append(text[start:])
    return pieces


def lone_line_end(text: str, newline: int) -> bool:
    """Whether the ``\n`` at ``newline`` ends a line (after a ``\r`` or not) whose last character is
    not a space, and a character that is not one follows."""
    last = newline - 2 if newline > 0 and text[newline - 1] == "\r" else newline - 1
    return (last >= 0 and not text[last].isspace() and newline + 1 < len(text)
            and not text[newline + 1].isspace())


def pre_token_starts_at(tokenizer: tokenizers.Tokenizer, text: str, cut: int) -> bool:
    """Whether the tokenizer's pre-tokenizer starts a token at ``cut`` of ``text`` (judged on the
    normalised text around it): its model never merges across that, so the text may be cut there."""
    left, right = text[max(0, cut - CUT_CONTEXT):cut], text[cut:cut + CUT_CONTEXT]
    window = left + right
    if tokenizer.normalizer is not None:
        window, left = tokenizer.normalizer.normalize_str(window), tokenizer.normalizer.normalize_str(left)
        if not window.startswith(left):
            return False
    return any(start == len(left) for _, (start, _) in tokenizer.pre_tokenizer.pre_tokenize_str(window))


def piecewise_affixes(tokenizer: tokenizers.Tokenizer) -> Affixes | None:
    """The special tokens the tokenizer puts before and after a text's own (a BOS, an EOS), if a
    long document may be encoded in pieces: it has a pre-tokenizer (its model merges within a
    pre-token only; each cut is then checked to start one), no added token that could span a cut
    or take the newline before it (``lstrip``, RoBERTa's ``<mask>``), and the probe texts encode
    cut at every line start as they do whole; None if not (a normaliser or pre-tokenizer that marks
    the text's start, as SentencePiece's prefix space does)."""
    if tokenizer.pre_tokenizer is None:
        return None
    if any(token.lstrip or "\n" in token.content for token in tokenizer.get_added_tokens_decoder().values()):
        return None
    affixes = set()
    for probe in SPLIT_PROBES:
        whole = tokenizer.encode(probe, add_special_tokens=False).ids
        cut = [tokenizer.encode(piece, add_special_tokens=False).ids for piece in line_pieces(probe, 1)]
        if sum(cut, []) != whole:
            return None
        special = tokenizer.encode(probe).ids
        starts = [at for at in range(len(special) - len(whole) + 1) if special[at:at + len(whole)] == whole]
        if not starts:
            return None
        affixes.add((tuple(special[:starts[0]]), tuple(special[starts[0] + len(whole):])))
    if len(affixes) != 1:
        return None
    prefix, suffix = affixes.pop()
    return list(prefix), list(suffix)


class HFTokenizer:
    """A ``tokenizer.json`` (and the ``tokenizer_config.json`` beside it, when present)."""

    def __init__(self, path: str | Path) -> None:
        self.source = str(path)  # what load_tokenizer takes to load it again (prepare's workers)
        path = Path(path).expanduser()
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not path.exists():
            raise DataError(f"tokenizer {str(path)!r} does not exist; name a tokenizer.json file or the "
                            "model directory holding one (or 'bytes')")
        if not file.is_file():
            raise DataError(
                f"{path}: no {TOKENIZER_FILE}; shardtrain reads fast tokenizers (save one with "
                "transformers' tokenizer.save_pretrained(dir) or tokenizers' Tokenizer.save(path))")
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises a bare Exception for a malformed file
            raise DataError(f"{file}: not a readable tokenizer ({str(exc).splitlines()[0]})") from exc
        # A tokenizer.json saved after a call with truncation or padding keeps them, and applies them
        # to every encode: documents were cut to its max_length and padded (transformers turns
        # both off for a call that does not ask for them, as this does for all).
        self.file_truncates = self._tokenizer.truncation is not None or self._tokenizer.padding is not None
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.name = "tokenizers:" + hashlib.sha256(file.read_bytes()).hexdigest()[:16]
        # The largest id + 1, not the count: ids may skip numbers (the stored dtype and the model's
        # vocabulary must hold the largest).
        self.vocab_size = max(self._tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        config_file = file.parent / TOKENIZER_CONFIG_FILE
        try:
            config = json.loads(config_file.read_bytes()) if config_file.is_file() else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"{config_file} is not readable JSON ({exc}); repair it, or remove it to use "
                            "the tokenizer without its settings") from exc
        if not isinstance(config, dict):
            raise DataError(f"{config_file} holds a {type(config).__name__}, not the tokenizer's settings; "
                            "repair it, or remove it to use the tokenizer without them")
        self.eos_token = special_token(config, "eos_token")
        self.bos_token = special_token(config, "bos_token")
        self.eos_id = self._tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_id = self._tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        if self.eos_token and self.eos_id is None:
            raise DataError(f"{config_file}: eos_token {self.eos_token!r} is not in {file}'s vocabulary")
        self.stop_ids = frozenset({self.eos_id} - {None}) | generation_stops(file.parent, self.vocab_size)
        self.config_file = config_file
        # What an end-of-text token of a common vocabulary it holds would be, where its settings name none.
        vocabulary = self._tokenizer.get_vocab(with_added_tokens=True) if self.eos_id is None else {}
        self.unnamed_end_tokens = [token for token in COMMON_END_TOKENS if token in vocabulary]
        template = file.parent / "chat_template.jinja"
        self.chat_template = (template.read_text(encoding="utf-8") if template.is_file()
                              else config.get("chat_template"))
        if isinstance(self.chat_template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default")

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """With the tokenizer's own special tokens (e.g. a leading BOS), as transformers encodes;
        ``special_tokens=False`` for text that already has them (a rendered chat template)."""
        return self._tokenizer.encode(text, add_special_tokens=special_tokens).ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """``messages`` ([{"role": ..., "content": ...}]) as the model's chat template writes them,
        rendered as transformers renders it (a sandboxed Jinja environment), with the prompt of the
        assistant's turn at the end when ``add_generation_prompt``."""
        if not self.chat_template:
            raise DataError(f"the tokenizer {self.source} has no chat template (none in "
                            f"{TOKENIZER_CONFIG_FILE} or chat_template.jinja)")
        try:
            # tools and documents as transformers passes them without any: a template that tests
            # `tools is not none` wrote an empty tool list into every prompt (found by review)
            return self.compiled_chat.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                             bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                             tools=None, documents=None)
        except TemplateError as exc:
            raise DataError(f"the chat template of {self.source} failed: {exc}") from exc

    @cached_property
    def compiled_chat(self):
        """The chat template, compiled when first rendered: text data renders none, and a template
        that does not compile refused every run of its tokenizer (found by a trial)."""
        return compile_chat_template(self.chat_template, self.source)

    @cached_property
    def turn_end_ids(self) -> frozenset[int]:
        """The special token the chat template closes an assistant's turn with (ChatML's
        ``<|im_end|>``, Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``), where it has one: a
        base model fine-tuned on conversations learns to end its turn there, not with the end of
        text its ``generation_config.json`` names, so ``generate --chat`` stops at it too."""
        if not self.chat_template:
            return frozenset()
        try:
            text = self.render_chat([{"role": "user", "content": "Hi"},
                                     {"role": "assistant", "content": TURN_PROBE}],
                                    add_generation_prompt=False)
        except DataError:  # a template that refuses the probe conversation: no end of turn known
            return frozenset()
        after = text.partition(TURN_PROBE)[2].lstrip()
        special = {token.content: i for i, token in self._tokenizer.get_added_tokens_decoder().items()
                   if token.special}
        return frozenset(i for content, i in special.items() if after.startswith(content))

    @property
    def reads_specials_as_text(self) -> bool:
        """Whether a document's text can spell one of the tokenizer's special tokens, which
        ``encode_documents`` reads as ordinary text."""
        return self._special_texts is not None

    @cached_property
    def _special_texts(self) -> re.Pattern[bytes] | None:
        """What a document spells of the tokenizer's special tokens (longest first); None without any."""
        specials = sorted((token.content for token in self._tokenizer.get_added_tokens_decoder().values()
                           if token.special and token.content), key=len, reverse=True)
        return re.compile(b"|".join(re.escape(text.encode()) for text in specials)) if specials else None

    def spells_special(self, document: bytes) -> bool:
        """Whether a document's text spells one of the tokenizer's special tokens."""
        return self._special_texts is not None and self._special_texts.search(document) is not None

    @cached_property
    def _ordinary(self) -> tokenizers.Tokenizer:
        """The tokenizer reading a special token's text as ordinary text (its BOS, EOS and other
        affixes still added as tokens): a corpus quoting ``<|endoftext|>`` (web text, model outputs,
        this tokenizer's own docs) put an end of text mid-document, where document masking and the
        model learnt a boundary that is not there (found by review). What nanoGPT's
        ``encode_ordinary`` and torchtitan's tiktoken encode do for pretraining text."""
        ordinary = tokenizers.Tokenizer.from_str(self._tokenizer.to_str())
        ordinary.encode_special_tokens = True
        return ordinary

    def encode_documents(self, documents: list[bytes]) -> list[list[int] | np.ndarray]:
        """Each document's ids, special tokens' text read as text (``_ordinary``)."""
        texts = [doc.decode("utf-8", errors="replace") for doc in documents]
        short = [i for i, text in enumerate(texts) if len(text) <= PIECE_CHARS]
        ids: list = [None] * len(texts)
        for i, encoding in zip(short, self._ordinary.encode_batch([texts[i] for i in short])):
            ids[i] = encoding.ids
        for i, text in enumerate(texts):
            if ids[i] is None:
                ids[i] = self.encode_long(text)
        return ids

    def encode_long(self, text: str) -> list[int] | np.ndarray:
        """A long document's ids, encoded a few ``PIECE_CHARS`` at a time where the tokenizer allows
        (the same ids as in one piece, in a fraction of the memory: an encoding takes some 500 bytes
        a token, and `shardtrain prepare` of 20 MB of source peaked at 3.07 GiB whole, 0.51 GiB in
        pieces, docs/data.md); else in one piece."""
        if self.piecewise is None:
            return self._ordinary.encode(text).ids
        prefix, suffix = self.piecewise
        pieces = line_pieces(text, PIECE_CHARS, partial(pre_token_starts_at, self._tokenizer))
        parts = [np.asarray(prefix, dtype=np.int64)]
        for first in range(0, len(pieces), PIECES_AT_ONCE):
            encodings = self._ordinary.encode_batch(pieces[first:first + PIECES_AT_ONCE],
                                                    add_special_tokens=False)
            parts.extend(np.asarray(encoding.ids, dtype=np.int64) for encoding in encodings)
        parts.append(np.asarray(suffix, dtype=np.int64))
        return np.concatenate(parts)

    @cached_property
    def piecewise(self) -> Affixes | None:
        return piecewise_affixes(self._tokenizer)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def stream(self, prompt_ids: Sequence[int] = ()) -> HFStream:
        return HFStream(self._tokenizer, prompt_ids)


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


def check_recorded_tokenizer(recorded: str | None, tokenizer: Tokenizer, trained: str) -> None:
    """``tokenizer`` is the one ``trained`` (a checkpoint) records its model's text was read with,
    where it records one (found by review: a tokenizer.json edited or replaced since training gave
    generate and eval other ids without a word)."""
    if recorded is not None and recorded != tokenizer.name:
        raise DataError(f"{trained} was trained with the tokenizer {recorded}, and {tokenizer.source} is now "
                        f"{tokenizer.name} (edited or replaced since?): the model would read its ids as "
                        "other text; put back the tokenizer the run was trained with")


def tokenizer_for(cfg: ModelConfig) -> Tokenizer:
    """The tokenizer of a model config, checked against the model's vocabulary where it is known."""
    source = tokenizer_source(cfg)
    tokenizer = load_tokenizer(source)
    if cfg.name == "llama" and tokenizer.vocab_size > cfg.vocab_size:
        raise DataError(f"the tokenizer ({source}) has {tokenizer.vocab_size} tokens but "
                        f"model.vocab_size={cfg.vocab_size}; raise model.vocab_size to at least "
                        f"{tokenizer.vocab_size}")
    return tokenizer
