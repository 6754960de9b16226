"""Greedy constrained outputs on the CPU and on a GPU (CUDA graphs, float32 both): the same tokens? Every GPU output
is validated against its spec (issue 50, item 4). Usage: python tools/structured_agree.py OUT.json"""

import json
import sys

sys.path.insert(0, "tests")
from test_structured_outputs_engine import PROMPTS, SPECS, check

from minivllm import LLM, TINY_MODEL_PATH, SamplingParams

params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=s) for s in SPECS.values()] * 2
prompts = (PROMPTS * 2)[: len(params)]
runs = {}
for device in ("cpu", "cuda"):
    with LLM(TINY_MODEL_PATH, device=device, dtype="float32") as llm:
        runs[device] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
same = [a.token_ids == b.token_ids for a, b in zip(runs["cpu"], runs["cuda"])]
for kind, out in zip(list(SPECS) * 2, runs["cuda"]):
    check(kind, out.text)
print(json.dumps({"same_tokens": same, "gpu_texts": [o.text for o in runs["cuda"]]}, indent=1))
json.dump(
    {"same_tokens": same, "texts": {d: [o.text for o in r] for d, r in runs.items()}}, open(sys.argv[1], "w"), indent=1
)
