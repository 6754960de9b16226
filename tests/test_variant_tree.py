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


def run_in_tree(tree: Path, script: str) -> str:
    "Run `script` in a fresh interpreter that imports `tree`'s package (Triton's interpreter); its standard output."
    env = dict(os.environ, PYTHONPATH=str(tree), TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-P", "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


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
    assert run_in_tree(tree, script).strip() == str(tree / "minivllm" / "__init__.py")


def test_a_moved_anchor_is_an_error(variant_tree, tmp_path):
    tree = variant_tree.make_tree(tmp_path / "v")
    (tree / "minivllm/kernels/common.py").write_text("PDL_MAX_ROWS = 4  # moved\n")
    with pytest.raises(SystemExit, match="PDL_MAX_ROWS"):
        variant_tree.edit_few_row(tree, 16)


def test_the_probes_tiles_drive_the_packages_few_row_products(variant_tree, tmp_path):
    best = {
        "qkv": [16, 1024, 8, 1, 2],
        "o": [16, 1024, 4, 2, 2],
        "gate_up": [32, 1024, 8, 1, 1],
        "down": [32, 512, 4, 3, 1],
    }
    probe = {"rows": {"8": {"check": {}, "sweep_o": [], "best": best}, "32": {"check": {}, "best": best}}}
    tiles = variant_tree.probe_tiles(probe)
    assert list(tiles) == [16]  # 32 rows took 8 rows' tiles: not swept there
    assert tiles[16][(1024, 2048, False, False)] == [16, 1024, 4, 2, 2]
    tree = variant_tree.make_tree(tmp_path / "v", tuned_few_rows=tiles, few_rows_max=8)
    (tree / "minivllm/data").symlink_to(ROOT / "minivllm/data")
    script = (
        "import torch, torch.nn.functional as F\n"
        "from minivllm.kernels import few_rows\n"
        "from minivllm.layers import kernel_policy\n"
        "assert kernel_policy.FEW_ROWS and few_rows.FEW_ROWS_STEP_MAX == 8\n"
        "print(few_rows.few_rows_tiles(8, 4096, 1024, True), few_rows.few_rows_tiles(8, 3072, 1024, True, True))\n"
        "print(few_rows.few_rows_tiles(8, 1024, 3072, False), few_rows.few_rows_tiles(32, 1024, 3072, False))\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x, w = torch.randn(5, 2048, generator=g).half(), (torch.randn(1024, 2048, generator=g) / 40).half()\n"
        "want = F.linear(x.float(), w.float())\n"
        "print(float((few_rows.few_rows_mm(x, w).float() - want).abs().max() / want.abs().max()))\n"
    )
    lines = run_in_tree(tree, script).splitlines()
    assert lines[0] == "(16, 16, 1024, 1, 8) (16, 32, 1024, 1, 8)"  # the probe's tiles at 8 rows
    assert lines[1].startswith("(16, 32, 512, 3, 4) (32, ")  # 32 rows: the package's own tiles
    assert float(lines[2]) < 2e-3  # o's product in the probe's tiles (two 1,024-input steps), float16 rounding


def test_a_probe_swept_at_32_rows_tiles_steps_of_17_to_32(variant_tree, tmp_path):
    best = {
        "qkv": [32, 1024, 8, 1, 2],
        "o": [64, 256, 8, 3, 1],
        "gate_up": [16, 1024, 4, 1, 1],
        "down": [32, 256, 4, 2, 2, 4],
    }
    probe8 = {"rows": {"8": {"sweep_o": [], "best": dict(best, o=[16, 1024, 4, 2, 2])}}}
    probe32 = {"rows": {"32": {"sweep_o": [], "best": best}}}
    tiles = variant_tree.probe_tiles(probe8, probe32)
    assert sorted(tiles) == [16, 32]
    tree = variant_tree.make_tree(tmp_path / "v", tuned_few_rows=tiles, few_rows_max=32)
    (tree / "minivllm/data").symlink_to(ROOT / "minivllm/data")
    script = (
        "import torch, torch.nn.functional as F\n"
        "from minivllm.kernels import few_rows\n"
        "assert few_rows.FEW_ROWS_STEP_MAX == 32\n"
        "print(few_rows.few_rows_tiles(8, 1024, 2048, False), few_rows.few_rows_tiles(24, 1024, 2048, False))\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x, w = torch.randn(24, 2048, generator=g).half(), (torch.randn(1024, 2048, generator=g) / 40).half()\n"
        "want = F.linear(x.float(), w.float())\n"
        "print(float((few_rows.few_rows_mm(x, w).float() - want).abs().max() / want.abs().max()))\n"
        "import few_row_chain_probe\n"
        "x, w = torch.randn(24, 3072, generator=g).half(), (torch.randn(1024, 3072, generator=g) / 40).half()\n"
        "want = F.linear(x.float(), w.float())\n"
        "print(float((few_rows.few_rows_mm(x, w).float() - want).abs().max() / want.abs().max()))\n"
        "print(sorted(k[1] for k in few_row_chain_probe._SCRATCH))\n"
    )
    lines = run_in_tree(tree, script).splitlines()
    assert lines[0] == "(16, 16, 1024, 2, 4) (32, 64, 256, 3, 8)"
    assert float(lines[1]) < 2e-3
    assert float(lines[2]) < 2e-3  # down in 4 slices of K, summed by the last program
    assert lines[3] == "[32]"  # down's partials: the split-K kernel ran


def test_more_rows_start_early_in_a_pdl_tree(variant_tree, tmp_path):
    tree = variant_tree.make_tree(tmp_path / "v", pdl_max_rows=16)
    (tree / "minivllm/data").symlink_to(ROOT / "minivllm/data")
    assert json.loads((tree / "variant.json").read_text())["pdl_max_rows"] == 16
    script = "from minivllm.kernels import common\nprint(common.PDL_MAX_ROWS)\n"
    assert run_in_tree(tree, script).strip() == "16"


def test_tree_agree_finds_the_first_differing_token():
    agree = load_tool("tree_agree")
    assert agree.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert agree.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert agree.first_difference([1, 2, 3], [1, 2]) == 2
