"""tools/variant_tree.py, trial copies of the package for tools/ab_bench.py: every edit finds its anchor in today's
package (a moved anchor fails here, not on a GPU), and the edited tree imports and computes as the package on a CPU,
where none of the edits applies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _tools import load_tool

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def variant_tree():
    return load_tool("variant_tree")


def test_the_sweeps_fastest_launch_per_batch(variant_tree):
    rows = [
        dict(batch=8, block_n=64, num_warps=4, num_stages=3, num_splits=8, us=17.0),
        dict(batch=8, block_n=32, num_warps=4, num_stages=2, num_splits=4, us=14.5),
        dict(batch=32, block_n=128, num_warps=8, num_stages=2, num_splits=2, us=50.0),
    ]
    assert variant_tree.best_launches(dict(results=rows)) == {8: [32, 4, 2, 4], 32: [128, 8, 2, 2]}


def test_every_edit_applies_and_the_tree_runs_on_a_cpu(variant_tree, tmp_path):
    tree = variant_tree.make_tree(tmp_path / "v", launches={2: [32, 4, 2, 3]}, few_row=16, fused_gate_up=64)
    assert json.loads((tree / "variant.json").read_text())["few_row"] == 16
    assert {"few_row_bench.py", "gate_up_silu_bench.py", "kernel_variants.py"} <= {p.name for p in tree.iterdir()}
    assert "PDL_MAX_ROWS = 16 " in (tree / "minivllm/kernels/common.py").read_text()
    (tree / "minivllm/data").symlink_to(ROOT / "minivllm/data")
    script = (
        "import torch, minivllm\n"
        "import minivllm.kernels.paged_decode, minivllm.models.qwen3\n"
        "from minivllm.layers.linear import linear\n"
        "import few_row_bench, gate_up_silu_bench\n"
        "print(minivllm.__file__)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x, w = torch.randn(8, 64, generator=g), torch.randn(32, 64, generator=g)\n"
        "assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tree), TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-P", "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(tree / "minivllm" / "__init__.py")


def test_a_moved_anchor_is_an_error(variant_tree, tmp_path):
    tree = variant_tree.make_tree(tmp_path / "v")
    (tree / "minivllm/kernels/common.py").write_text("PDL_MAX_ROWS = 4  # moved\n")
    with pytest.raises(SystemExit, match="PDL_MAX_ROWS"):
        variant_tree.edit_few_row(tree, 16)
