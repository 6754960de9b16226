"""The package reads as ordinary Python (project issue 47): whole classes that type checkers and editors see.

The notebooks grow a class across cells with fastcore's `@patch`; tools/export.py folds each patched method into its
class's body in the module, so the package holds ordinary classes and does not need fastcore. A user's script of the
public API type-checks with mypy (configured in pyproject.toml: torch, transformers and the other heavy libraries are
not followed, so a cold check takes seconds), and the methods it calls have their real signatures, not `Any`.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minivllm"

USER_SCRIPT = """
import asyncio
from typing import reveal_type

from minivllm import TINY_MODEL_PATH, LLM, AsyncLLM, CompletionOutput, RequestOutput, SamplingParams
from minivllm.engine.llm_engine import LLMEngine

params = SamplingParams(temperature=0.0, max_tokens=4, stop=["\\n\\n"])
llm = LLM(TINY_MODEL_PATH, device="cpu", max_model_len=128)
outs: list[RequestOutput] = llm.generate(["def f(x):"], params)
first: CompletionOutput = outs[0].outputs[0]
text: str = first.text
ids: list[int] = first.token_ids
reason: str | None = first.finish_reason
chats: list[RequestOutput] = llm.chat([{"role": "user", "content": "Hi"}], params)
for delta in llm.stream("import os", params):
    piece: str = delta.outputs[0].text
    done: bool = delta.finished
llm.close()

engine = LLMEngine(TINY_MODEL_PATH, device="cpu")
request_id: str = engine.add_request(None, "def f(x):", params)
while engine.has_unfinished_requests():
    for out in engine.step():
        finished: bool = out.finished
engine.close()


async def main() -> str:
    async with AsyncLLM(TINY_MODEL_PATH, device="cpu") as async_llm:
        last: RequestOutput | None = None
        async for item in async_llm.generate("def f(x):", params, request_id="a"):
            last = item
        return "" if last is None else last.outputs[0].text

print(asyncio.run(main()))
reveal_type(llm.chat)
reveal_type(llm.stream)
reveal_type(engine.step)
reveal_type(AsyncLLM.generate)
reveal_type(AsyncLLM.__aenter__)
reveal_type(SamplingParams.changes_logits)
"""


def mypy(tmp_path: pathlib.Path, script: str) -> subprocess.CompletedProcess:
    (tmp_path / "user.py").write_text(script)
    env = os.environ | {"MYPYPATH": str(ROOT)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-error-summary",
            str(tmp_path / "user.py"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=280,
    )


@pytest.mark.timeout(300)
def test_a_script_of_the_public_api_type_checks(tmp_path):
    pytest.importorskip("mypy")
    run = mypy(tmp_path, USER_SCRIPT)
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    assert run.returncode == 0 and not errors, run.stdout + run.stderr
    revealed = [line.split("Revealed type is ", 1)[1] for line in run.stdout.splitlines() if "Revealed type" in line]
    assert len(revealed) == 6 and not any(r == '"Any"' for r in revealed), run.stdout
    assert "RequestOutput" in revealed[0] and "Iterator" in revealed[1] and "RequestOutput" in revealed[2]
    assert "RequestOutputStream" in revealed[3] and "AsyncLLM" in revealed[4] and "bool" in revealed[5]


@pytest.mark.timeout(300)
def test_mypy_reports_a_misused_method(tmp_path):
    "The check has teeth: a wrong call on a method that a notebook added with @patch is an error."
    pytest.importorskip("mypy")
    run = mypy(
        tmp_path,
        textwrap.dedent("""
        from minivllm.engine.llm_engine import LLMEngine
        engine = LLMEngine("model")
        outputs: int = engine.step()
        engine.abort_request(1.5)
    """),
    )
    assert run.returncode == 1 and run.stdout.count(": error:") == 2, run.stdout + run.stderr


def test_no_module_is_patched_or_needs_fastcore():
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                decorators = [ast.unparse(d) for d in node.decorator_list]
                assert not any(d == "patch" or d.startswith("patch(") for d in decorators), f"{path}: {node.name}"
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "fastcore" for a in node.names), path
            if isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "fastcore", path


def test_folded_methods_keep_their_cell_markers():
    "Each method a notebook added with @patch sits in its class under the marker of the cell it came from."
    text = (PACKAGE / "engine" / "llm_engine.py").read_text(encoding="utf-8")
    tree = ast.parse(text)
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLMEngine")
    assert {"step", "abort_request", "close", "_add"} <= {n.name for n in engine.body if isinstance(n, ast.FunctionDef)}
    lines = text.splitlines()
    markers = [i for i, line in enumerate(lines) if line.startswith("    # %% ../../notebooks/10_llm_engine.ipynb #")]
    assert markers and all(engine.lineno < i + 1 <= engine.end_lineno for i in markers)
