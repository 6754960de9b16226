"""The course's links: every relative link in a notebook's markdown (and in the glossary) points at a file of the
repository, and every link into the glossary at one of its entries."""

from __future__ import annotations

import json
import re
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    "GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def markdown_of(path: Path) -> str:
    "The markdown of a notebook (or a .md file), without code: fenced blocks and inline code spans."
    text = (
        path.read_text()
        if path.suffix == ".md"
        else "\n".join(
            "".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"
        )
    )
    return re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))


def test_relative_links_resolve_and_glossary_anchors_exist():
    glossary = NOTEBOOKS / "glossary.md"
    anchors = {slug(line.lstrip("#")) for line in glossary.read_text().splitlines() if line.startswith("### ")}
    assert {"sm", "warp", "hbm", "gemm", "tf32", "pinned-memory"} <= anchors
    broken, linked = [], set()
    docs = [NOTEBOOKS.parent / "README.md", *sorted((NOTEBOOKS.parent / "docs").glob("*.md"))]
    for path in sorted(NOTEBOOKS.rglob("*.ipynb")) + [glossary, *docs]:
        for target in LINK.findall(markdown_of(path)):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            if not (path.parent / file).exists():
                broken.append(f"{path.name}: {target}")
            elif Path(file).name == "glossary.md" and anchor:
                linked.add(anchor)
                if anchor not in anchors:
                    broken.append(f"{path.name}: {target} (no such glossary entry)")
    assert not broken, broken
    assert len(linked) >= 20  # the terms are linked where they first appear


def test_players_show_their_controls_before_the_kernel_runs():
    "Every widget a notebook displays has its state stored in the notebook (JupyterLab draws it before any run)."
    for path in sorted(NOTEBOOKS.rglob("*.ipynb")):
        nb = json.loads(path.read_text())
        views = [
            o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
            for c in nb["cells"]
            if c["cell_type"] == "code"
            for o in c.get("outputs", [])
            if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
        ]
        state = nb["metadata"].get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
        missing = [view for view in views if view not in state]
        assert not missing, f"{path.name}: widget views without stored state: {missing}"


def test_gpu_cells_can_be_rerun_after_the_cpu_cells_they_build_on(tmp_path):
    "tools/run_gpu_cells.py --setup: the CPU cells named run first, in the namespace the GPU cells then share."
    import subprocess
    import sys

    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("x = 41\nprint('setup')"),
        nbformat.v4.new_code_cell("y = 0"),
        nbformat.v4.new_code_cell("#| gpu\nprint('answer', x + 1)"),
    ]
    path, out = tmp_path / "nb.ipynb", tmp_path / "cells.json"
    nbformat.write(nb, path)
    tool = [sys.executable, str(Path(__file__).resolve().parents[1] / "tools" / "run_gpu_cells.py"), str(path)]
    subprocess.run([*tool, "--setup", "x = 41", "--out", str(out)], check=True, capture_output=True, timeout=120)
    assert json.loads(out.read_text()) == [{"source": "#| gpu\nprint('answer', x + 1)", "text": "answer 42\n"}]
    subprocess.run([*tool, "--merge", str(out)], check=True, capture_output=True, timeout=120)
    assert nbformat.read(path, as_version=4).cells[2].outputs[0].text == "answer 42\n"
