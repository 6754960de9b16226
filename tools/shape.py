"""The shape of the course and the package: the longest notebook code cells, the largest files, the longest functions.

    python tools/shape.py            # print the report; exit 1 when a limit is broken (`make test` runs it)

Limits of the course: a main-path notebook (notebooks/NN_*.ipynb) <= 80 cells and <= 4,500 words of markdown; the
README <= 1,000 words. Limits, on the code as ruff formats it: a notebook code cell <= 70 lines (one that holds a
Triton kernel <= 80); a package file <= 300 lines; a function <= 60 lines (a Triton kernel, decorated with
`triton.jit`, <= 80), measured whole: from its `def` line to its last, its signature included.

The report also prints the size of the core (what the course's main path builds: the engine, the layers, Qwen3, the
Triton kernels, the sampler, the `LLM` API) and of the extensions (serving, tensor parallelism, MoE, the flash-attn
and FlashInfer backends, GGUF, the other families), by file; the course-only modules (`bench`, `viz`) are apart.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_CELL, MAX_FILE, MAX_FUNCTION, MAX_KERNEL = 70, 300, 60, 80
MAX_CELLS, MAX_WORDS, MAX_README_WORDS = 80, 4500, 1000  # a main-path notebook; the README
EXTENSIONS = {  # runtime files beyond the course's main path -> the extension they belong to
    "entrypoints/": "serving",
    "distributed/": "tensor parallelism",
    "engine/multiproc_executor.py": "tensor parallelism",
    "engine/worker.py": "tensor parallelism",
    "layers/moe.py": "MoE",
    "models/qwen3_moe.py": "MoE",
    "kernels/fused_moe.py": "MoE",
    "kernels/moe_reference.py": "MoE",
    "kernels/flash_attention.py": "flash-attn / FlashInfer",
    "kernels/backends.py": "flash-attn / FlashInfer",
    "layers/attention_backends/flash_backend.py": "flash-attn / FlashInfer",
    "models/gguf_loader.py": "GGUF",
    "real_model.py": "GGUF",
    "models/llama.py": "other families",
    "models/qwen2.py": "other families",
}
COURSE_ONLY = ("viz", "bench")  # the drawing and benchmark code: modules or subpackages whose names start so


def course_only(rel: str) -> bool:
    return rel.split("/")[0].startswith(COURSE_ONLY) or rel == "kernels/bench.py"


def extension(rel: str) -> str | None:
    return next((name for prefix, name in EXTENSIONS.items() if rel.startswith(prefix)), None)


def is_kernel(node: ast.FunctionDef) -> bool:
    "Decorated with `triton.jit` (or `triton.jit(...)`)."
    return any("triton.jit" in ast.unparse(d) for d in node.decorator_list)


def functions(path: Path) -> list[tuple[int, str, int]]:
    "(lines from `def` to its end, where, limit) of every function and method of a module."
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        (
            node.end_lineno - node.lineno + 1,
            f"{path.relative_to(ROOT)}:{node.lineno} {node.name}",
            MAX_KERNEL if is_kernel(node) else MAX_FUNCTION,
        )
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def code_cells(notebook: Path) -> list[tuple[int, str, int]]:
    "(lines, where, limit) of every code cell of a notebook."
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    out = []
    for i, c in enumerate(cells):
        if c["cell_type"] != "code":
            continue
        source = "".join(c["source"])
        limit = MAX_KERNEL if "@triton.jit" in source else MAX_CELL
        out.append((len(source.splitlines()), f"{notebook.relative_to(ROOT / 'notebooks').as_posix()}[{i}]", limit))
    return out


def words(text: str) -> int:
    return len(text.split())


def notebooks() -> list[Path]:
    "The main path, then the deep dives and the solutions."
    return sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "notebooks").glob("*/*.ipynb"))


def course() -> list[str]:
    "Print each notebook's cells, markdown words and longest code cell; return the broken limits of the main path."
    broken = []
    print("notebook: cells, markdown words, longest code cell")
    for nb in notebooks():
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        text = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
        n_words = sum(words(t) for t in text)
        longest = max((len("".join(c["source"]).splitlines()) for c in cells if c["cell_type"] == "code"), default=0)
        name = nb.relative_to(ROOT / "notebooks").as_posix()
        print(f"  {name}: {len(cells)}, {n_words:,}, {longest}")
        if nb.parent.name == "notebooks" and (len(cells) > MAX_CELLS or n_words > MAX_WORDS):
            broken.append(f"{name}: {len(cells)} cells, {n_words:,} words > {MAX_CELLS}, {MAX_WORDS:,}")
    readme = words((ROOT / "README.md").read_text(encoding="utf-8"))
    print(f"README.md: {readme:,} words")
    if readme > MAX_README_WORDS:
        broken.append(f"README.md: {readme:,} words > {MAX_README_WORDS:,}")
    return broken


def report() -> list[str]:
    "Print the figures; return the broken limits."
    files = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in sorted((ROOT / "minivllm").rglob("*.py"))}
    rel = {p: p.relative_to(ROOT / "minivllm").as_posix() for p in files}
    parts: dict[str, int] = {}
    for p, n in files.items():
        part = "course-only" if course_only(rel[p]) else extension(rel[p]) or "core"
        parts[part] = parts.get(part, 0) + n
    ext = {k: v for k, v in parts.items() if k not in ("core", "course-only")}
    funcs = sorted((f for p in files for f in functions(p)), reverse=True)
    cells = sorted((c for nb in notebooks() for c in code_cells(nb)), reverse=True)
    largest = sorted(files.items(), key=lambda item: -item[1])
    print(f"package: {sum(files.values())} lines in {len(files)} files (as ruff formats them)")
    print(f"core: {parts.get('core', 0)}; extensions: {sum(ext.values())} (", end="")
    print(", ".join(f"{k} {v}" for k, v in sorted(ext.items(), key=lambda kv: -kv[1])), end="")
    print(f"); course-only: {parts.get('course-only', 0)}")
    print("largest files:", ", ".join(f"{rel[p]} {n}" for p, n in largest[:5]))
    print("longest functions:", ", ".join(f"{n} {where}" for n, where, _ in funcs[:5]))
    print("longest code cells:", ", ".join(f"{n} {where}" for n, where, _ in cells[:5]))
    broken = [f"code cell {where}: {n} lines > {limit}" for n, where, limit in cells if n > limit]
    broken += [f"{p.relative_to(ROOT)}: {n} lines > {MAX_FILE}" for p, n in files.items() if n > MAX_FILE]
    broken += [f"function {where}: {n} lines > {limit}" for n, where, limit in funcs if n > limit]
    return broken + course()


if __name__ == "__main__":
    problems = report()
    print("shape: " + ("; ".join(problems) if problems else "within limits"))
    sys.exit(1 if problems else 0)
