"""The documents of raw inputs, in one deterministic order: what ``shardtrain prepare`` tokenizes.

An input is a file, a directory (its files matching a glob, recursively, sorted by relative path;
hidden files and directories below it skipped unless the glob names them) or a glob pattern (hidden
names skipped the same way). By suffix a file is: JSON Lines (``.jsonl``, ``.ndjson``, either
gzipped; one document per line, its
text in a chosen field), Parquet (``.parquet``; one document per row of a chosen column), or text
(the whole file is one document; a compressed or archived one is refused). A ``.json`` or
``.json.gz`` file is JSON Lines when its first non-blank line is a JSON object that holds the text
field or fine-tuning keys; any other ``.json`` is text (a package.json; one that looks like JSON
Lines of other fields is said, once for all such files), and any other ``.json.gz`` is refused. A
directory written by ``datasets``' ``save_to_disk`` (it holds ``state.json``), given or found
inside a given directory, is read as its Arrow files, one document per row; the ``datasets`` library
is not needed for that. A ``DatasetDict``'s directory (it holds ``dataset_dict.json`` and one such
directory per split) is refused: a split must be chosen. Each
document has a key (the file's relative path, plus the line or row number for records) that decides
its train/validation split by hash, so the split does not depend on how many processes prepare it or
on other inputs. A JSON Lines record without the text field but with
``prompt`` and ``completion``, or ``messages`` (a chat), is a fine-tuning document.

Bad input is one ``DataError`` naming the file (and line) and the fix.
"""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import cached_property
from pathlib import Path, PurePath, PurePosixPath
from typing import IO

import pyarrow as pa
import pyarrow.parquet as pq

from shardtrain.errors import DataError

log = logging.getLogger("shardtrain")
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# The lock file `shardtrain prepare` keeps beside its output: never an input, even where an output
# was made inside an input directory and later removed.
PREPARE_LOCK_SUFFIX = ".shardtrain-lock"
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz")  # matched ignoring case
# Records or not by what their first line holds (``json_shape``): many Hugging Face datasets ship
# JSON Lines as train.json, and code corpora hold package.json-like files, which are text.
JSON_SUFFIXES = (".json", ".json.gz")  # matched ignoring case
# What a directory input yields that is read as records, beside which a text file is worth a word.
RECORD_KINDS = ("jsonl", "json array", "json objects", "parquet", "arrow")
# Rows of a Parquet or Arrow file turned into Python bytes at a time: a whole row group's (or
# Arrow file's) column at once held a file written as one row group whole, several times over.
TABLE_ROWS = 1024
# The suffixes (case as written) that made a file records before the ones above did.
FIRST_SUFFIXES = {"jsonl": (".jsonl", ".jsonl.gz"), "parquet": (".parquet",)}
# Compressed or archived files other than JSON lines: read as text they were tokenized as their
# compressed bytes, without a word.
PACKED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip", ".7z", ".tar", ".tgz")
DATASETS_STATE = "state.json"  # what save_to_disk writes beside its Arrow files
DATASET_DICT = "dataset_dict.json"  # what a DatasetDict's save_to_disk writes beside its splits
PREPARED_FORMAT = "shardtrain-prepared"  # the "format" of what ``shardtrain prepare`` writes
PREPARED_MANIFEST = "manifest.json"
# A prepared split's shard files (prepare.py writes them; a directory holding one is a prepared dataset).
PREPARED_SHARD = "{kind}-{index:05d}.npy"  # kind: tokens, docs, mask
PREPARED_TOKEN_SHARDS = "tokens-*.npy"  # the token shards among them
# JSON can escape half of a UTF-16 pair alone ("\ud800"); no UTF-8 text holds one.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
JSON_SPACE = re.compile(r"[ \t\n\r]*")  # what JSON allows between values
# What a read with errors="surrogateescape" puts in place of each byte that is not UTF-8.
NOT_UTF8 = re.compile("[\udc80-\udcff]")


@dataclass(frozen=True)
class Source:
    """One input file (or a datasets directory) and what names it in keys and the manifest."""

    path: Path
    name: str  # relative to the input it came from, '/'-separated
    text_field: str = "text"  # the records' text field: what makes a .json file's lines records

    @cached_property  # sniffed from the first lines, once: kind and the warning both ask
    def json_shape(self) -> str | None:
        """A ``.json`` (or ``.json.gz``) file's ``json_shape``; None for any other file."""
        if self.path.is_dir() or not self.path.name.lower().endswith(JSON_SUFFIXES):
            return None
        return json_shape(self.path, self.text_field)

    @cached_property
    def kind(self) -> str:
        if self.path.is_dir():
            return "arrow"
        name = self.path.name.lower()
        if name.endswith(JSONL_SUFFIXES):
            return "jsonl"
        if name.endswith(".parquet"):
            return "parquet"
        if self.json_shape == "records":
            return "jsonl"
        if self.json_shape == "array":
            return "json array"
        if self.json_shape == "objects":
            return "json objects"
        return "text"

    def fingerprint(self) -> dict:
        """What makes a prepared dataset stale: any file's size or modification time, and how the
        file is read where that is not what its suffix said before .ndjson and suffixes in any case
        were records (those prepared as text are prepared again; every other fingerprint stays)."""
        kind = self.kind
        files = arrow_files(self.path) if kind == "arrow" else [self.path]
        stats = [f.stat() for f in files]
        entry = {"name": self.name, "bytes": sum(s.st_size for s in stats),
                 "mtime_ns": max(s.st_mtime_ns for s in stats)}
        # A JSON array was text before it was records: its read_as makes those prepared again.
        if kind in ("json array", "json objects") or (kind not in ("arrow", "text")
                                    and not self.path.name.endswith(FIRST_SUFFIXES[kind])):
            entry["read_as"] = kind
        return entry


