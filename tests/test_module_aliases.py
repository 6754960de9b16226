"""The old module paths of the benchmark and the pictures (project issue 47): `minivllm.bench` and `minivllm.viz` are
packages now, and each module that moved into them keeps its old path for one release, as an alias that warns with
the new path and holds the new module's very objects (notebook 13, "Old module paths")."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings

import pytest

MOVED = {  # old path -> the modules it now is
    "minivllm.bench_card": ["minivllm.bench.card"],
    "minivllm.bench_latency": ["minivllm.bench.latency"],
    "minivllm.bench_load": ["minivllm.bench.load"],
    "minivllm.bench_models": ["minivllm.bench.models"],
    "minivllm.bench_serve": ["minivllm.bench.servers", "minivllm.bench.serve"],
    "minivllm.viz_bench": ["minivllm.viz.bench"],
    "minivllm.viz_serving": ["minivllm.viz.serving"],
    "minivllm.viz_timeline": ["minivllm.viz.timeline"],
}
OLD_NAMES = {  # each old module's `__all__` before the move: all still importable from the old path
    "minivllm.bench_card": "H200_BANDWIDTH H200_FLOPS timed_ms copy_bandwidth matmul_rate driver_version cuda_versions "
    "measure_card card_line",
    "minivllm.bench_latency": "spec_prompts traced_generate decode_step_table single_stream latency_lines run_latency",
    "minivllm.bench_load": "poisson_arrivals percentile random_prompts RequestResult send_request keeps_up summarize "
    "run_rate run_async",
    "minivllm.bench_models": "QWEN3_0_6B ARCHS moe_terms roofline random_qwen3_folder config_folder",
    "minivllm.bench_serve": "BACKENDS HEADER free_port server healthy with_word_tokenizer parse_args server_command "
    "request_bodies table_row bench_backend main on_sigterm",
    "minivllm.viz_bench": "plot_report plot_decode_steps plot_serving",
    "minivllm.viz_serving": "plot_latency_sweep",
    "minivllm.viz_timeline": "PREFILL_COLOR DECODE_COLOR RECOMPUTE_COLOR KV_COLOR COLORS legend_handles draw_timeline "
    "compare_timelines",
}


def fresh_import(name: str):
    "Import `name` anew (an earlier import would not warn again), leaving sys.modules as it was."
    before = sys.modules.pop(name, None)
    try:
        return importlib.import_module(name)
    finally:
        if before is not None:
            sys.modules[name] = before


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_holds_the_new_modules_objects(old):
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} is deprecated: import {MOVED[old][-1]}")):
        module = fresh_import(old)
    new = [importlib.import_module(n) for n in MOVED[old]]
    assert sorted(module.__all__) == sorted(name for m in new for name in m.__all__)
    for m in new:
        for name in m.__all__:
            assert getattr(module, name) is getattr(m, name), (old, name)
    assert set(OLD_NAMES[old].split()) <= set(module.__all__)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec(f"from {old} import *", namespace)
    assert set(module.__all__) <= set(namespace)


def test_the_packages_keep_the_old_modules_names():
    "`minivllm.bench` and `minivllm.viz`, the old modules' paths, are the packages: their names are still there."
    import minivllm.bench
    import minivllm.viz
    from minivllm.bench import cli, models, runs

    assert minivllm.bench.main is cli.main and minivllm.bench.parse_args is cli.parse_args
    assert minivllm.bench.roofline is models.roofline and minivllm.bench.BenchResult is runs.BenchResult
    old_bench = "standard_workload shared_prefix_workload BenchResult run_minivllm run_transformers environment "
    old_bench += "host_time_per_decode_step parse_args Report run_workloads main"
    assert set(old_bench.split()) <= set(minivllm.bench.__all__)
    old_viz = "FREE_CACHED_COLOR seq_color draw_fragmentation KVSnapshot take_snapshot draw_kv_cache kv_cache_player"
    assert set(old_viz.split()) == set(minivllm.viz.__all__)
    assert all(callable(getattr(minivllm.viz, name)) for name in old_viz.split()[1:])


@pytest.mark.timeout(120)
def test_python_m_on_the_old_path_still_runs_the_serving_benchmark():
    run = subprocess.run(
        [sys.executable, "-m", "minivllm.bench_serve", "--help"], capture_output=True, text=True, timeout=110
    )
    assert run.returncode == 0 and run.stdout.startswith("usage: python -m minivllm.bench serve"), run.stderr[-2000:]
    assert "python -m minivllm.bench_serve is deprecated: use python -m minivllm.bench serve" in run.stderr
