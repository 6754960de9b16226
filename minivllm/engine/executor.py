from __future__ import annotations

from ..config import Config
from ..sampling_params import SamplingParams
from .model_runner import ModelRunner, StepHandle
from .step_inputs import StepInputs


class Executor:
    "Runs the engine's steps on one `ModelRunner` in this process (notebook 12's executors: on several devices)."

    def __init__(self, config: Config, runner: ModelRunner | None = None):
        self.runner = runner or ModelRunner(config)
        self.num_blocks = self.runner.num_blocks

    def add_request(self, seq_id: int, params: SamplingParams) -> None:
        "A new request: the sampler keeps its parameters (and its generator, with a seed) until it is freed."
        self.runner.add_request(seq_id, params)

    def free_request(self, seq_id: int) -> None:
        self.runner.free_request(seq_id)

    def launch(self, step: StepInputs) -> StepHandle:
        return self.runner.execute(step)

    def collect(self, handle: StepHandle) -> tuple[list[int], list[dict[int, float] | None] | None]:
        return self.runner.collect(handle)

    def synchronize(self) -> None:
        "Wait for every launched step (after an error: before anything reuses its blocks)."
        self.runner.synchronize()

    def close(self) -> None:
        self.runner.close()
