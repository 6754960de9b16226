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
    reqs = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    reqs = [req for req in reqs if req]
    assert reqs and all("==" in req for req in reqs), [req for req in reqs if "==" not in req]


def test_environment_yml_matches_requirements():
    req = pins((ROOT / "requirements.txt").read_text().splitlines())
    env_lines = (ROOT / "environment.yml").read_text().splitlines()
    pip_section = env_lines[next(i for i, line in enumerate(env_lines) if line.strip() == "- pip:") + 1 :]
    env = pins(pip_section)
    assert req == env
    assert {"torch", "triton", "transformers", "nbdev", "nbval"} <= set(req)
