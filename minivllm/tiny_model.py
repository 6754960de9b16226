# %%
from importlib.resources import files

TINY_MODEL_PATH: str = str(files("minivllm") / "data" / "tiny-qwen3")
