"""Failures injected into tensor-parallel ranks, for tests/test_tensor_parallel.py and notebook 12 (not collected).

Python imports a module named `sitecustomize` when any process starts, from the first folder of its path that holds
one. With this folder first on PYTHONPATH, that reaches the engine's spawned workers and torchrun's ranks too. With
`MINIVLLM_TP_FAIL=R:STAGE` in the environment ("1:load", "1:step"), rank R then raises
`RuntimeError("injected failure of rank R during STAGE (MINIVLLM_TP_FAIL)")`:

- `load`: as it starts to load its shard (the `ModelRunner` that `minivllm.engine.worker` makes, in its group);
- `step`: as its first step arrives (rank 0: `TPExecutor.launch`; another rank: `recv_step`, before any device work).

The wrappers go around those names of `minivllm.engine.worker` when a process imports that module; a process that
never imports it, or runs without the variable, is left as it is.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import os
import sys

FAIL_ENV = "MINIVLLM_TP_FAIL"
WORKER = "minivllm.engine.worker"


def inject_failure(rank: int, stage: str) -> None:
    raise RuntimeError(f"injected failure of rank {rank} during {stage} ({FAIL_ENV})")


def wrap_load(worker, rank: int) -> None:
    "Rank `rank` fails as it starts to make its `ModelRunner` (a group of several ranks only)."
    runner_class = worker.ModelRunner
    runner_init = runner_class.__init__

    @functools.wraps(runner_init)
    def failing_init(self, *args, **kwargs):
        tp = inspect.signature(runner_init).bind(self, *args, **kwargs).arguments.get("tp")
        if tp is not None and tp.size > 1 and tp.rank == rank:
            inject_failure(rank, "load")
        runner_init(self, *args, **kwargs)

    runner_class.__init__ = failing_init


def wrap_step(worker, rank: int) -> None:
    "Rank `rank` fails as its first step arrives: rank 0 when it launches it, another rank when it receives it."
    launch, receive = worker.TPExecutor.launch, worker.recv_step

    @functools.wraps(launch)
    def failing_launch(self, step):
        if self.tp.rank == rank:
            inject_failure(rank, "step")
        return launch(self, step)

    @functools.wraps(receive)
    def failing_recv_step(tp):
        step = receive(tp)
        if step is not None and tp.rank == rank:
            inject_failure(rank, "step")
        return step

    worker.TPExecutor.launch, worker.recv_step = failing_launch, failing_recv_step


class WrapWorkerOnImport(importlib.abc.MetaPathFinder):
    "Finds nothing itself: when the worker module is imported, it has that module run, then wraps its functions."

    def __init__(self, rank: int, stage: str):
        self.rank, self.wrap = rank, {"load": wrap_load, "step": wrap_step}[stage]

    def find_spec(self, name, path, target=None):
        if name != WORKER:
            return None
        sys.meta_path.remove(self)  # (one module, once: the search below must not come back here)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def run_and_wrap(module) -> None:
            run(module)
            self.wrap(module, self.rank)

        spec.loader.exec_module = run_and_wrap
        return spec


def install(spec: str) -> None:
    rank, stage = spec.split(":", 1)
    sys.meta_path.insert(0, WrapWorkerOnImport(int(rank), stage))


if os.environ.get(FAIL_ENV):
    install(os.environ[FAIL_ENV])