# How much of a .json file is read to tell records from text: a first record longer than this (one
# document of 16 MiB) is taken for text, and a minified JSON document is never parsed whole.
JSON_SNIFF_BYTES = 16 << 20


def json_shape(path: Path, field: str) -> str:
    """What a ``.json`` (or ``.json.gz``) file's first non-blank line says it is: "records" (a JSON
    object holding ``field``, or fine-tuning keys: ``prompt`` and ``completion``, or ``messages``),
    "array" (a JSON array whose first element is such a record: Alpaca's alpaca_data.json,
    ``to_json(lines=False)``; found by a trial, tokenized as its JSON text with its brackets),
    "other records" (a JSON object, or an array of them, without those keys, with more after it:
    records of other fields, read as text and said), or "text" (anything else: a package.json, a
    minified document, a file that cannot be read, which the text reader or the refusal of
    compressed text then names). At most ``JSON_SNIFF_BYTES`` of a line are read."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as lines:
            # (after a UTF-8 byte order mark, which Windows tools write: its array was one text)
            first = next_nonblank_line(lines, skip=codecs.BOM_UTF8)
            if first.lstrip().startswith(b"["):
                return array_shape(first + lines.read(JSON_SNIFF_BYTES), field)
            try:
                record = json.loads(first)
            except ValueError:  # UnicodeDecodeError included; an empty file; a line cut at the bound
                if first.lstrip().startswith(b"{"):  # an indented object's first line: "{"
                    return object_shape(first + lines.read(JSON_SNIFF_BYTES), field)
                return "text"
            if not isinstance(record, dict):
                return "text"
            if field in record or has_fine_tuning_keys(record):
                return "records"
            return "other records" if next_nonblank_line(lines) else "text"
    except (OSError, EOFError, zlib.error):
        return "text"


def array_shape(head: bytes, field: str) -> str:
    """``json_shape`` of a file that begins with ``[``, from its first ``JSON_SNIFF_BYTES``: the
    first element is decoded alone (the whole array is read only to prepare it)."""
    try:
        text = head.decode("utf-8-sig").lstrip()[1:].lstrip()
        first, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:  # UnicodeDecodeError included; an empty array; a first element past the bound
        return "text"
    if not isinstance(first, dict):
        return "text"
    return "array" if field in first or has_fine_tuning_keys(first) else "other records"


def object_shape(head: bytes, field: str) -> str:
    """``json_shape`` of a file whose first line starts an object it does not hold whole (written
    with an indent, as ``json.dump(record, f, indent=2)`` and ``jq .`` write it), from its first
    ``JSON_SNIFF_BYTES``: "objects" where that object is a record (found by review: such files were
    trained on as their JSON text, braces and keys included, without a word), else "text"."""
    try:
        first, _ = json.JSONDecoder().raw_decode(head.decode("utf-8-sig").lstrip())
    except ValueError:  # UnicodeDecodeError included; an object past the bound
        return "text"
    record = isinstance(first, dict) and (field in first or has_fine_tuning_keys(first))
    return "objects" if record else "text"


def next_nonblank_line(lines: IO[bytes], skip: bytes = b"") -> bytes:
    """The next line of ``lines`` that is not blank, read up to ``JSON_SNIFF_BYTES``, ``skip`` taken
    off the first line read (a byte order mark, before blank lines too); b"" at the end."""
    line = lines.readline(JSON_SNIFF_BYTES).removeprefix(skip)
    while line and not line.strip():
        line = lines.readline(JSON_SNIFF_BYTES)
    return line


def matches(relative: str, pattern: str) -> bool:
    """Whether ``relative`` (a '/'-separated path) ends in ``pattern``, as ``Path.rglob(pattern)``
    decides it: ``**`` stands for any number of directories, none included. ``PurePath.match``
    takes ``**`` for one name before Python 3.13 (``'**/*.txt'`` skipped the top level)."""
    return _matches_parts(PurePosixPath(relative).parts, ("**", *PurePosixPath(pattern).parts))


def _matches_parts(parts: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_matches_parts(parts[skip:], pattern[1:]) for skip in range(len(parts) + 1))
    return bool(parts) and fnmatchcase(parts[0], pattern[0]) and _matches_parts(parts[1:], pattern[1:])


def is_prepared_dataset(directory: Path) -> bool:
    """Whether ``directory`` is what ``shardtrain prepare`` wrote (token shards, not text). One whose
    manifest is damaged is a DataError: read as text, its token shards would be scored or trained on
    as bytes without a word."""
    manifest_file = directory / PREPARED_MANIFEST
    try:
        manifest = json.loads(manifest_file.read_bytes())
    except (FileNotFoundError, NotADirectoryError):
        return False
    except (OSError, ValueError) as exc:
        if not any(next((directory / split).glob(PREPARED_TOKEN_SHARDS), None) for split in ("train", "val")):
            return False  # some other manifest.json beside text files
        why = getattr(exc, "strerror", None) or type(exc).__name__
        raise DataError(f"{manifest_file} cannot be read ({why}): the prepared dataset is damaged; run "
                        "shardtrain prepare again") from exc
    return isinstance(manifest, dict) and manifest.get("format") == PREPARED_FORMAT


def dataset_dict_error(directory: Path) -> DataError:
    """A DatasetDict's directory: one split must be chosen (mixing train and test is never meant)."""
    try:
        splits = [str(s) for s in json.loads((directory / DATASET_DICT).read_bytes())["splits"]]
    except (OSError, ValueError, KeyError, TypeError):
        splits = sorted(p.name for p in directory.iterdir() if (p / DATASETS_STATE).is_file())
    return DataError(f"{directory} is a datasets DatasetDict (splits: {', '.join(splits) or 'none'}); "
                     f"give one split's directory, {directory}/<split>")


def resolved_keeping_file_name(path: Path) -> Path:
    """``path`` resolved, but an existing file keeps its own name (its directories resolved): what a
    file holds is read from its name, and a Hugging Face snapshot's ``train.jsonl`` or
    ``model.safetensors`` links to a blob named by its hash (found by review: resolved, a .jsonl was
    one text document and a .safetensors "nothing"). A directory link (``checkpoints/best``) is
    followed, as is anything that is no file (yet)."""
    if not path.is_file() or path.name in ("", ".", ".."):
        return path.resolve()
    return path.absolute().parent.resolve() / path.name


def list_files(root: Path, pattern: str, exclude: Iterable[Path] = ()) -> list[Path]:
    """The files under ``root`` whose path ends in ``pattern`` (as ``root.rglob(pattern)`` finds
    them), sorted, skipping ``EXCLUDED_DIRS`` and the ``exclude`` paths inside ``root``. Those are
    pruned, not walked: the default corpus's standard library holds the interpreter's
    site-packages, several times its size. A ``save_to_disk`` directory found on the way (its
    state.json beside Arrow files) is listed itself when its path matches, never its files; a
    prepared dataset found on the way (an earlier ``prepare --out`` inside the input) is pruned: its
    shards are token ids, and read as text they were tokenized into the next preparation.

    Hidden directories and files (a name starting with '.') below ``root`` are skipped: a Hugging
    Face download directory holds ``.gitattributes`` and ``.cache/huggingface/download/*.lock``,
    which were documents. A pattern whose last part starts with '.' takes the hidden files it
    matches, and one with a directory part starting with '.' goes into hidden directories."""
    real_root = root.resolve()
    inside = [e for e in (e.resolve() for e in exclude) if e != real_root and e.is_relative_to(real_root)]
    skipped = {e.relative_to(real_root).as_posix() for e in inside}
    hidden_dirs, hidden_files = hidden_wanted(pattern)
    files = []
    for directory, subdirs, names in os.walk(root):
        here = Path(directory).relative_to(root)
        saved = DATASETS_STATE in names and any(name.endswith(".arrow") for name in names)
        if here.parts and (DATASET_DICT in names or saved):
            if matches(here.as_posix(), pattern):
                if DATASET_DICT in names:
                    raise dataset_dict_error(Path(directory))
                files.append(Path(directory))
            subdirs.clear()
            continue
        if here.parts and PREPARED_MANIFEST in names and is_prepared_dataset(Path(directory)):
            subdirs.clear()
            continue
        subdirs[:] = [d for d in subdirs
                      if d not in EXCLUDED_DIRS and (here / d).as_posix() not in skipped
                      and (hidden_dirs or not d.startswith("."))]
        for name in names:
            if name.startswith(".") and not hidden_files:
                continue
            path = Path(directory, name)
            relative = (here / name).as_posix()
            if (relative not in skipped and not name.endswith(PREPARE_LOCK_SUFFIX)
                    and matches(relative, pattern) and path.is_file()):
                files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def hidden_wanted(pattern: str) -> tuple[bool, bool]:
    """Whether a pattern asks for hidden directories (a directory part starting with '.') and for
    hidden files (its last part starting with '.'); hidden names are skipped otherwise."""
    parts = PurePosixPath(pattern).parts
    return any(part.startswith(".") for part in parts[:-1]), bool(parts) and parts[-1].startswith(".")


def hidden_unasked(relative: PurePath, pattern: str) -> bool:
    """Whether ``relative`` (a match of ``pattern``, relative to where the pattern starts) is or is
    inside a hidden name the pattern does not ask for, as ``list_files`` skips them. pathlib's
    ``*`` and ``**`` match hidden names (a shell's do not): ``data/**/*.txt`` read ``.git``."""
    hidden_dirs, hidden_files = hidden_wanted(pattern)
    return ((not hidden_files and relative.name.startswith("."))
            or (not hidden_dirs and any(part.startswith(".") for part in relative.parts[:-1])))


def skipped_by_pattern(path: Path, base: Path, excluded: list[Path], datasets: dict[Path, bool]) -> bool:
    """Whether a file a pattern matched is one a directory input at ``base`` would not read either: a
    lock file, anything inside an excluded path below ``base`` (prepare's output: read back, each
    preparation grew by the previous one's shards and manifest and was never up to date), inside a
    prepared dataset or a ``save_to_disk`` directory below ``base`` (as ``list_files`` prunes them).
    ``excluded``: those inside ``base``, resolved; ``datasets``: what is known of directories so far
    (a pattern's matches share them)."""
    if path.name.endswith(PREPARE_LOCK_SUFFIX):
        return True
    real = path.resolve()
    if any(real.is_relative_to(e) for e in excluded):
        return True
    for directory in (base / d for d in path.relative_to(base).parents if d.parts):
        if directory not in datasets:
            datasets[directory] = is_prepared_dataset(directory) or is_saved_dataset(directory)
        if datasets[directory]:
            return True
    return False


def is_saved_dataset(directory: Path) -> bool:
    """Whether ``directory`` is what ``datasets``' ``save_to_disk`` wrote: its state.json beside
    Arrow files (a state.json alone is some other file)."""
    return (directory / DATASETS_STATE).is_file() and next(directory.glob("*.arrow"), None) is not None


def resolve_sources(inputs: list[str], file_glob: str, exclude: Iterable[Path] = (),
                    text_field: str = "text") -> list[Source]:
    """Every input as sources, in order: inputs as given, each directory's files sorted. An input
    that exists is a path, even when its name holds glob characters. ``exclude`` (what ``prepare``
    writes: its output, its staging directory) is never read from a directory or a pattern.
    ``text_field``: the records' text field, by which a ``.json`` file is told to be records."""
    exclude = list(exclude)  # read once per input
    excluded = {e.resolve() for e in exclude}
    sources: list[Source] = []
    for entry in inputs:
        path = Path(entry).expanduser()
        if not path.exists() and any(ch in entry for ch in "*?["):
            # Patterns in directory parts too (data.paths has no shell to expand them; ** recurses):
            # globbed from the last directory before the first pattern, each file named from there.
            fixed = []
            for part in path.parts[:-1]:
                # a directory that exists is read as named, even with *?[ in its name (as a file is)
                if any(ch in part for ch in "*?[") and not Path(*fixed, part).is_dir():
                    break
                fixed.append(part)
            base = Path(*fixed) if fixed else Path(".")
            pattern = str(path.relative_to(base)) if fixed else str(path)
            found = base.glob(pattern)
            real_base = base.resolve()
            # As list_files: what is excluded counts below the pattern's base only (a data.cache_dir
            # holding the inputs' directory excludes itself, not them).
            inside = [e for e in excluded if e != real_base and e.is_relative_to(real_base)]
            datasets: dict[Path, bool] = {}
            files = [p for p in found if p.is_file()]
            hidden = [p for p in files if hidden_unasked(p.relative_to(base), pattern)]
            matched = sorted(p for p in files
                             if p not in hidden and not skipped_by_pattern(p, base, inside, datasets))
            if not matched:
                raise DataError(f"input {entry!r} matches no file" + (
                    f" but hidden ones ({hidden[0]}), which are skipped unless the pattern's part "
                    "starts with '.'" if hidden else ""))
            found = [Source(p, p.relative_to(base).as_posix(), text_field) for p in matched]
            check_not_split_files(entry, found, pattern=True)
            sources += found
        elif not path.exists():
            raise DataError(f"input {entry!r} does not exist; fix the path")
        elif path.is_dir() and (path / DATASET_DICT).is_file():
            raise dataset_dict_error(path)
        elif path.is_dir() and is_prepared_dataset(path):
            raise DataError(f"input {entry!r} is already a prepared dataset (token ids, not text); "
                            "train on it with data.source=prepared data.paths=[...]")
        elif path.is_dir() and (path / DATASETS_STATE).is_file():
            sources.append(Source(path, path.name, text_field))
        elif path.is_dir():
            files = list_files(path, file_glob, exclude)
            if not files:
                raise DataError(no_matching_files(entry, path, file_glob, exclude))
            found = [Source(p, p.relative_to(path).as_posix(), text_field) for p in files]
            check_not_split_files(entry, found)
            warn_text_beside_records(entry, found)
            sources += found
        else:
            sources.append(Source(path, path.name, text_field))
    check_each_file_once(inputs, sources)
    for source in sources:
        check_not_packed(source)
    warn_json_lines_read_as_text(sources)
    return sources


def no_matching_files(entry: str, path: Path, file_glob: str, exclude: list[Path]) -> str:
    """Why directory input ``entry`` gave no file, and the fix: files the pattern leaves out (a
    directory of .jsonl under the default ``*.py``), or hidden files only (found by review: "no files
    matching '*'" beside a file that matched it)."""
    said = f"input directory {entry!r} has no files matching {file_glob!r}"
    others = list_files(path, "*", exclude)
    if others:
        more = f" and {len(others) - 1} more" if len(others) > 1 else ""
        return (f"{said}; it holds {others[0].relative_to(path).as_posix()}{more}: name the files to read "
                "with --glob (data.file_glob for training)")
    hidden = list_files(path, ".*", exclude)
    if hidden:
        return (f"{said} but hidden ones ({hidden[0].relative_to(path).as_posix()}), which are skipped "
                "unless the pattern (--glob, data.file_glob) starts with '.'")
    return f"{said}; it holds no files"


def warn_json_lines_read_as_text(sources: list[Source]) -> None:
    """``.json`` files that look like JSON Lines but whose first record has no text field: each is
    read as one text document (a code corpus's fixtures, or records of another field); said once
    for all of them, naming some."""
    found = [source for source in sources if source.json_shape == "other records"]  # .json.gz: refused
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        log.warning(f"data: {', '.join(s.name for s in found[:3])}{more}: JSON records (lines, or an array) "
                    f"whose first record has no {found[0].text_field!r} field, each file read as one text "
                    "document; to read them as records name their text field (--text-field, "
                    "data.text_field)")


# A dataset's split, as the Hugging Face Hub's layouts name its files and directories
# (data/train-00000-of-00001.parquet, test.jsonl, validation/part-0.parquet).
SPLIT_NAMES = {"train": "train", "training": "train", "test": "test", "testing": "test",
               "validation": "validation", "valid": "validation", "val": "validation", "dev": "validation",
               "eval": "validation"}


# How deep below its input a dataset's layout names its splits (data/train-00000-of-00001.parquet,
# plain_text/train/..., train.jsonl): a split word deeper down is some other file's name (a repository
# corpus's tests/fixtures/train.jsonl; found by the diff review).
SPLIT_DEPTH = 2


def split_of(name: str) -> tuple[str, str] | None:
    """The split a record file's path (relative to its input) names, within its first
    ``SPLIT_DEPTH`` parts: a directory of a split's name, or a file name starting with one
    (``train-00000-of-00001.parquet``, ``test.jsonl``); with the ``--glob`` that reads that split
    alone (``train*``, ``train/**``). None where it names none."""
    parts = PurePosixPath(name).parts
    for depth, part in enumerate(parts[:SPLIT_DEPTH]):
        last = depth == len(parts) - 1
        word = re.split(r"[-_.]", part, maxsplit=1)[0] if last else part
        if (split := SPLIT_NAMES.get(word.lower())) is not None:
            return split, f"{word}*" if last else f"{part}/**/*"
    return None


def check_not_split_files(entry: str, sources: list[Source], pattern: bool = False) -> None:
    """A directory or pattern (``pattern``) whose record files are a dataset's splits (the Hub's
    layout: train, test and validation files side by side) is refused, as a DatasetDict's directory
    is: read together, the test and validation rows were trained on (found by review)."""
    splits: dict[str, list[tuple[str, str]]] = {}
    for source in sources:
        if source.kind in RECORD_KINDS and (found := split_of(source.name)) is not None:
            splits.setdefault(found[0], []).append((source.name, found[1]))
    if len(splits) < 2 or "train" not in splits:
        return
    named = "; ".join(f"{split}: {names[0][0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                      for split, names in sorted(splits.items()))
    alone = ("a pattern that matches its files alone" if pattern else
             f"--glob / data.file_glob '{splits['train'][0][1]}', or its files")
    raise DataError(f"input {entry!r} holds a dataset's splits as files ({named}): read together, the "
                    f"held-out splits are trained on; give the training split alone ({alone}), and "
                    "prepare's --val-percent holds out validation from it")


def check_each_file_once(inputs: list[str], sources: list[Source]) -> None:
    """A file that two inputs name (``x.jsonl ./x.jsonl``, a directory and a file inside it) is
    refused: it was read twice, and as each names it differently (its key), a document of one copy
    could be in the validation split and the same document of the other trained on (found by
    review)."""
    seen: dict[Path, Source] = {}
    for source in sources:
        # The file's own name kept: a Hugging Face snapshot's files are links to blobs named by
        # content, and two files alike (empty __init__.py files) share one (found by the diff review)
        real = resolved_keeping_file_name(source.path)
        if (first := seen.setdefault(real, source)) is not source:
            as_named = f"as {first.name!r} and {source.name!r}, " if first.name != source.name else ""
            raise DataError(f"{real} is read twice ({as_named}inputs: {', '.join(inputs)}): name each file "
                            "once (its documents were read twice, and a document named two ways could be "
                            "held out for validation in one copy and trained on in the other)")


def warn_text_beside_records(entry: str, sources: list[Source]) -> None:
    """A directory of records that also holds text files (a dataset's README.md): each of those is a
    document too, which is seldom meant; said, naming some."""
    if not any(source.kind in RECORD_KINDS for source in sources):
        return
    texts = [source.name for source in sources if source.kind == "text"]
    if texts:
        more = f" and {len(texts) - 3} more" if len(texts) > 3 else ""
        log.warning(f"data: input directory {entry} holds records (JSON Lines, Parquet or Arrow) and text "
                    f"files, each read as one document: {', '.join(texts[:3])}{more}; leave them out with "
                    "--glob / data.file_glob (such as '*.jsonl') unless they are training text")


def check_not_packed(source: Source) -> None:
    """A compressed or archived file that is not JSON lines is refused: read as text, its
    compressed bytes were the training data."""
    if source.kind != "text" or not source.path.name.lower().endswith(PACKED_SUFFIXES):
        return
    if source.path.name.lower().endswith(".json.gz"):  # "decompress it" made it a text document
        raise DataError(f"{source.path}: compressed, and not JSON Lines records (its first line is no JSON "
                        f"object with a {source.text_field!r} field, 'prompt' and 'completion', or "
                        "'messages'); shardtrain reads a .json.gz as JSON Lines only: name the text field "
                        "with --text-field (data.text_field), or leave the file out of the inputs (--glob, "
                        "data.file_glob)")
    raise DataError(f"{source.path}: a compressed or archived file, which shardtrain does not read as "
                    "text (it reads .jsonl/.jsonl.gz, JSON Lines as .json/.json.gz, .parquet and "
                    "uncompressed text); decompress it, or leave it out of the inputs (--glob, "
                    "data.file_glob)")


def arrow_files(directory: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` directory, in the order its state.json lists them."""
    try:
        state = json.loads((directory / DATASETS_STATE).read_bytes())
        files = [directory / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{directory}: not a readable datasets directory ({exc}); write it with "
                        "Dataset.save_to_disk (a DatasetDict: give one split's directory)") from exc
    # A partial copy: its state.json lists a file it lacks (found by review: a bare FileNotFoundError)
    if missing := [path.name for path in files if not path.is_file()]:
        raise DataError(f"{directory}: {DATASETS_STATE} lists {', '.join(missing[:3])}"
                        f"{f' (+{len(missing) - 3} more)' if len(missing) > 3 else ''}, which the directory "
                        "lacks; copy the whole directory again (or save it again with Dataset.save_to_disk)")
    return files


def utf8(text: str) -> bytes:
    """``text`` in UTF-8, each lone surrogate (JSON can escape half of a UTF-16 pair alone) replaced
    by U+FFFD, the replacement character. Encoded once: this runs on the reading thread."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        return LONE_SURROGATE.sub("\ufffd", text).encode()


def valid_text(value: object) -> object:
    """``value`` with ``utf8``'s replacement in every string, nested ones included."""
    if isinstance(value, str):  # without encoding it: this runs on the reading thread
        return LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {key: valid_text(item) for key, item in value.items()}
    if isinstance(value, list):
        return [valid_text(item) for item in value]
    return value


def text_of(record: object, field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object with a {field!r} field")
    if field not in record:
        raise DataError(f"{where}: no {field!r} field (fields: {', '.join(map(str, record)) or 'none'}); "
                        "set data.text_field (or --text-field) to the field holding the text, or give "
                        "fine-tuning records 'prompt' and 'completion', or 'messages'")
    value = record[field]
    if value is None:  # missing text, as a Parquet or Arrow null is: an empty document, not a stop
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is {type(value).__name__}, not text")
    return value


def fine_tuning_record(record: dict, where: str) -> dict:
    """A prompt/completion pair or a chat, checked: the loss will count only the completion or the
    assistant's turns."""
    if "messages" in record:
        messages = record["messages"]
        well_formed = isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)
        if not well_formed:
            raise DataError(f"{where}: 'messages' must be a list of {{\"role\": ..., \"content\": ...}} "
                            "objects with text values")
        if not any(m["role"] == "assistant" for m in messages):
            roles = sorted({m["role"] for m in messages})
            sharegpt = " (ShareGPT's human and gpt are user and assistant)" if "gpt" in roles else ""
            raise DataError(f"{where}: a chat without an assistant message has nothing to learn (its "
                            f"roles: {', '.join(roles) or 'none'}; the chat template's are system, user "
                            f"and assistant{sharegpt})")
        return {"messages": valid_text(messages)}  # every key a chat template may render
    for field in ("prompt", "completion"):
        if not isinstance(record[field], str):
            raise DataError(f"{where}: field {field!r} is {type(record[field]).__name__}, not text")
    return {"prompt": valid_text(record["prompt"]), "completion": valid_text(record["completion"])}


Document = bytes | dict  # plain text (UTF-8), or a fine-tuning record (prompt/completion, messages)


def has_fine_tuning_keys(record: dict) -> bool:
    """A chat (``messages``) or a prompt/completion pair: a fine-tuning record's keys."""
    return "messages" in record or ("prompt" in record and "completion" in record)


def has_fine_tuning_values(record: dict) -> bool:
    """A chat or a prompt/completion pair that is there: not nulls (a table's rows of either kind,
    written as JSON Lines, give each the other kind's fields as nulls)."""
    return record.get("messages") is not None or (
        record.get("prompt") is not None and record.get("completion") is not None)


def is_text_and_fine_tuning(record: object, field: str) -> bool:
    return isinstance(record, dict) and record.get(field) is not None and has_fine_tuning_values(record)


class TextBesideFineTuning:
    """Says, once a file, that a record with both a text and fine-tuning fields is read as its text
    (the rule is the file's, not the record's): JSON Lines, a JSON array and a table's rows alike
    (found by review: said for JSON Lines only)."""

    def __init__(self, field: str) -> None:
        self.field = field
        self.said = False

    def check(self, record: object, where: str) -> None:
        if not self.said and is_text_and_fine_tuning(record, self.field):
            self.said = True
            log.warning(f"{where}: a record with both {self.field!r} and fine-tuning fields is read as its "
                        f"{self.field!r}, every token a target (said once a file); drop {self.field!r} to "
                        "train on the conversation's or completion's tokens only")


def document_of(record: object, field: str, where: str) -> Document:
    """A JSON record: its text field, else a fine-tuning record (``messages``, or ``prompt`` and
    ``completion``). A null text beside a fine-tuning record's values is a missing one (a table's
    rows of either kind as JSON Lines: the fine-tuning rows were empty documents, found by review);
    a row of nulls alone is an empty document."""
    if not isinstance(record, dict):
        return utf8(text_of(record, field, where))
    if (has_fine_tuning_keys(record) if field not in record
            else record[field] is None and has_fine_tuning_values(record)):
        return fine_tuning_record(record, where)
    return utf8(text_of(record, field, where))


def column_texts(table: pa.Table | pa.RecordBatch, field: str, where: str) -> list[bytes]:
    if field not in table.schema.names:
        raise DataError(f"{where}: no column {field!r} (columns: {', '.join(table.schema.names)}); "
                        "set data.text_field (or --text-field) to the column holding the text (fine-tuning "
                        "records: a messages column, or prompt and completion)")
    column = table.column(field)
    if not is_text_type(column.type):
        raise DataError(f"{where}: column {field!r} is {column.type}, not text")
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        column = column.cast(pa.large_string())  # dictionary-encoded or string_view text
    # The bytes, as a text file's: Arrow does not check that what other tools wrote as strings is
    # UTF-8 (its to_pylist then raised), and the tokenizer handles bytes that are not as it does a
    # text file's.
    return [b"" if raw is None else raw for raw in column.cast(pa.large_binary()).to_pylist()]


def is_text_type(kind: pa.DataType) -> bool:
    """Strings in any of Arrow's layouts: offsets (string, large_string), views (string_view,
    pyarrow 16 on) or dictionary-encoded (Parquet's choice for repetitive columns)."""
    if pa.types.is_dictionary(kind):
        return is_text_type(kind.value_type)
    is_view = getattr(pa.types, "is_string_view", lambda _: False)
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)


def read_jsonl(source: Source, field: str) -> Iterator[tuple[str, Document]]:
    opener = gzip.open if source.path.name.lower().endswith(".gz") else open
    try:
        # A byte that is not UTF-8 kept as a stand-in (surrogateescape) and named by its line: a
        # strict read named a position within its decoder's chunk, not the file's. A byte-order mark
        # at the start (what Windows tools write) is no JSON: dropped, as Python's utf-8-sig does.
        with opener(source.path, "rt", encoding="utf-8-sig", errors="surrogateescape") as lines:
            mixed = TextBesideFineTuning(field)
            for number, line in enumerate(lines, start=1):
                where = f"{source.path}:{number}"
                if bad := NOT_UTF8.search(line):
                    at = len(line[:bad.start()].encode("utf-8", "surrogateescape")) + 1
                    raise DataError(f"{where}: not UTF-8 (byte {ord(bad.group()) - 0xDC00:#04x} at byte {at} "
                                    "of the line); JSON Lines are UTF-8: re-encode the file (for Latin-1, "
                                    "iconv -f latin1 -t utf-8)")
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise DataError(f"{where}: not valid JSON ({exc})") from exc
                mixed.check(record, where)
                yield f"{source.name}:{number}", document_of(record, field, where)
    except (OSError, EOFError, zlib.error) as exc:  # a corrupt deflate stream: no OSError
        raise DataError(f"{source.path}: cannot be read ({exc})") from exc


def read_json_array(source: Source, field: str) -> Iterator[tuple[str, Document]]:
    """The records of a ``.json`` file holding one JSON array of them, read whole (JSON Lines are
    read a line at a time: convert a file of gigabytes), keyed by their position from 1."""
    opener = gzip.open if source.path.name.lower().endswith(".gz") else open
    shape = "JSON array of records" if source.kind == "json array" else "JSON object of records, or objects"
    try:
        with opener(source.path, "rt", encoding="utf-8-sig") as text:
            records = json.load(text) if source.kind == "json array" else json_objects(text.read())
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{source.path}: cannot be read ({exc})") from exc
    except ValueError as exc:  # UnicodeDecodeError included
        raise DataError(f"{source.path}: not a valid {shape} ({exc})") from exc
    if not isinstance(records, list):
        raise DataError(f"{source.path}: not a {shape}")
    mixed = TextBesideFineTuning(field)
    for number, record in enumerate(records, start=1):
        where = f"{source.path}: record {number}"
        mixed.check(record, where)
        yield f"{source.name}:{number}", document_of(record, field, where)


def json_objects(text: str) -> list:
    """The JSON values of ``text`` one after another (objects written with an indent, one or more:
    ``jq .``'s output of a stream), each parsed whole."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while (at := JSON_SPACE.match(text, at).end()) < len(text):
        value, at = decoder.raw_decode(text, at)
        values.append(value)
    return values


def read_table_rows(source: Source, tables: Iterator[pa.RecordBatch],
                    field: str) -> Iterator[tuple[str, Document]]:
    """Each row's text, keyed by its row number in the whole file (or directory), however the rows
    come in batches: keys decide the split, and stay what they were when whole row groups were read.
    A table with fine-tuning columns (``messages``, or ``prompt`` and ``completion``: most Hub
    fine-tuning sets are Parquet) gives fine-tuning records, as JSON Lines do: each row's, where the
    text column is absent or null in it (a table of both kinds: its fine-tuning rows were empty
    documents, found by review)."""
    row = 0
    mixed = TextBesideFineTuning(field)
    for table in tables:
        names = set(table.schema.names)
        if has_fine_tuning_keys(names):
            columns = [field] * (field in names) + fine_tuning_columns(names)
            for record in table_records(table.select(columns), source.path, row):
                where = f"{source.path}: row {row}"
                mixed.check(record, where)
                yield f"{source.name}:{row}", document_of(record, field, where)
                row += 1
            continue
        for text in column_texts(table, field, str(source.path)):
            yield f"{source.name}:{row}", text
            row += 1


def table_records(table: pa.Table | pa.RecordBatch, path: Path, first_row: int) -> list[dict]:
    """``table``'s rows as records; a string that is not UTF-8 (Arrow does not check what other tools
    wrote) named by its row in one line, where ``to_pylist`` raised a traceback (found by review)."""
    try:
        return table.to_pylist()
    except UnicodeDecodeError as exc:
        for offset in range(table.num_rows):  # the first row that fails, for the message
            try:
                table.slice(offset, 1).to_pylist()
            except UnicodeDecodeError:
                break
        raise DataError(f"{path}: row {first_row + offset}: not UTF-8 text ({exc.reason}); re-encode its "
                        "text as UTF-8") from exc


def fine_tuning_columns(names: set[str]) -> list[str]:
    """The columns a fine-tuning record is read from: ``messages``, else ``prompt`` and ``completion``."""
    return ["messages"] if "messages" in names else ["prompt", "completion"]


def parquet_tables(path: Path, field: str) -> Iterator[pa.RecordBatch]:
    """The rows of a Parquet file, ``TABLE_ROWS`` at a time, of column ``field`` and its fine-tuning
    columns, those it has (an image or audio column beside the text was read and decoded for
    nothing); all of them where it has neither, for the error that names them."""
    try:
        reader = pq.ParquetFile(path)
        names = set(reader.schema_arrow.names)
        columns = ([field] * (field in names) + fine_tuning_columns(names) if has_fine_tuning_keys(names)
                   else [field] if field in names else None)
        if columns is None:  # its columns named before any row is read, also where it has none
            yield reader.schema_arrow.empty_table()  # (zero rows said "no documents": found by review)
        yield from reader.iter_batches(batch_size=TABLE_ROWS, columns=columns)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from exc


def arrow_tables(directory: Path) -> Iterator[pa.RecordBatch]:
    """The rows of a ``save_to_disk`` directory's Arrow files, ``TABLE_ROWS`` at a time (slices of
    the memory-mapped record batches: nothing is copied until a slice's texts are)."""
    for file in arrow_files(directory):
        try:
            with pa.memory_map(str(file)) as stream:
                for batch in pa.ipc.open_stream(stream):
                    for start in range(0, batch.num_rows, TABLE_ROWS):
                        yield batch.slice(start, TABLE_ROWS)
        except (OSError, pa.ArrowException) as exc:
            raise DataError(f"{file}: not a readable Arrow file ({exc})") from exc


# A NUL byte among a text file's first bytes: a binary file (a checkpoint's shards in a directory
# given as text were scored as text), or UTF-16.
BINARY_SNIFF_BYTES = 8192


def read_text(source: Source) -> Iterator[tuple[str, bytes]]:
    try:
        data = source.path.read_bytes()
    except OSError as exc:
        raise DataError(f"{source.path}: cannot be read ({exc.strerror or exc})") from exc
    if (nul := data.find(b"\x00", 0, BINARY_SNIFF_BYTES)) >= 0:  # git's test for a binary file
        utf16 = data.startswith((b"\xff\xfe", b"\xfe\xff"))
        raise DataError(f"{source.path}: not text (a NUL byte at byte {nul + 1}"
                        + ("; UTF-16 text: re-encode it as UTF-8" if utf16 else
                           "; a binary file: leave it out with data.file_glob, or eval's --glob") + ")")
    yield source.name, data  # as stored: the byte tokenizer reads raw bytes, others decode UTF-8


def documents(source: Source, field: str) -> Iterator[tuple[str, Document]]:
    """(key, document) of every document of ``source``, in order."""
    if source.kind == "jsonl":
        return read_jsonl(source, field)
    if source.kind in ("json array", "json objects"):
        return read_json_array(source, field)
    if source.kind == "parquet":
        return read_table_rows(source, parquet_tables(source.path, field), field)
    if source.kind == "arrow":
        return read_table_rows(source, arrow_tables(source.path), field)
    return read_text(source)
