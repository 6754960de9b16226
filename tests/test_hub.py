"""Models by Hugging Face Hub id (project issue 14): `LLM("owner/name")` finds the model in the local Hugging Face
cache (a cache folder the test builds, laid out as huggingface_hub lays it out), honours HF_HUB_OFFLINE, and says
what to do when the model is not cached and the Hub is out of reach. Nothing here touches the network: the Hub's
address is a local port nothing listens on."""

import shutil

import pytest
from huggingface_hub import constants

from minivllm import LLM, TINY_MODEL_PATH, SamplingParams
from minivllm.models.hub import resolve_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    "An empty Hugging Face cache, offline, whose Hub address leads nowhere."
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    return tmp_path


def add_to_cache(root, repo_id: str, revision: str = "0123456789abcdef0123456789abcdef01234567"):
    "The tiny model as huggingface_hub caches a snapshot: models--owner--name/{refs/main, snapshots/<revision>/...}."
    repo = root / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(TINY_MODEL_PATH, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return repo / "snapshots" / revision


def greedy(model: str) -> tuple[list[int], str]:
    with LLM(model, max_model_len=64) as llm:
        out = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
        return out.outputs[0].token_ids, llm.llm_engine.config.model


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "hub unreachable"])
def test_a_hub_id_loads_from_the_local_cache(cache, monkeypatch, offline):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    snapshot = add_to_cache(cache, "minivllm-test/tiny-qwen3")
    tokens, folder = greedy("minivllm-test/tiny-qwen3")
    assert folder == str(snapshot)
    assert tokens == greedy(str(TINY_MODEL_PATH))[0]  # the same tokens as from the folder itself


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "hub unreachable"])
def test_an_uncached_hub_id_says_what_to_do(cache, monkeypatch, offline):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    with pytest.raises(ValueError, match="hf download minivllm-test/not-cached") as e:
        LLM("minivllm-test/not-cached")
    assert str(cache) in str(e.value) and ("HF_HUB_OFFLINE" in str(e.value)) == offline


def test_folders_and_other_names_are_left_alone(cache, tmp_path, monkeypatch):
    assert resolve_model(str(TINY_MODEL_PATH)) == str(TINY_MODEL_PATH)
    assert resolve_model("no-slash-here") == "no-slash-here"  # not a Hub id: the loader says it is not a folder
    (tmp_path / "owner" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("owner/name") == "owner/name"  # a folder wins over a Hub id of the same name
