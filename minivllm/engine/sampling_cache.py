from __future__ import annotations

import numpy as np
import torch

from ..layers.sampler import SamplingTensors
from ..sampling_params import SamplingParams


class SamplingCache:
    "Per request: its SamplingParams and seeded generator; per batch: SamplingTensors, rebuilt when requests change."

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.generator = torch.Generator(device).manual_seed(seed)   # this engine's, for requests without a seed
        self._seq_ids = np.empty(0, dtype=np.int64)
        self._batch: tuple[SamplingTensors, dict[int, torch.Generator] | None] | None = None

    def add(self, seq_id: int, params: SamplingParams) -> None:
        self.params[seq_id] = params
        if params.seed is not None and not params.greedy:
            self.generators[seq_id] = torch.Generator(self.device).manual_seed(params.seed)

    def free(self, seq_id: int) -> None:
        self.params.pop(seq_id, None)
        self.generators.pop(seq_id, None)

    def batch(self, seq_ids: np.ndarray) -> tuple[SamplingTensors, dict[int, torch.Generator] | None]:
        "The sampling tensors of the rows `seq_ids`, and each seeded row's generator (None when no row has a seed)."
        if self._batch is None or not np.array_equal(seq_ids, self._seq_ids):
            ids = seq_ids.tolist()
            tensors = SamplingTensors.from_params([self.params[i] for i in ids], self.device)
            rows = {row: self.generators[i] for row, i in enumerate(ids) if i in self.generators} if self.generators else {}
            self._seq_ids, self._batch = seq_ids.copy(), (tensors, rows or None)
        return self._batch
