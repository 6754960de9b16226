from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import weakref
from multiprocessing.connection import wait

from fastcore.basics import patch

from ..config import Config
from ..distributed.launch import master_store, set_comm_env, torchrun_env
from ..sampling_params import SamplingParams
from .step_inputs import StepInputs
from .worker import run_worker, torchrun_rank

SPAWN_HINT = ("worker processes are started with multiprocessing's 'spawn' method, which imports the main script "
              "again: in a script, create the LLM under `if __name__ == \"__main__\":`")
STEP_TIMEOUT = float(os.environ.get("MINIVLLM_STEP_TIMEOUT", 600))   # seconds: a rank that answers nothing is hung


def exit_reason(code: int | None) -> str:
    if code is None:   # reaped by someone else: the status is gone
        return "exited"
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


class Workers:
    "Spawned ranks and a watch thread: a rank's first error or death kills them all (this process joins no collective)."

    def __init__(self, config: Config, store_port: int):
        ctx, self.procs, self.status = mp.get_context("spawn"), {}, {}
        self.rpc, rpc_child = ctx.Pipe()
        try:
            for rank in range(config.tensor_parallel_size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(target=run_worker, name=f"minivllm-tp-rank{rank}", daemon=True,
                                   args=(config, rank, store_port, child_end, rpc_child if rank == 0 else None))
                proc.start()
                child_end.close()
                self.procs[rank], self.status[rank] = proc, parent_end
        except BaseException:
            self.kill()
            raise
        finally:
            rpc_child.close()
        self.hello: set[int] = set()
        self.failure: str | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._watch, name="minivllm-tp-watch", daemon=True)
        self.thread.start()

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()

# %%
@patch
def _watch(self: Workers) -> None:
    conns = {conn: rank for rank, conn in self.status.items()}
    sentinels = {proc.sentinel: rank for rank, proc in self.procs.items()}
    while sentinels:
        for ready in wait([*conns, *sentinels]):
            if ready in conns:
                self._read(conns, ready)
            elif ready in sentinels:
                rank = sentinels.pop(ready)
                conn = self.status[rank]
                while conn in conns and conn.poll():   # its last message (an error) comes first
                    self._read(conns, conn)
                conns.pop(conn, None)
                if not self.stopping:
                    self.procs[rank].join(5.0)   # its pipe closes a moment before the exit status is there
                    when = "unexpectedly" if rank in self.hello else f"before it started; {SPAWN_HINT}"
                    self._fail(f"tensor-parallel worker rank {rank} {exit_reason(self.procs[rank].exitcode)} {when}")

@patch
def _read(self: Workers, conns: dict, conn) -> None:
    try:
        kind, rank, *details = conn.recv()
    except (EOFError, OSError):
        conns.pop(conn)
        return
    if kind == "hello":
        self.hello.add(rank)
    else:
        summary, trace = details
        self._fail(f"tensor-parallel worker rank {rank} failed: {summary}\n\n--- traceback of rank {rank} ---\n{trace}")

# %%
@patch
def _fail(self: Workers, message: str) -> None:
    "Record the first failure, then end every rank: none may wait for the failed one."
    self.failure = message if self.failure is None else self.failure
    self.kill()

@patch
def stop(self: Workers, timeout: float = 30.0) -> None:
    "Wait for the ranks to exit (after rank 0's stop), kill those that do not, close the pipes."
    self.stopping = True
    self.thread.join(timeout)   # the watch thread ends when every rank has exited
    self.kill()
    for proc in self.procs.values():
        proc.join()
    self.thread.join(5.0)
    for conn in [self.rpc, *self.status.values()]:
        conn.close()

