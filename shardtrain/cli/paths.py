"""Path checks that need no torch: what ``consolidate``, ``export-hf``, ``generate``, ``eval`` and
``inspect`` check before importing it (seconds), so a mistyped path is answered at once. What a
path holds (a whole checkpoint, a model) is checked by the command itself, after."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from shardtrain.errors import ConfigError, first_line, os_error_code


def check_exists(path: str, what: str = "") -> str:
    """A path a command reads, with a quoted ``~`` expanded (the path then read; found by review: it
    was refused as missing); ``what`` names it in the message ("checkpoint", "--file")."""
    expanded = os.path.expanduser(path)
    if not Path(expanded).exists():
        raise ConfigError(f"{what + ' ' if what else ''}{path!r} does not exist")
    return expanded


# What makes a directory a checkpoint: DCP's metadata file (checkpoint/layout.py's METADATA_FILE),
# named here without importing torch.
CHECKPOINT_METADATA = ".metadata"


def checkpoint_around(path: Path) -> Path | None:
    """The checkpoint ``path`` would lie inside (a directory above it holding DCP's metadata), or
    None: keep_last deletes a checkpoint whole, and a checkpoint is never written to."""
    return next((above for above in path.expanduser().resolve().parents
                 if (above / CHECKPOINT_METADATA).is_file()), None)


def check_not_in_checkpoint(path: Path, what: str) -> None:
    if (checkpoint := checkpoint_around(path)) is not None:
        raise ConfigError(f"{what} {str(path)!r} is inside the checkpoint {str(checkpoint)!r}, which is "
                          "never written to (and keep_last deletes it whole); choose a path outside it")


def check_writable(path: Path, what: str) -> None:
    """``path`` can be created or written: its nearest existing ancestor is a writable directory."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {str(path)!r} cannot be written ({str(existing)!r} is not a "
                          "writable directory); choose another path")


def check_output(out: Path, source: Path, what: str, file_allowed: bool = True) -> None:
    """An output path of ``consolidate`` (``file_allowed``: a .safetensors file or a directory) or
    ``export-hf`` (a directory): writable, new where it is a file, and never inside the source."""
    out, source = out.expanduser().resolve(), source.expanduser().resolve()
    inside = source.is_dir() and source in out.parents
    beside = source.is_file() and out == source.parent  # model.safetensors there is the source
    if out == source or inside or beside:
        raise ConfigError(f"{what} {str(out)!r} is inside the checkpoint it reads; write elsewhere "
                          "(a checkpoint is never modified)")
    check_not_in_checkpoint(out, what)  # another one's (found by review: written into step-3)
    single_file = file_allowed and out.suffix == ".safetensors"
    if single_file and out.is_dir():
        raise ConfigError(f"{what} {str(out)!r} is a directory; name a .safetensors file or drop the suffix")
    if single_file and out.exists():
        raise ConfigError(f"{what} {str(out)!r} already exists; delete it or choose another name")
    if not single_file and out.exists() and not out.is_dir():
        raise ConfigError(f"{what} {str(out)!r} is a file; pass a directory"
                          + (" (or a new .safetensors file name)" if file_allowed else ""))
    check_writable(out, what)


def os_failure(exc: BaseException) -> str | None:
    """One line for a failure of the filesystem (an ``OSError``, or a Rust library's error that
    carries one: safetensors' "... No space left on device (os error 28)") naming the cause and what
    to do; None for any other exception."""
    code = os_error_code(exc)
    if not isinstance(exc, OSError) and code is None:
        return None
    text = first_line(exc)
    if code is None and re.search(r"\d+ requested and \d+ written", text):  # numpy's short write
        return f"{type(exc).__name__}: {text}; a write came up short: check free space on the filesystem"
    if code is None:
        return f"{type(exc).__name__}: {text}; check the path and its filesystem"
    if not isinstance(exc, OSError):
        text = f"[Errno {code}] {os.strerror(code)} ({type(exc).__name__})"
    fixes = {errno.ENOSPC: "free space on that filesystem (or choose a path on another)",
             errno.EDQUOT: "free space within your quota (or choose a path on another filesystem)",
             errno.EROFS: "choose a path on a writable filesystem (the run directory, the data cache, the "
                          "output)",
             errno.EACCES: permission_fix(exc),
             errno.EPERM: permission_fix(exc),
             errno.EFBIG: "raise the file size limit (ulimit -f)"}
    return f"{text}; {fixes.get(code, 'check the path and its filesystem')}"


def permission_fix(exc: BaseException) -> str:
    """What to do about a refused permission: a file this user cannot read (a checkpoint's shard, a
    metrics file) is made readable; anything else is a place to write."""
    path = getattr(exc, "filename", None)
    if path and os.path.exists(path) and not os.access(path, os.R_OK):
        return "make it readable by this user (its owner or mode), or point at a copy you can read"
    return "make the path writable, or choose another (the run directory, the data cache, the output)"
