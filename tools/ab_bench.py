"""Same-call A/B of the GPU benchmark: `python -m minivllm.bench ARGS` on two package trees, or on one tree under two
environments, alternating A B A B A B (each run a fresh process), then each figure's medians and the ratio B/A.

    python tools/ab_bench.py --env-a MINIVLLM_PDL=0 --env-b MINIVLLM_PDL=1 --out ab.json -- --latency --skip-standard
    python tools/ab_bench.py --base-commit main --out ab.json                 # A: main's package, B: this tree's
    python tools/ab_bench.py --base-commit main --base-dir .carry/ab_base --prepare-only   # only make the base tree
    python tools/ab_bench.py --tree-a .carry/ab_base --runs 3 --max-seconds 560 --out ab.json -- --num-seqs 256
    python tools/ab_bench.py --tree-a BASE --tree-b V1 --tree v2=V2 --tree v3=V3 --runs 2 -- --latency --skip-standard

A tree is a folder that holds a `minivllm` package (by default both A and B are this repository; a B named alone is
measured against this repository, and with `--env-a`/`--env-b` A is B's tree); `--tree NAME=PATH`
adds further arms, run after A and B in each round (A B v2 v3 A B v2 v3 ...), each reported against A: copies of the
base tree with one constant changed each compare several variants in one call. Each run's
PYTHONPATH starts with its tree and python runs with -P, so that the working directory's own `minivllm` is not the
one imported; before the first run, each arm checks which `minivllm` it imports. `--base-commit` makes tree A from a
commit: `git archive COMMIT minivllm | tar -x` without `minivllm/data` (the embedded tiny model, which the GPU bench
does not use), into `--base-dir` or a temporary folder. On a machine without the repository's history, make it here
with `--prepare-only` and take the folder along.

The figures come from each run's results file (the bench's `--out`, which this tool sets), not from its printout:
every workload's output tok/s (`runs[].output_tok_s`; the standard run's host time a decode step at batch 256 too),
and with `--latency` the single stream's output tok/s and the decode step of each batch size (ms: lower is better,
as for the host time). The summary (`--out`) is written again after every run, so a command cut short still leaves
what it measured; `--max-seconds` starts no run that would end past that budget (judged by the slowest run so far),
so the summary is complete before a hard limit kills the command.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECK = "import minivllm, os; print(os.path.realpath(os.path.dirname(minivllm.__file__)))"


def parse_env(items: list[str]) -> dict[str, str]:
    "['K=V', ...] -> {'K': 'V', ...} (an empty value is kept: the variable set to '')."
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"ab_bench: an environment setting is KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def make_base_tree(repo: Path, commit: str, dest: Path) -> str:
    "Extract `commit`'s `minivllm` package (without its data folder) into `dest`; the commit's full hash."
    full = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", commit + "^{commit}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    tar = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", full, "--", "minivllm", ":(exclude)minivllm/data"],
        check=True,
        capture_output=True,
    ).stdout
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(tar), mode="r:") as archive:
        archive.extractall(dest, filter="data")
    (dest / "AB_BASE_COMMIT").write_text(full + "\n")
    return full


def run_env(tree: Path, settings: dict[str, str]) -> dict[str, str]:
    "This process's environment, the arm's settings on top, and PYTHONPATH starting with the arm's tree."
    env = dict(os.environ, **settings)
    env["PYTHONPATH"] = os.pathsep.join([str(tree)] + [p for p in [env.get("PYTHONPATH", "")] if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def check_tree(tree: Path, env: dict[str, str]) -> str:
    "Import `minivllm` as a run would; refuse when it is not the tree's own."
    found = subprocess.run([sys.executable, "-P", "-c", CHECK], env=env, capture_output=True, text=True)
    want = os.path.realpath(tree / "minivllm")
    if found.returncode or found.stdout.strip() != want:
        raise SystemExit(
            f"ab_bench: the runs of tree {tree} would import minivllm from {found.stdout.strip()!r}, "
            f"not {want!r}\n{found.stderr[-2000:]}"
        )
    return want


def metrics(results: dict) -> dict[str, float]:
    """The figures of one results file: each workload's output tok/s (and the standard one's host time a decode step
    at batch 256); the card's measured rates; the single stream's output tok/s; each batch's decode step."""
    found = {}
    for run in results.get("runs", []):
        engine = "" if run.get("engine", "minivllm") == "minivllm" else f" ({run['engine']})"
        found[f"{run['workload']}{engine} output tok/s"] = run["output_tok_s"]
        if run.get("host_ms_per_decode_step_at_batch_256"):
            found[f"{run['workload']} host ms a decode step, batch 256"] = run["host_ms_per_decode_step_at_batch_256"]
    if peaks := results.get("peaks"):  # the card's rates as the run measured them (a bench that measures them)
        found["card copy TB/s"], found["card bf16 TFLOP/s"] = peaks["bandwidth"] / 1e12, peaks["flops"] / 1e12
    if latency := results.get("latency"):
        found["single stream output tok/s"] = latency["single_stream"]["output_tok_s"]
        for row in latency.get("decode_steps", []):
            found[f"decode step ms, batch {row['batch']}"] = row["step_ms"]
    return found


