from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .tiny_model import TINY_MODEL_PATH

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "TINY_MODEL_PATH"]
__version__ = "0.1.0"
