"""tools/ab_bench.py, the same-call A/B of the GPU benchmark, on fake `minivllm` trees whose `minivllm.bench` writes a
results file at once: the alternation, the trees and environments each run gets, the medians, B/A and the summary."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "ab_bench.py"

FAKE_BENCH = """
import json, os, sys, time
from pathlib import Path
RATE = {rate}
tree = Path(__file__).resolve().parents[1]
count = tree / "count.log"
k = len(count.read_text().splitlines()) if count.is_file() else 0     # this tree's runs so far
with open(count, "a") as f:
    f.write("run\\n")
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(f"{{tree.name}} {{os.environ.get('FAKE_SCALE', '-')}} {{' '.join(sys.argv[1:-2])}}\\n")
if os.environ.get("FAKE_FAIL") == tree.name:
    sys.exit(3)
time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
rate = RATE * float(os.environ.get("FAKE_SCALE", "1")) + k
results = dict(environment=dict(gpu="fake"), peaks=dict(bandwidth=4.3e12, flops=7.9e14),
               runs=[dict(engine="minivllm", workload="standard", output_tok_s=rate, trace=[dict(t=0.0)] * 100)],
               latency=dict(single_stream=dict(output_tok_s=rate / 10),
                            decode_steps=[dict(batch=1, step_ms=1.0 + k), dict(batch=8, step_ms=2.0)]))
