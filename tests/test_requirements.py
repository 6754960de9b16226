"""requirements.txt and environment.yml must pin the same packages at the same versions."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pins(lines):
    out = {}
    for line in lines:
        line = line.split("#")[0].strip().lstrip("-").strip()
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^;\s]+)\s*(;.*)?$", line)
        if m:
            out[m.group(1).lower()] = (m.group(2), (m.group(3) or "").replace(" ", ""))
    return out


def test_requirements_are_all_pinned():
    reqs = [l.split("#")[0].strip() for l in (ROOT / "requirements.txt").read_text().splitlines()]
    reqs = [l for l in reqs if l]
    assert reqs and all("==" in l for l in reqs), [l for l in reqs if "==" not in l]


def test_environment_yml_matches_requirements():
    req = pins((ROOT / "requirements.txt").read_text().splitlines())
    env_lines = (ROOT / "environment.yml").read_text().splitlines()
    pip_section = env_lines[next(i for i, l in enumerate(env_lines) if l.strip() == "- pip:") + 1 :]
    env = pins(pip_section)
    assert req == env
    assert {"torch", "triton", "transformers", "nbdev", "nbval"} <= set(req)
