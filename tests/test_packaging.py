"""The package as users install it (project issue 12): the engine runs without the course's libraries.

`pip install minivllm` brings what the engine needs; the pictures and players of the notebooks (matplotlib, ipywidgets)
come with the `course` extra, the HTTP server (FastAPI, uvicorn, Prometheus' client) with the `serve` extra (project
issue 15); fastcore only in the notebooks (issue 47: the modules hold whole classes). A subprocess that makes those
imports fail still imports every runtime module (`AsyncLLM` included) and generates; the drawing modules and the server
stay importable where their libraries are installed.
"""

from __future__ import annotations

import pathlib
import pkgutil
import subprocess
import sys
import textwrap

import pytest

import minivllm

COURSE_ONLY = ("viz",)  # the drawing package minivllm.viz (and the old paths viz_timeline, viz_bench, viz_serving)
BLOCKED = ("matplotlib", "ipywidgets", "fastapi", "starlette", "uvicorn", "prometheus_client", "fastcore")
SERVER = {
    f"minivllm.entrypoints.{m}"
    for m in (
        "api_server",
        "cli",
        "completion_routes",
        "errors",
        "metrics",
        "middleware",
        "openai_format",
        "protocol",
        "request_checks",
        "utility_routes",
    )
}  # the `serve` extra


def runtime_modules() -> list[str]:
    return sorted(
        m.name
        for m in pkgutil.walk_packages(minivllm.__path__, "minivllm.")
        if not m.name.split(".")[1].startswith(COURSE_ONLY)
        and not m.name.endswith(".__main__")
        and m.name not in SERVER
    )


@pytest.mark.timeout(300)
def test_the_runtime_needs_no_course_library():
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, sys

        class Blocked(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {BLOCKED!r}:
                    raise ImportError(f"{{name}} is not installed (blocked by the test)")

        sys.meta_path.insert(0, Blocked())
        for name in {runtime_modules()!r}:
            importlib.import_module(name)
        from minivllm import LLM, SamplingParams, TINY_MODEL_PATH
        with LLM(TINY_MODEL_PATH, device="cpu", max_model_len=128) as llm:
            out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
        assert not any(m.split(".")[0] in {BLOCKED!r} for m in sys.modules)
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=280)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_the_drawing_modules_import_with_the_course_libraries():
    import minivllm.viz
    import minivllm.viz.bench
    import minivllm.viz.serving
    import minivllm.viz.timeline

    assert callable(minivllm.viz.draw_kv_cache) and callable(minivllm.viz.timeline.draw_timeline)
    assert callable(minivllm.viz.bench.plot_report) and callable(minivllm.viz.serving.plot_latency_sweep)
    assert "minivllm.engine.llm_engine" in runtime_modules() and "minivllm.bench.cli" in runtime_modules()
    assert not any(m.startswith(("minivllm.viz.", "minivllm.viz_")) or m == "minivllm.viz" for m in runtime_modules())
    assert "minivllm.entrypoints.async_llm" in runtime_modules()


def test_the_server_modules_import_with_the_serve_extra():
    import importlib

    for name in sorted(SERVER):
        importlib.import_module(name)
    from fastapi import FastAPI

    from minivllm.entrypoints.api_server import add_routes
    from minivllm.entrypoints.cli import parse_serve_args

    app = FastAPI()
    add_routes(app)  # the routes of vLLM's OpenAI-compatible server that minivllm serves
    paths = {(method, route.path) for route in app.routes for method in getattr(route, "methods", ())}
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert ("POST", path) in paths
    for path in ("/health", "/metrics", "/v1/models", "/v1/models/{model_id:path}", "/version"):
        assert ("GET", path) in paths
    args = parse_serve_args(["some/model", "--port", "8123"])
    assert args.model == "some/model" and args.port == 8123


def test_star_import_gives_the_public_api():
    namespace: dict = {}
    exec("from minivllm import *", namespace)
    assert {
        "LLM",
        "AsyncLLM",
        "SamplingParams",
        "RequestOutputKind",
        "RequestOutput",
        "CompletionOutput",
        "TINY_MODEL_PATH",
        "TINY_DRAFT_PATH",
    } <= set(namespace)


@pytest.mark.timeout(240)
def test_the_wheel_holds_what_an_install_needs(tmp_path):
    """A wheel built from the repository: its version is minivllm.__version__ (the one source), and it carries the
    license, the typing marker, the tiny model and the `minivllm` command."""
    import zipfile

    root = pathlib.Path(minivllm.__file__).resolve().parents[1]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (wheel,) = tmp_path.glob("minivllm-*.whl")
    assert wheel.name.startswith(f"minivllm-{minivllm.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    info = f"minivllm-{minivllm.__version__}.dist-info"
    assert {"minivllm/py.typed", f"{info}/licenses/LICENSE", "minivllm/data/tiny-qwen3/config.json"} <= set(names)
    assert "minivllm/data/tiny-qwen3-draft/model.safetensors" in names
    meta = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in meta and f"Version: {minivllm.__version__}" in meta
    assert "minivllm = minivllm.__main__:main" in zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()


def test_llm_and_llm_engine_show_the_engine_arguments():
    "help(LLM), Shift-Tab and inspect see EngineArgs' fields with their defaults, not a bare **kwargs."
    import dataclasses
    import inspect

    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.engine_args import EngineArgs

    expected = {f.name: f.default for f in dataclasses.fields(EngineArgs) if f.name not in ("model", "hf_config")}
    for cls in (minivllm.LLM, LLMEngine):
        params = inspect.signature(cls).parameters
        assert list(params)[0] == "model" and params["model"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert {n: p.default for n, p in params.items() if n != "model"} == expected
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for n, p in params.items() if n != "model")
    assert "max_num_seqs: 'int | None' = None" in str(inspect.signature(minivllm.LLM))
