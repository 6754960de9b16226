from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import traceback
from collections import deque
from datetime import timedelta
from multiprocessing.connection import Connection

import numpy as np
import torch
import torch.distributed as dist

from ..config import Config
from ..distributed.launch import join_group, leave_group, torchrun_store
from ..distributed.parallel_state import TPGroup
from ..distributed.step_broadcast import recv_step, send_step, send_stop
from .executor import Executor
from .model_runner import ModelRunner, StepHandle
from .step_inputs import StepInputs

FAIL_ENV = "MINIVLLM_TP_FAIL"   # a test hook: "1:load" makes rank 1 raise while it loads, "1:step" at its first step


def failure_hook(rank: int) -> str | None:
    "The stage at which this rank should fail (read once, when the rank starts), or None."
    spec = os.environ.get(FAIL_ENV, "")
    return spec.split(":", 1)[1] if spec.startswith(f"{rank}:") else None


def inject_failure(rank: int, stage: str, hook: str | None) -> None:
    if hook == stage:
        raise RuntimeError(f"injected failure of rank {rank} during {stage} ({FAIL_ENV})")


def cpu_threads_per_rank(world_size: int) -> int:
    "On a CPU the ranks share the cores: each gets its part (threads that outnumber the cores spin and stall)."
    return max(1, torch.get_num_threads() // world_size)

# %%
class TPExecutor(Executor):
    "Rank 0 of a tensor-parallel group: each step goes to the other ranks, then runs here (`failure`: torchrun's)."

    def __init__(self, config: Config, runner: ModelRunner, tp: TPGroup, failure=None):
        super().__init__(config, runner)
        self.tp, self.failure = tp, failure

    def launch(self, step: StepInputs) -> tuple[StepHandle, torch.cuda.Event | None]:
        self._check()
        try:
            send_step(step.header(), step.pack(), self.tp)
            handle = self.runner.execute(step)
        except RuntimeError:   # a collective failed (on a CPU, the step runs here): the failed rank says why
            self._check(wait=15.0)
            raise
        watched = self.failure is not None and self.runner.device.type == "cuda"   # see `collect`
        return handle, torch.cuda.current_stream().record_event() if watched else None

    def collect(self, launched: tuple[StepHandle, torch.cuda.Event | None]):
        handle, event = launched
        while event is not None and not event.query():   # a wait that sees a failed rank (and Ctrl-C)
            self._check()
            time.sleep(1e-4)
        try:
            return self.runner.collect(handle)
        except RuntimeError:
            self._check(wait=15.0)
            raise

    def _check(self, wait: float = 0.0) -> None:
        report = self.failure(wait) if self.failure is not None else None
        if report is not None:
            raise RuntimeError(report) from None

    def close(self) -> None:
        if self.failure is not None:
            self.failure.stop()
        send_stop(self.tp)
        super().close()
        leave_group(self.tp)

# %%
def follow(runner: ModelRunner, tp: TPGroup, hook: str | None = None) -> None:
    "Ranks >= 1: run each step rank 0 sends, the same way rank 0 does, until it says stop."
    while (message := recv_step(tp)) is not None:
        inject_failure(tp.rank, "step", hook)
        runner.execute(StepInputs.unpack(*message))


def serve_driver(executor: TPExecutor, conn: Connection, hook: str | None = None) -> None:
    "Rank 0 of spawned workers: serve the driver in order; answers carry their request's number (Ctrl-C may skip one)."
    conn.send(("ready", executor.num_blocks))
    handles: deque = deque()
    while True:
        kind, number, *args = conn.recv()
        if kind == "launch":
            header, added, freed = args
            for seq_id, params in added:
                executor.add_request(seq_id, params)
            for seq_id in freed:
                executor.free_request(seq_id)
            payload = np.frombuffer(bytearray(conn.recv_bytes()), dtype=np.uint8)
            inject_failure(0, "step", hook)
            handles.append(executor.launch(StepInputs.unpack(header, payload)))
        elif kind == "collect":
            conn.send((number, executor.collect(handles.popleft())))
        elif kind == "sync":
            handles.clear()
            executor.synchronize()
            conn.send((number, None))
        elif kind == "stop":
            executor.close()
            return

# %%
def exit_with_parent(status: Connection) -> None:
    "A thread that ends this process when the driving process is gone (its end of the pipe closed, or a new parent)."
    parent = os.getppid()

    def watch():
        while not status.poll(1.0) and os.getppid() == parent:
            pass
        os._exit(1)
    threading.Thread(target=watch, name="minivllm-parent-watch", daemon=True).start()


def run_worker(config: Config, rank: int, store_port: int, status: Connection, rpc: Connection | None) -> None:
    "A spawned rank: join, load its shard, serve the driver (rank 0) or follow rank 0; errors go on the `status` pipe."
    exit_with_parent(status)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        status.send(("hello", rank))
        hook, size = failure_hook(rank), config.tensor_parallel_size
        device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        torch.cuda.set_device(device) if device.type == "cuda" else torch.set_num_threads(cpu_threads_per_rank(size))
        tp = join_group(rank, size, device, dist.TCPStore("127.0.0.1", store_port, size, is_master=False))
        inject_failure(rank, "load", hook)
        runner = ModelRunner(config, rank, tp)
        if rank == 0:
            serve_driver(TPExecutor(config, runner, tp), rpc, hook)
        else:
            follow(runner, tp, hook)
            runner.close()
            leave_group(tp)
    except BaseException as e:
        try:
            status.send(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        finally:
            os._exit(1)
    os._exit(0)   # everything is released: skip the interpreter's slow teardown

# %%
class FailureWatch:
    """Under torchrun, a thread that finds a failed rank's report in torchrun's store and acknowledges it. Rank 0 waits
    for the device by polling (never blocked in a collective), so it sees the report and raises; torchrun ends the
    ranks once the failed one exits (aborting NCCL here could block the thread that has to raise the error)."""

    def __init__(self, store: dist.Store):
        self.store, self.report, self.stopped = store, None, False
        self.thread = threading.Thread(target=self._watch, name="minivllm-tp-failures", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stopped:
            if self.store.check(["failure"]):
                self.report = self.store.get("failure").decode()
                self.store.set("failure_seen", "1")
                return
            time.sleep(0.2)

    def __call__(self, wait: float = 0.0) -> str | None:
        "The failure report, if there is one (waiting up to `wait` seconds for it); the failed rank may then exit."
        deadline = time.monotonic() + wait
        while self.report is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.report is not None:
            self.store.set("failure_raised", "1")
        return self.report

    def stop(self) -> None:
        self.stopped = True
        self.thread.join(5.0)


def report_failure(store: dist.Store, tp: TPGroup, error: BaseException) -> None:
    "A failed torchrun rank: its error to rank 0, then leave the group (rank 0's collective fails), exit once raised."
    traceback.print_exc()
    store.set("failure", f"tensor-parallel worker rank {tp.rank} failed: {type(error).__name__}: {error}\n\n"
                         f"--- traceback of rank {tp.rank} ---\n{traceback.format_exc()}")
    with contextlib.suppress(Exception):   # rank 0 never read it: torchrun ends every rank anyway once this one exits
        store.wait(["failure_seen"], timedelta(seconds=10))
        if tp.device_group is not tp.control_group:
            tp.device_group.abort()
        dist.destroy_process_group()
        store.wait(["failure_raised"], timedelta(seconds=30))
        time.sleep(1.0)   # (rank 0 prints its error; torchrun ends it once this rank exits)

# %%
def torchrun_rank(config: Config, launched) -> TPExecutor:
    "This torchrun rank: rank 0 returns its executor; the others serve it inside the LLM constructor, then exit."
    if launched.world_size != config.tensor_parallel_size:
        raise ValueError(f"torchrun started {launched.world_size} processes, but tensor_parallel_size is "
                         f"{config.tensor_parallel_size}: they must be equal")
    device = torch.device("cuda", launched.local_rank) if config.device == "cuda" else torch.device("cpu")
    torch.cuda.set_device(device) if device.type == "cuda" else torch.set_num_threads(
        cpu_threads_per_rank(launched.world_size))
    tp, store, hook = join_group(launched.rank, launched.world_size, device), torchrun_store(), failure_hook(launched.rank)
    if launched.rank == 0:
        return TPExecutor(config, ModelRunner(config, launched.local_rank, tp), tp, FailureWatch(store))
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is rank 0's to handle
    try:
        inject_failure(launched.rank, "load", hook)
        runner = ModelRunner(config, launched.local_rank, tp)
        follow(runner, tp, hook)
        runner.close()
        leave_group(tp)
    except BaseException as e:
        report_failure(store, tp, e)
        os._exit(1)
    raise SystemExit(0)
