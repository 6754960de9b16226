#!/usr/bin/env python3
"""Usage: python tools/smollm2_bf16_probe.py SmolLM2-135M-Instruct.Q4_1.gguf out.json (on a GPU machine).

SmolLM2-135M-Instruct (Q4_1 GGUF) in bfloat16 on a GPU: where minivllm's answer to the France chat leaves
transformers'. Top-5 of the first generated token's distribution and the greedy answer, for transformers (bf16, fp32)
and minivllm under variants (default; early launch off; eager; torch attention; float32)."""

import json
import os
import subprocess
import sys

import torch

path, out = sys.argv[1], sys.argv[2]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
res = {"gpu": torch.cuda.get_device_name()}


def hf(dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).cuda().eval()
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    ids = ids.cuda()
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float()
        gen = model.generate(ids, max_new_tokens=24, do_sample=False)
    lp = logits.log_softmax(-1)
    top = lp.topk(5)
    return {
        "top5": [(tok.decode([i]), round(v, 4)) for v, i in zip(top.values.tolist(), top.indices.tolist())],
        "answer": tok.decode(gen[0, ids.shape[1] :]),
        "prompt_len": ids.shape[1],
    }


for name, dt in [("hf_bf16", torch.bfloat16), ("hf_fp32", torch.float32)]:
    try:
        res[name] = hf(dt)
    except Exception as e:
        res[name] = f"error {type(e).__name__}: {e}"
    print(name, res[name], flush=True)

VARIANT = r"""
import json, sys
from minivllm import LLM, SamplingParams
path, kw = sys.argv[1], json.loads(sys.argv[2])
chat = [{"role": "user", "content": "What is the capital of France?"}]
with LLM(path, max_model_len=512, gpu_memory_utilization=0.3, **kw) as llm:
    o = llm.chat([chat], SamplingParams(temperature=0, max_tokens=24, logprobs=5), use_tqdm=False)[0].outputs[0]
    first = o.logprobs[0]
    top = sorted(first.items(), key=lambda kv: -kv[1].logprob)[:5]
    print(json.dumps({"top5": [(lp.decoded_token, round(lp.logprob, 4)) for _, lp in top], "answer": o.text}))
"""
variants = {
    "default": ({}, {}),
    "pdl_off": ({}, {"MINIVLLM_PDL": "0"}),
    "eager": ({"enforce_eager": True}, {}),
    "torch_attn": ({"attention_backend": "torch"}, {}),
    "eager_torch_pdl_off": ({"enforce_eager": True, "attention_backend": "torch"}, {"MINIVLLM_PDL": "0"}),
    "fp32": ({"dtype": "float32"}, {}),
}
for name, (kw, env) in variants.items():
    p = subprocess.run(
        [sys.executable, "-c", VARIANT, path, json.dumps(kw)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=240,
    )
    line = p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else p.stderr[-800:]
    try:
        res[name] = json.loads(line)
    except Exception:
        res[name] = line
    print(name, res[name], flush=True)
json.dump(res, open(out, "w"), indent=1, ensure_ascii=False)
