"""The saved figures read on a page: every PNG in figures/ is at least 400 pixels tall (its text is at least 9 points:
`minivllm.viz.figures.save_figure` raises smaller text when it saves)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

from minivllm.viz.figures import MIN_HEIGHT_PX, _png_height

FIGURES = sorted((Path(__file__).resolve().parents[1] / "figures").glob("*.png"))


@pytest.mark.parametrize("path", FIGURES, ids=lambda p: p.name)
def test_figure_is_tall_enough(path):
    assert _png_height(path) >= MIN_HEIGHT_PX


def test_save_figure_raises_small_text_and_short_figures(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minivllm.viz.figures import figures_dir, save_figure

    monkeypatch.setenv("MINIVLLM_FIGURES", str(tmp_path))
    fig, ax = plt.subplots(figsize=(8, 1))
    label = ax.text(0.5, 0.5, "small", fontsize=6)
    path = save_figure(fig, "strip.png")
    assert figures_dir() == tmp_path and path == tmp_path / "strip.png"
    assert _png_height(path) >= MIN_HEIGHT_PX and label.get_fontsize() == 9


def test_every_figure_is_cited():
    "figures/ keeps what the course, the docs, the changelog, the tools or the tests cite (by name or by a glob)."
    root = Path(__file__).resolve().parents[1]
    texts = [p.read_text(encoding="utf-8") for p in sorted((root / "notebooks").rglob("*.ipynb"))]
    texts += [p.read_text(encoding="utf-8") for p in root.glob("*.md")]
    texts += [
        p.read_text(encoding="utf-8")
        for d in ("docs", "tools", "tests")
        for p in sorted((root / d).rglob("*.*"))
        if p.suffix in (".md", ".py", ".sh")
    ]
    text = "\n".join(texts)
    globs = set(re.findall(r"figures/([\w.*-]*\*[\w.*-]*)", text))
    uncited = [
        p.name
        for p in sorted((root / "figures").iterdir())
        if p.name not in text and not any(fnmatch.fnmatch(p.name, g) for g in globs)
    ]
    assert not uncited, uncited
