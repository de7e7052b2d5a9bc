"""The ``shardtrain`` commands of ``run_cli``, each a fork of this one interpreter that has imported
torch and shardtrain once, instead of a new interpreter importing them again (4 s on one core, the
larger part of a short test run's time).

Each command is a real process of its own, run as ``python -m shardtrain ARGS`` runs it (``runpy``),
exiting through the interpreter's own exit (its exit handlers, its status), with the request's
environment, working directory, module search path (``PYTHONPATH``), no stdin, and its stdout and
stderr in files. What is not as in a new interpreter: the modules imported here were imported with
this process's environment (the tests' own, the same for every command; no test sets a variable read
at import time), in this order; and every command has this process's string hash seed (a set of
strings iterates in the same order in each). A module that fails to import in a new interpreter is
still found by the tests that start one: every training process under torchrun, the launcher's own
tests, the default training, the examples and the import checks (test_layers, test_cli,
test_config).

Protocol, one command at a time: a JSON request per line on stdin ({"args", "env", "cwd", "stdout",
"stderr"}); the answer is two lines on stdout, the command's process id once it runs, then its exit
status (minus the signal that killed it).
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys

import torch  # noqa: F401 - what every command imports; the rest below stands on it
import torch.distributed.fsdp  # noqa: F401

import shardtrain.checkpoint.inspect  # noqa: F401
import shardtrain.cli.launch  # noqa: F401
import shardtrain.cli.main  # noqa: F401
import shardtrain.cli.preflight  # noqa: F401
import shardtrain.config.compose  # noqa: F401
import shardtrain.config.loader  # noqa: F401
import shardtrain.export.consolidate  # noqa: F401
import shardtrain.generation.inference  # noqa: F401
import shardtrain.train.loop  # noqa: F401

# The search path of `python -m` without this script's directory (sys.path[0] here); a command's
# own is its working directory, then its PYTHONPATH, then this.
BASE_PATH = sys.path[1:]


def become(request: dict) -> None:
    """Turn this forked process into ``python -m shardtrain ARGS`` as the request describes; the
    command's SystemExit ends the process as the interpreter ends it."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [os.path.abspath(p) for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *extra, *BASE_PATH]
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin, for its life
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    sys.argv = ["shardtrain", *request["args"]]
    runpy.run_module("shardtrain", run_name="__main__", alter_sys=True)
    sys.exit(0)  # a __main__ that returns (it exits through cli.main.run)


def serve() -> None:
    gc.freeze()  # what is imported stays shared with every fork, untouched by their collections
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            become(request)
        print(pid, flush=True)  # flushed: nothing buffered is left for the next fork to write again
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    serve()
