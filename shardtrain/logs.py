"""Console logging: rank 0 reports at INFO, other ranks only warnings, each line tagged."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging() -> None:
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="[shardtrain] %(message)s" if rank == 0 else f"[shardtrain rank {rank}] %(message)s",
        stream=sys.stderr,
    )