def without_traces(results: dict) -> dict:
    "The results file less its step traces (the bulk of it), for the summary."
    return dict(results, runs=[{k: v for k, v in run.items() if k != "trace"} for run in results.get("runs", [])])


def one_run(cmd: list[str], env: dict[str, str], log: Path, timeout: float | None) -> tuple[int, float]:
    "Run `cmd` (its output to `log`), in a process group of its own that a timeout ends whole; (status, seconds)."
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = -signal.SIGKILL
    return code, time.perf_counter() - start


def medians(runs: list[dict], names: tuple[str, ...] = ("A", "B")) -> dict[str, dict]:
    "Per figure: each arm's values in run order, their medians, B/A (`ratio`) and each further arm's over A."
    table: dict[str, dict] = {}
    for run in runs:
        for name, value in run["metrics"].items():
            table.setdefault(name, {f"{n}_runs": [] for n in names})[f"{run['arm']}_runs"].append(value)
    for row in table.values():
        for n in names:
            row[n] = statistics.median(row[f"{n}_runs"]) if row[f"{n}_runs"] else None
        for n in names[1:]:
            ratio = row[n] / row["A"] if row["A"] and row[n] is not None else None
            row["ratio" if n == "B" else f"ratio_{n}"] = ratio
    return table


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3f}"


def table_lines(table: dict[str, dict], names: tuple[str, ...] = ("A", "B")) -> list[str]:
    "The medians, each arm's ratio to A (B/A first), and every run's figure."
    ratio_keys = ["ratio" if n == "B" else f"ratio_{n}" for n in names[1:]]
    lines = [
        f"{'figure':34} "
        + " ".join(f"{n + ' median':>10}" for n in names)
        + " "
        + " ".join(f"{n + '/A':>7}" for n in names[1:])
        + "   "
        + " | ".join(f"{n} runs" for n in names)
    ]
    for name, row in table.items():
        ratios = ["-" if row[k] is None else f"{row[k]:.3f}" for k in ratio_keys]
        lines.append(
            f"{name:34} "
            + " ".join(f"{fmt(row[n]):>10}" for n in names)
            + " "
            + " ".join(f"{r:>7}" for r in ratios)
            + "   "
            + " | ".join(" ".join(map(fmt, row[f"{n}_runs"])) for n in names)
        )
    return lines


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    "The tool's own arguments, and the bench's (everything after `--`)."
    ours, bench = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(
        prog="python tools/ab_bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--tree-a",
        type=Path,
        default=None,
        help="A's package tree (default: this repository, B's with --env-a/-b, or --base-commit's)",
    )
    ap.add_argument("--tree-b", type=Path, default=ROOT, help="B's package tree (default: this repository)")
    ap.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a further arm (name: letters, digits, _) and its package tree, run after A and B in each round",
    )
    ap.add_argument("--base-commit", default=None, help="make tree A from this commit of --repo (git archive)")
    ap.add_argument("--base-dir", type=Path, default=None, help="where --base-commit's tree goes (default: a temp dir)")
    ap.add_argument("--prepare-only", action="store_true", help="make --base-commit's tree in --base-dir and stop")
    ap.add_argument("--repo", type=Path, default=ROOT, help="the repository --base-commit is read from")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="for every arm")
    ap.add_argument("--env-a", action="append", default=[], metavar="K=V", help="for A's runs only")
    ap.add_argument("--env-b", action="append", default=[], metavar="K=V", help="for B's runs only")
    ap.add_argument("--runs", type=int, default=3, help="runs of each arm, alternated A B A B ... (default 3)")
    ap.add_argument("--max-seconds", type=float, default=None, help="start no run that would end past this")
    ap.add_argument("--run-timeout", type=float, default=None, help="seconds one run may take before it is ended")
    ap.add_argument("--keep-going", action="store_true", help="go on after a failed run (default: stop)")
    ap.add_argument(
        "--bench-cmd",
        default=None,
        help="the command before the bench's arguments (default: this python -P -m minivllm.bench)",
    )
    ap.add_argument("--work-dir", type=Path, default=None, help="each run's results file and log (default: temp)")
    ap.add_argument("--out", type=Path, default=None, help="the summary JSON")
    args = ap.parse_args(ours)
    if any(a == "--out" or a.startswith("--out=") for a in bench):
        ap.error("the tool sets the bench's --out (one results file a run): leave it out of the bench's arguments")
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.prepare_only and not (args.base_commit and args.base_dir):
        ap.error("--prepare-only needs --base-commit and --base-dir")
    return args, bench


