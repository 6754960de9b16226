"""The prose's numbers against the cells': every number of three or more significant digits in a notebook's markdown
must appear in one of its code cells or outputs, or in a results file the notebook reads.

    python tools/prose_numbers.py                       # every notebook (main path, deep dives, solutions)
    python tools/prose_numbers.py notebooks/06_*.ipynb  # some; exit 1 when a number is missing

A number is compared after removing thousands separators and rounding the printed value to the digits the prose
quotes: "21,500" matches a printed 21,512 (rounded to hundreds), "0.72" does not need checking (two significant
digits), "61.5%" matches a printed 61.48 or 0.6148. Skipped: URLs, model names and sizes glued to a unit letter
(`135M`, `0.6B`), words with digits (`h200`, `fp8`) and the constants in ALLOWED, each with its reason.
"""

from __future__ import annotations

import bisect
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
# a number: digits with optional thousands separators and decimals, not part of a word, a path, a version or a hash
NUMBER = re.compile(r"(?<![\w.#])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?![\w.]*\d)(?![A-Za-wyz_])")
URL = re.compile(r"https?://\S+|\]\([^)]*\)")
RESULTS = re.compile(r"""["']([^"']+\.json)["']""")
ALLOWED = {  # number -> why the prose may quote it without a cell printing it
    "3.11": "the Python version the course is tested on",
}


def significant(text: str) -> int:
    "Significant digits of a number as written: leading zeros and an integer's trailing zeros do not count."
    digits = text.replace(",", "")
    if "." in digits:
        return len(digits.replace(".", "").lstrip("0"))
    return len(digits.lstrip("0").rstrip("0"))


def window(written: str) -> tuple[float, float]:
    "The printed values that round to `written` at the digits it quotes (decimals, or an integer's trailing zeros)."
    digits = written.replace(",", "")
    if "." in digits:
        step = 10.0 ** -len(digits.split(".")[1])
    else:
        step = 10.0 ** (len(digits) - len(digits.rstrip("0")))
    value = float(digits)
    return value - step / 2 * (1 + 1e-9), value + step / 2 * (1 - 1e-9)


def shows(values: list[float], written: str) -> bool:
    "Does a sorted list of printed values hold `written`, as printed, or as a fraction the prose gives in percent?"
    lo, hi = window(written)
    for scale in (1, 100):
        i = bisect.bisect_left(values, lo / scale)
        if i < len(values) and values[i] <= hi / scale:
            return True
    return False


def printed_numbers(text: str) -> list[float]:
    "Every number in a text, sorted (thousands separators removed)."
    out = []
    for m in re.finditer(r"\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?", text):
        try:
            out.append(float(m.group().rstrip(",").replace(",", "")))
        except ValueError:
            continue
    return sorted(out)


def haystack(notebook: Path, cells: list[dict]) -> str:
    "The text of every code cell and output, and of the results files the code reads."
    parts = []
    for c in cells:
        if c["cell_type"] != "code":
            continue
        source = "".join(c["source"])
        parts.append(source)
        for o in c.get("outputs", []):
            parts.append("".join(o.get("text", "")))
            for kind, data in o.get("data", {}).items():
                if kind.startswith("text/"):
                    parts.append("".join(data))
        for name in RESULTS.findall(source):
            path = (notebook.parent / name).resolve()
            if path.is_file():
                parts.append(path.read_text(encoding="utf-8"))
    return "\n".join(parts)


def missing(notebook: Path) -> list[str]:
    "The prose's numbers no cell of the notebook shows: 'cell N: number'."
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    values = printed_numbers(haystack(notebook, cells))
    out = []
    for i, c in enumerate(cells):
        if c["cell_type"] != "markdown":
            continue
        prose = URL.sub(" ", "".join(c["source"]))
        for m in NUMBER.finditer(prose):
            written = m.group(1) + (m.group(2) or "")
            if significant(written) < 3 or written.replace(",", "") in ALLOWED:
                continue
            if not shows(values, written):
                out.append(f"cell {i}: {written}")
    return out


def all_notebooks() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb")) + sorted(NOTEBOOKS.glob("*/*.ipynb"))


if __name__ == "__main__":
    paths = [Path(p).resolve() for p in sys.argv[1:]] or all_notebooks()
    bad = 0
    for p in paths:
        gaps = missing(p)
        bad += len(gaps)
        print(f"{p.relative_to(ROOT)}: {'ok' if not gaps else '; '.join(gaps)}")
    sys.exit(1 if bad else 0)
