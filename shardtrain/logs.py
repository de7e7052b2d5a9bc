"""Console logging: rank 0 reports at INFO, other ranks only warnings, every line tagged.

Every line of a multi-line message carries the tag, so output interleaved from several ranks stays
attributable, and the launcher can tell log lines from everything else on the workers' stderr.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

LOG_PREFIX = "[shardtrain"


class TaggedFormatter(logging.Formatter):
    def __init__(self, tag: str) -> None:
        super().__init__("%(message)s")
        self.tag = tag

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        package = record.name.partition(".")[0]
        if package not in ("shardtrain", "root", "__main__"):
            # A library's line (torchao's kernel loading, a task module's own logger) under the
            # tag would read as shardtrain's: it says whose it is.
            text = f"{package}: {text}"
        return "\n".join(f"{self.tag} {line}" for line in text.split("\n"))


# Lines libraries print at import in every process of every Hugging Face or LoRA run that say
# nothing a user can act on, by (logger name prefix, text): torch's notice to libraries (torchao,
# imported by transformers) that registering an Enum with pytree is deprecated; torchao's kernels
# for other uses than shardtrain's (MX formats, CUTLASS GEMMs, int8 Triton matmuls) that a CPU
# build cannot load: its float8 training runs on torch's scaled matmul, NF4 on plain torch ops.
NOT_FOR_USERS = (
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
    ("torchao", "_C_mxfp8"),
    ("torchao", "_C_cutlass"),
    ("torchao", "Detected no triton"),
)


def not_for_users(record: logging.LogRecord) -> bool:
    """False for a line of ``NOT_FOR_USERS``."""
    text = str(record.msg)
    return not any((record.name == name or record.name.startswith(name + ".")) and part in text
                   for name, part in NOT_FOR_USERS)


def console_handler(stream: TextIO, rank: int = 0) -> logging.Handler:
    """The handler of a command's lines to ``stream``: tagged with the rank, libraries' noise left out."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(TaggedFormatter(f"{LOG_PREFIX}]" if rank == 0 else f"{LOG_PREFIX} rank {rank}]"))
    # On the handler (a logger's filter does not see its children's records), and on torch's pytree
    # logger, whose records torch's own handler prints.
    handler.addFilter(not_for_users)
    return handler


def setup_logging() -> None:
    rank = int(os.environ.get("RANK", 0))
    handler = console_handler(sys.stderr, rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, handlers=[handler])
    logging.getLogger("torch.utils._pytree").addFilter(not_for_users)