def arms(args: argparse.Namespace) -> dict[str, dict]:
    "Each arm's tree (made from --base-commit if asked), its settings and, where known, its commit."
    common = parse_env(args.env)
    tree_b, commit_a = args.tree_b.resolve(), None
    one_tree = args.env_a or args.env_b  # one tree under two environments; else a variant B against this repository
    tree_a = args.tree_a.resolve() if args.tree_a else tree_b if one_tree else ROOT.resolve()
    if args.base_commit:
        if args.tree_a:
            raise SystemExit("ab_bench: --base-commit makes tree A: give it or --tree-a, not both")
        tree_a = (args.base_dir or Path(tempfile.mkdtemp(prefix="ab_base_"))).resolve()
        commit_a = make_base_tree(args.repo, args.base_commit, tree_a)
        print(f"tree A: {args.base_commit} ({commit_a[:12]}) in {tree_a}", flush=True)
    elif (tree_a / "AB_BASE_COMMIT").is_file():
        commit_a = (tree_a / "AB_BASE_COMMIT").read_text().strip()
    plan = dict(
        A=dict(tree=tree_a, env={**common, **parse_env(args.env_a)}, commit=commit_a),
        B=dict(tree=tree_b, env={**common, **parse_env(args.env_b)}, commit=None),
    )
    for item in args.tree:
        name, sep, path = item.partition("=")
        if not sep or not path or not name.replace("_", "").isalnum() or name in plan or name.startswith("ratio"):
            raise SystemExit(f"ab_bench: --tree is NAME=PATH with a new name of letters, digits and _, got {item!r}")
        tree = Path(path).resolve()
        stamp = tree / "AB_BASE_COMMIT"
        commit = stamp.read_text().strip() if stamp.is_file() else None
        plan[name] = dict(tree=tree, env=dict(common), commit=commit)
    return plan


def fits(args: argparse.Namespace, started: float, done: list[dict], runs_needed: int) -> bool:
    "Whether `runs_needed` more runs, each as long as the slowest so far, end within --max-seconds."
    if args.max_seconds is None or not done:
        return True
    return time.perf_counter() - started + runs_needed * max(r["seconds"] for r in done) <= args.max_seconds


def main(argv: list[str] | None = None) -> int:
    args, bench = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    plan = arms(args)
    if args.prepare_only:
        return 0
    base_cmd = shlex.split(args.bench_cmd) if args.bench_cmd else [sys.executable, "-P", "-m", "minivllm.bench"]
    for name, arm in plan.items():
        arm["run_env"] = run_env(arm["tree"], arm["env"])
        if not args.bench_cmd:
            check_tree(arm["tree"], arm["run_env"])
        print(
            f"{name}: tree {arm['tree']}, env {' '.join(f'{k}={v}' for k, v in arm['env'].items()) or '-'}", flush=True
        )
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="ab_bench_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    names = tuple(plan)
    order = list(names) * args.runs
    summary = dict(
        bench_args=bench,
        bench_cmd=base_cmd,
        work_dir=str(work),
        order=order,
        runs=[],
        medians={},
        arms={k: dict(tree=str(a["tree"]), env=a["env"], commit=a["commit"]) for k, a in plan.items()},
        complete=False,
        stopped=None,
    )
    for index, arm in enumerate(order, 1):
        if not fits(args, started, summary["runs"], len(names) if arm == "A" else 1):  # (an A run starts a round)
            summary["stopped"] = f"--max-seconds {args.max_seconds}: no time for run {index}"
            break
        out, log = work / f"run{index}_{arm}.json", work / f"run{index}_{arm}.log"
        left = None if args.max_seconds is None else max(1.0, args.max_seconds - (time.perf_counter() - started))
        timeout = min(t for t in (left, args.run_timeout, float("inf")) if t is not None)
        code, seconds = one_run(
            base_cmd + bench + ["--out", str(out)],
            plan[arm]["run_env"],
            log,
            None if timeout == float("inf") else timeout,
        )
        results = json.loads(out.read_text()) if code == 0 and out.is_file() else {}
        entry = dict(
            index=index,
            arm=arm,
            returncode=code,
            seconds=seconds,
            metrics=metrics(results),
            results=without_traces(results),
            log_tail=log.read_text(errors="replace").splitlines()[-15:],
        )
        summary["runs"].append(entry)
        summary["medians"] = medians([r for r in summary["runs"] if r["returncode"] == 0], names)
        if args.out:
            args.out.write_text(json.dumps(summary, indent=1) + "\n")
        figures = ", ".join(f"{k} {fmt(v)}" for k, v in entry["metrics"].items())
        print(
            f"run {index}/{len(order)} {arm}: {seconds:.1f} s, " + (figures if code == 0 else f"FAILED ({code})"),
            flush=True,
        )
        if code != 0:
            print("\n".join("    " + line for line in entry["log_tail"]), flush=True)
            if not args.keep_going:
                summary["stopped"] = f"run {index} ({arm}) failed with status {code}"
                break
    else:
        summary["complete"] = all(r["returncode"] == 0 for r in summary["runs"])
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(table_lines(summary["medians"], tuple(plan))))
    print(
        f"runs: {len(summary['runs'])} of {len(order)} in {time.perf_counter() - started:.0f} s"
        + (f"; stopped: {summary['stopped']}" if summary["stopped"] else "")
        + f"; files: {work}"
    )
    return 0 if summary["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
