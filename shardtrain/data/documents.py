"""The documents of raw inputs, in one deterministic order: what ``shardtrain prepare`` tokenizes.

An input is a file, a directory (its files matching a glob, recursively, sorted by relative path) or a
glob pattern. By suffix a file is: JSON Lines (``.jsonl``, ``.jsonl.gz``; one document per line, its
text in a chosen field), Parquet (``.parquet``; one document per row of a chosen column), or text (the
whole file is one document). A directory written by ``datasets``' ``save_to_disk`` (it holds
``state.json``) is read as its Arrow files, one document per row; the ``datasets`` library is not
needed for that. Each document has a key (the file's relative path, plus the line or row number for
records) that decides its train/validation split by hash, so the split does not depend on how many
processes prepare it or on other inputs. A JSON Lines record without the text field but with
``prompt`` and ``completion``, or ``messages`` (a chat), is a fine-tuning document.

Bad input is one ``DataError`` naming the file (and line) and the fix.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from shardtrain.errors import DataError

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
DATASETS_STATE = "state.json"  # what save_to_disk writes beside its Arrow files


@dataclass(frozen=True)
class Source:
    """One input file (or a datasets directory) and what names it in keys and the manifest."""

    path: Path
    name: str  # relative to the input it came from, '/'-separated

    @property
    def kind(self) -> str:
        if self.path.is_dir():
            return "arrow"
        if self.path.name.endswith(JSONL_SUFFIXES):
            return "jsonl"
        if self.path.suffix == ".parquet":
            return "parquet"
        return "text"

    def fingerprint(self) -> dict:
        """What makes a prepared dataset stale: any file's size or modification time."""
        files = arrow_files(self.path) if self.kind == "arrow" else [self.path]
        stats = [f.stat() for f in files]
        return {"name": self.name, "bytes": sum(s.st_size for s in stats),
                "mtime_ns": max(s.st_mtime_ns for s in stats)}


def list_files(root: Path, pattern: str) -> list[Path]:
    """The files under ``root`` whose path ends in ``pattern`` (as ``root.rglob(pattern)`` finds
    them), sorted, skipping ``EXCLUDED_DIRS``. Those are pruned, not walked: the default corpus's
    standard library holds the interpreter's site-packages, several times its size."""
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]
        for name in names:
            path = Path(directory, name)
            if path.relative_to(root).match(pattern) and path.is_file():
                files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def resolve_sources(inputs: list[str], file_glob: str) -> list[Source]:
    """Every input as sources, in order: inputs as given, each directory's files sorted."""
    sources: list[Source] = []
    for entry in inputs:
        path = Path(entry).expanduser()
        if any(ch in entry for ch in "*?["):
            base = Path(os.path.dirname(entry) or ".").expanduser()
            matches = sorted(p for p in base.glob(os.path.basename(entry)) if p.is_file())
            if not matches:
                raise DataError(f"input {entry!r} matches no file")
            sources += [Source(p, p.name) for p in matches]
        elif not path.exists():
            raise DataError(f"input {entry!r} does not exist; fix the path")
        elif path.is_dir() and (path / DATASETS_STATE).is_file():
            sources.append(Source(path, path.name))
        elif path.is_dir():
            files = list_files(path, file_glob)
            if not files:
                raise DataError(f"input directory {entry!r} has no files matching {file_glob!r}")
            sources += [Source(p, p.relative_to(path).as_posix()) for p in files]
        else:
            sources.append(Source(path, path.name))
    return sources


def arrow_files(directory: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` directory, in the order its state.json lists them."""
    try:
        state = json.loads((directory / DATASETS_STATE).read_text())
        return [directory / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{directory}: not a readable datasets directory ({exc}); write it with "
                        "Dataset.save_to_disk (a DatasetDict: give one split's directory)") from exc


def text_of(record: object, field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object with a {field!r} field")
    if field not in record:
        raise DataError(f"{where}: no {field!r} field (fields: {', '.join(map(str, record)) or 'none'}); "
                        "set data.text_field (or --text-field) to the field holding the text, or give "
                        "fine-tuning records 'prompt' and 'completion', or 'messages'")
    value = record[field]
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
            raise DataError(f"{where}: a chat without an assistant message has nothing to learn")
        return {"messages": messages}
    for field in ("prompt", "completion"):
        if not isinstance(record[field], str):
            raise DataError(f"{where}: field {field!r} is {type(record[field]).__name__}, not text")
    return {"prompt": record["prompt"], "completion": record["completion"]}


Document = bytes | dict  # plain text (UTF-8), or a fine-tuning record (prompt/completion, messages)


def document_of(record: object, field: str, where: str) -> Document:
    """A JSON record: its text field, else a fine-tuning record (``messages``, or ``prompt`` and
    ``completion``)."""
    if isinstance(record, dict) and field not in record and (
            "messages" in record or ("prompt" in record and "completion" in record)):
        return fine_tuning_record(record, where)
    return text_of(record, field, where).encode()


def column_texts(table: pa.Table, field: str, where: str) -> list[str]:
    if field not in table.column_names:
        raise DataError(f"{where}: no column {field!r} (columns: {', '.join(table.column_names)}); "
                        "set data.text_field (or --text-field) to the column holding the text")
    column = table.column(field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"{where}: column {field!r} is {column.type}, not text")
    return [text if text is not None else "" for text in column.to_pylist()]


def read_jsonl(source: Source, field: str) -> Iterator[tuple[str, Document]]:
    opener = gzip.open if source.path.name.endswith(".gz") else open
    try:
        with opener(source.path, "rt", encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                where = f"{source.path}:{number}"
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise DataError(f"{where}: not valid JSON ({exc})") from exc
                yield f"{source.name}:{number}", document_of(record, field, where)
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise DataError(f"{source.path}: cannot be read ({exc})") from exc


def read_table_rows(source: Source, tables: Iterator[pa.Table], field: str) -> Iterator[tuple[str, bytes]]:
    row = 0
    for table in tables:
        for text in column_texts(table, field, str(source.path)):
            yield f"{source.name}:{row}", text.encode()
            row += 1


def parquet_tables(path: Path) -> Iterator[pa.Table]:
    try:
        reader = pq.ParquetFile(path)
        for group in range(reader.num_row_groups):
            yield reader.read_row_group(group)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from exc


def arrow_tables(directory: Path) -> Iterator[pa.Table]:
    for file in arrow_files(directory):
        try:
            with pa.memory_map(str(file)) as stream:
                yield pa.ipc.open_stream(stream).read_all()
        except (OSError, pa.ArrowException) as exc:
            raise DataError(f"{file}: not a readable Arrow file ({exc})") from exc


def read_text(source: Source) -> Iterator[tuple[str, bytes]]:
    try:
        data = source.path.read_bytes()
    except OSError as exc:
        raise DataError(f"{source.path}: cannot be read ({exc.strerror or exc})") from exc
    yield source.name, data  # as stored: the byte tokenizer reads raw bytes, others decode UTF-8


def documents(source: Source, field: str) -> Iterator[tuple[str, Document]]:
    """(key, document) of every document of ``source``, in order."""
    if source.kind == "jsonl":
        return read_jsonl(source, field)
    if source.kind == "parquet":
        return read_table_rows(source, parquet_tables(source.path), field)
    if source.kind == "arrow":
        return read_table_rows(source, arrow_tables(source.path), field)
    return read_text(source)
