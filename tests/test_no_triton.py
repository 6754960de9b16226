"""The CPU path needs no Triton (project issue 47): where Triton does not install (a Mac), the course still runs.

`import minivllm`, `LLM` (generate, chat, stream), `AsyncLLM` and the OpenAI-compatible server run on a CPU with
every `triton` import failing: the host-side plans of the kernels live in plain modules (kernels/cascade_plan.py,
kernels/moe_reference.py; kernels/cascade.py and kernels/fused_moe.py re-export them), and the Triton kernels are
imported only where a GPU runs them. (Notebooks 05 and 06 still run the kernels on a CPU with TRITON_INTERPRET=1.)
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import importlib.abc, sys

    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError(f"{name} is not installed (blocked by the test)")

    sys.meta_path.insert(0, NoTriton())

    import asyncio
    import httpx
    import minivllm
    from minivllm import TINY_MODEL_PATH, LLM, AsyncLLM, SamplingParams
    from minivllm.entrypoints.api_server import build_app

    params = SamplingParams(temperature=0, max_tokens=4)
    with LLM(TINY_MODEL_PATH, device="cpu", max_model_len=128) as llm:
        [out] = llm.generate(["def f(x):"], params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
        [chat] = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)
        assert len(chat.outputs[0].token_ids) == 4
        pieces = list(llm.stream("import os", params))
        assert pieces[-1].finished and sum(len(p.outputs[0].token_ids) for p in pieces) == 4

    async def main():
        async with AsyncLLM(TINY_MODEL_PATH, device="cpu", max_model_len=128) as llm:
            async for last in llm.generate("def f(x):", params, request_id="a"):
                pass
            assert last.finished and len(last.outputs[0].token_ids) == 4
            transport = httpx.ASGITransport(app=build_app(llm, "tiny"))
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
                r = await http.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
                r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                                  "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text

    asyncio.run(main())
    assert "triton" not in sys.modules and not any(m.startswith("minivllm.kernels.") and m.split(".")[-1] in
        ("common", "cascade", "fused_moe", "paged_decode", "paged_prefill", "store_kvcache", "gemv", "activation",
         "qk_norm_rope", "rope_decode") for m in sys.modules), sorted(m for m in sys.modules if "kernels" in m)
    print("ok")
""")


@pytest.mark.timeout(300)
def test_the_cpu_path_runs_without_triton():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=280)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]
