"""Two spawned processes that the tests of gloo groups share (not collected by pytest: leading underscore).

Starting a process that imports torch and minivllm costs seconds of CPU; three tests (test_layers.py,
test_qwen3.py, test_tensor_parallel.py) each needed two of them for a check of their own. The pool starts two once (the
session fixture `rank_pool` in conftest.py) and runs each check as a job on both: `pool.run(module, function, *args)`
calls `function(rank, *args)` in rank 0 and rank 1 at once and returns {rank: what it returned}. Each job makes its own
group and takes it down before it returns, as the checks always did. A job that raises, or does not finish within its
time limit, fails the test with the ranks' tracebacks; the pool is then ended (a rank may be stuck in a collective) and
the next job starts a new one.
"""

from __future__ import annotations

import importlib
import queue
import time
import traceback

exchange = None  # in a rank: a queue both ranks share (rank 0 passes rank 1 the port of the store it serves)


def serve(rank: int, jobs, results, shared) -> None:
    "A rank's loop: run each job, report (rank, ok, value or traceback); None ends it."
    global exchange
    import torch

    torch.set_num_threads(1)  # two ranks on the CPU: one thread each (the tiny shapes need no more)
    exchange = shared
    while (job := jobs.get()) is not None:
        module, name, args = job
        try:
            results.put((rank, True, getattr(importlib.import_module(module), name)(rank, *args)))
        except BaseException:  # (an assertion of the check, say: the test shows it)
            results.put((rank, False, traceback.format_exc()))


class RankPool:
    def __init__(self):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        # (every queue is kept here: one dropped while a child still unpickles it is gone before the child sees it)
        self.jobs, self.results, self.shared = [ctx.Queue(), ctx.Queue()], ctx.Queue(), ctx.Queue()
        self.procs = [
            ctx.Process(target=serve, args=(rank, self.jobs[rank], self.results, self.shared), daemon=True)
            for rank in range(2)
        ]
        for p in self.procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, module: str, name: str, *args, timeout: float = 150) -> dict:
        "`module.name(rank, *args)` on both ranks; {rank: its result}, or an AssertionError with the ranks' tracebacks."
        for q in self.jobs:
            q.put((module, name, args))
        done, errors, deadline = {}, {}, time.monotonic() + timeout
        while len(done) < 2 and not errors:  # (after an error the other rank may wait in a collective for ever)
            try:
                rank, ok, value = self.results.get(timeout=1.0)
                (done if ok else errors)[rank] = value
            except queue.Empty:
                if not self.alive:
                    errors["exit"] = f"a rank exited (exit codes {[p.exitcode for p in self.procs]})"
                elif time.monotonic() > deadline:
                    errors["timeout"] = f"no answer within {timeout:.0f} s (ranks answered: {sorted(done)})"
        if errors:
            self.close()
            raise AssertionError(
                f"{module}.{name} failed:\n" + "\n".join(f"--- rank {r} ---\n{v}" for r, v in errors.items())
            )
        return done

    def close(self) -> None:
        for q, p in zip(self.jobs, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join(10)