Path(sys.argv[sys.argv.index("--out") + 1]).write_text(json.dumps(results))
"""


def fake_tree(folder: Path, rate: float) -> Path:
    "A folder holding a package `minivllm` whose bench reports `rate` + (its earlier runs) output tok/s."
    (folder / "minivllm").mkdir(parents=True)
    (folder / "minivllm" / "__init__.py").write_text("")
    (folder / "minivllm" / "bench.py").write_text(FAKE_BENCH.format(rate=rate))
    return folder


def run_tool(*args: str, log: Path, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, str(TOOL), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, FAKE_LOG=str(log), **env),
    )


@pytest.fixture
def tool():
    spec = importlib.util.spec_from_file_location("ab_bench", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_trees_alternate_and_the_summary_has_medians_and_ratio(tmp_path):
    a, b = fake_tree(tmp_path / "tree_a", 100.0), fake_tree(tmp_path / "tree_b", 110.0)
    log, out = tmp_path / "order.log", tmp_path / "ab.json"
    done = run_tool(
        "--tree-a",
        str(a),
        "--tree-b",
        str(b),
        "--out",
        str(out),
        "--work-dir",
        str(tmp_path / "w"),
        "--",
        "--latency",
        "--skip-standard",
        log=log,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # each run in its own process, A B A B A B, the bench's own arguments passed on (the tool adds --out)
    assert (
        log.read_text().splitlines() == ["tree_a - --latency --skip-standard", "tree_b - --latency --skip-standard"] * 3
    )
    summary = json.loads(out.read_text())
    assert summary["complete"] and summary["order"] == ["A", "B"] * 3
    assert [r["arm"] for r in summary["runs"]] == ["A", "B"] * 3 and all(r["returncode"] == 0 for r in summary["runs"])
    assert summary["arms"]["A"]["tree"] == str(a.resolve()) and summary["arms"]["B"]["tree"] == str(b.resolve())
    std = summary["medians"]["standard output tok/s"]
    assert std["A_runs"] == [100, 101, 102] and std["B_runs"] == [110, 111, 112]
    assert std["A"] == 101 and std["B"] == 111 and std["ratio"] == pytest.approx(111 / 101)
    assert summary["medians"]["single stream output tok/s"]["ratio"] == pytest.approx(111 / 101)
    assert summary["medians"]["decode step ms, batch 1"]["A_runs"] == [1, 2, 3]
    assert summary["medians"]["decode step ms, batch 8"]["ratio"] == 1
    assert summary["medians"]["card copy TB/s"]["A"] == 4.3 and summary["medians"]["card bf16 TFLOP/s"]["ratio"] == 1
    assert "trace" not in summary["runs"][0]["results"]["runs"][0]  # the traces stay in the run's file
    assert json.loads((tmp_path / "w" / "run1_A.json").read_text())["runs"][0]["trace"]
    assert "standard output tok/s" in done.stdout and "1.099" in done.stdout  # the table: 111 / 101


def test_one_tree_two_environments(tmp_path):
    tree = fake_tree(tmp_path / "tree", 100.0)
    log, out = tmp_path / "order.log", tmp_path / "ab.json"
    done = run_tool(
        "--tree-b",
        str(tree),
        "--env-a",
        "FAKE_SCALE=1",
        "--env-b",
        "FAKE_SCALE=2",
        "--runs",
        "4",
        "--out",
        str(out),
        log=log,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert log.read_text().splitlines() == ["tree 1 ", "tree 2 "] * 4
    summary = json.loads(out.read_text())
    assert summary["arms"]["A"]["env"] == {"FAKE_SCALE": "1"} and summary["arms"]["B"]["env"] == {"FAKE_SCALE": "2"}
    std = summary["medians"]["standard output tok/s"]  # one tree: runs 0, 2, 4, 6 are A's; 1, 3, 5, 7 B's
    assert std["A_runs"] == [100, 102, 104, 106] and std["B_runs"] == [201, 203, 205, 207]
    assert std["A"] == 103 and std["B"] == 204


def test_further_trees_run_in_each_round_and_compare_with_a(tmp_path, tool):
    trees = {n: fake_tree(tmp_path / f"tree_{n}", r) for n, r in [("a", 100.0), ("b", 110.0), ("v2", 120.0)]}
    log, out = tmp_path / "order.log", tmp_path / "ab.json"
    done = run_tool(
        "--tree-a",
        str(trees["a"]),
        "--tree-b",
        str(trees["b"]),
        "--tree",
        f"v2={trees['v2']}",
        "--runs",
        "2",
        "--out",
        str(out),
        log=log,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["tree_a", "tree_b", "tree_v2"] * 2
    summary = json.loads(out.read_text())
    assert summary["order"] == ["A", "B", "v2"] * 2 and summary["arms"]["v2"]["tree"] == str(trees["v2"].resolve())
    std = summary["medians"]["standard output tok/s"]
    assert std["v2_runs"] == [120, 121] and std["v2"] == 120.5
    assert std["ratio"] == pytest.approx(110.5 / 100.5) and std["ratio_v2"] == pytest.approx(120.5 / 100.5)
    assert "v2/A" in done.stdout and "1.199" in done.stdout  # the table: 120.5 / 100.5
    for bad in ("B=x", "v 2=x", "v2", "ratio_x=x"):
        with pytest.raises(SystemExit, match="--tree is NAME=PATH"):
            tool.arms(tool.parse_args(["--tree", bad])[0])


def test_a_variant_b_alone_is_measured_against_this_repository(tmp_path, tool):
    variant = fake_tree(tmp_path / "variant", 110.0)
    got = tool.arms(tool.parse_args(["--tree-b", str(variant)])[0])
    assert got["A"]["tree"] == tool.ROOT.resolve() and got["B"]["tree"] == variant.resolve()
    same = tool.arms(tool.parse_args([])[0])  # no tree named: one tree, two environments
    assert same["A"]["tree"] == same["B"]["tree"] == tool.ROOT.resolve()


def test_the_base_tree_from_a_commit(tmp_path, tool):
    repo = fake_tree(tmp_path / "repo", 100.0)
    (repo / "minivllm" / "data").mkdir()
    (repo / "minivllm" / "data" / "weights.bin").write_text("big")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "base"], check=True)
    (repo / "minivllm" / "bench.py").write_text(FAKE_BENCH.format(rate=120.0))  # B: the working tree, changed
    log, out, base = tmp_path / "order.log", tmp_path / "ab.json", tmp_path / "carry" / "ab_base"
    done = run_tool("--repo", str(repo), "--base-commit", "HEAD", "--base-dir", str(base), "--prepare-only", log=log)
    assert done.returncode == 0 and not log.exists(), done.stderr
    assert (base / "minivllm" / "bench.py").is_file() and not (base / "minivllm" / "data").exists()
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert (base / "AB_BASE_COMMIT").read_text().strip() == head
    done = run_tool("--tree-a", str(base), "--tree-b", str(repo), "--runs", "3", "--out", str(out), log=log)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(out.read_text())
    assert summary["arms"]["A"]["commit"] == head
    assert summary["medians"]["standard output tok/s"]["ratio"] == pytest.approx(121 / 101)
    assert tool.make_base_tree(repo, "HEAD", tmp_path / "again") == head  # the same, in this process


def test_bench_cmd_a_failed_run_and_the_time_budget(tmp_path):
    a, b = fake_tree(tmp_path / "a", 100.0), fake_tree(tmp_path / "b", 100.0)
    log, out = tmp_path / "order.log", tmp_path / "ab.json"
    cmd = f"{sys.executable} -P -m minivllm.bench"
    done = run_tool(
        "--tree-a", str(a), "--tree-b", str(b), "--bench-cmd", cmd, "--out", str(out), log=log, FAKE_FAIL="b"
    )
    assert done.returncode == 1 and "FAILED (3)" in done.stdout
    summary = json.loads(out.read_text())
    assert [(r["arm"], r["returncode"]) for r in summary["runs"]] == [("A", 0), ("B", 3)]
    assert not summary["complete"] and "run 2 (B) failed" in summary["stopped"]
    assert summary["medians"]["standard output tok/s"]["B"] is None
    out.unlink()
    done = run_tool(
        "--tree-a", str(a), "--tree-b", str(b), "--max-seconds", "2.5", "--out", str(out), log=log, FAKE_SLEEP="1.0"
    )
    summary = json.loads(out.read_text())
    assert done.returncode == 1 and not summary["complete"] and "--max-seconds" in summary["stopped"]
    assert 1 <= len(summary["runs"]) < 6


def test_refusals(tmp_path, tool):
    log = tmp_path / "order.log"
    done = run_tool("--", "--latency", "--out", "x.json", log=log)
    assert done.returncode == 2 and "the tool sets the bench's --out" in done.stderr
    done = run_tool("--env-a", "NOEQUALS", "--tree-b", str(fake_tree(tmp_path / "t", 1.0)), log=log)
    assert done.returncode != 0 and "KEY=VALUE" in done.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="would import minivllm from"):  # no package there: not this tree's
        tool.check_tree(empty, tool.run_env(empty, {}))
    assert tool.metrics({"runs": [dict(engine="transformers", workload="side-by-side", output_tok_s=5.0)]}) == {
        "side-by-side (transformers) output tok/s": 5.0
    }