# %%
class MultiProcExecutor:
    "Tensor parallelism over worker processes, one per device: this process sends rank 0 the steps, it passes them on."

    def __init__(self, config: Config, start_timeout: float = 300.0):
        self.store = master_store(config.tensor_parallel_size)   # where the ranks meet (it lives as long as they do)
        self.workers = Workers(config, self.store.port)
        weakref.finalize(self, self.workers.stop, 0.0)   # an executor dropped without close() still ends its workers
        self.closed, self.down, self.number = False, None, 0
        self.added: list[tuple[int, SamplingParams]] = []
        self.freed: list[int] = []
        try:
            self.num_blocks = self._reply(None, start_timeout)   # rank 0 says "ready" once every rank has loaded
        except BaseException:
            self.workers.kill()
            self.workers.stop(10.0)
            raise

    def add_request(self, seq_id: int, params: SamplingParams) -> None:
        self.added.append((seq_id, params))   # (sent with the next step)

    def free_request(self, seq_id: int) -> None:
        self.freed.append(seq_id)

    def launch(self, step: StepInputs) -> int:
        number = self._send("launch", step.header(), self.added, self.freed, payload=step.pack())
        self.added, self.freed = [], []
        return number

    def collect(self, handle: int):
        "Rank 0's tokens of the oldest step not collected yet (`handle`: steps are collected in launch order)."
        return self._reply(self._send("collect"))

    def synchronize(self) -> None:
        if self.down is None and not self.closed:
            self._reply(self._send("sync"))

    def close(self) -> None:
        "Tell rank 0 to stop (it tells the others), wait for every rank to exit."
        if self.closed:
            return
        try:
            if self.down is None and self.workers.failure is None:
                self._send("stop")
        finally:
            self.closed = True
            self.workers.stop(30.0)

# %%
@patch
def _send(self: MultiProcExecutor, kind: str, *args, payload=None) -> int:
    "Send rank 0 one request (numbered: its answer carries the number); Ctrl-C never cuts a message in half."
    self._check()
    self.number += 1
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        self.workers.rpc.send((kind, self.number, *args))
        if payload is not None:
            self.workers.rpc.send_bytes(payload)
    except OSError:   # a broken pipe: rank 0 is gone
        self._lost()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return self.number


@patch
def _reply(self: MultiProcExecutor, number: int | None, timeout: float = STEP_TIMEOUT):
    "Rank 0's answer to request `number` (answers to older requests, left by an interrupted wait, are dropped)."
    deadline = time.monotonic() + timeout
    while True:
        while not self.workers.rpc.poll(0.05):   # never blocked for long: a failure, and Ctrl-C, are seen at once
            self._check()
            if time.monotonic() > deadline:
                self._take_down(f"tensor-parallel rank 0 did not answer within {timeout:.0f} s")
        try:
            answer = self.workers.rpc.recv()
        except (EOFError, OSError):
            self._lost()
        if number is None or answer[0] == number:
            return answer[1]


@patch
def _check(self: MultiProcExecutor) -> None:
    if self.closed:
        raise RuntimeError("this tensor-parallel engine is closed")
    if self.down is None and self.workers.failure is not None:
        self._take_down(self.workers.failure)   # a rank failed since the last call: its own error
    if self.down is not None:
        raise RuntimeError(f"the tensor-parallel group is down (make a new LLM); it failed with: {self.down}")


@patch
def _lost(self: MultiProcExecutor) -> None:
    "Rank 0's pipe broke: it died. The watch thread says how, once it has seen the exit."
    deadline = time.monotonic() + 10.0
    while self.workers.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    self._take_down(self.workers.failure or "tensor-parallel rank 0 closed its pipe unexpectedly")


@patch
def _take_down(self: MultiProcExecutor, failure: str) -> None:
    self.down = failure
    self.workers.kill()
    self.workers.stop(10.0)
    raise RuntimeError(failure)

# %%
def make_tp_executor(config: Config):
    "Spawned workers, one per device; or, when torchrun started this process, its rank of torchrun's group."
    set_comm_env()
    launched = torchrun_env()
    return MultiProcExecutor(config) if launched is None else torchrun_rank(config, launched)
