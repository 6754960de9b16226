from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling_params import RequestOutputKind, SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    "The fields both endpoints share: OpenAI's, then vLLM's extras. None: the model's default (generation_config)."
    model_config = ConfigDict(extra="forbid")   # an unknown field is an error (400), not silently ignored
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None                    # vLLM's extras
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None
                        ) -> SamplingParams:
        "The request as SamplingParams (its invalid values raise ValueError/TypeError with the field's name)."
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                               "frequency_penalty", "repetition_penalty") if getattr(self, k) is not None}
        model_defaults = {k: getattr(defaults, k) for k in ("temperature", "top_p", "top_k", "min_p",
                                                            "presence_penalty", "frequency_penalty", "repetition_penalty")}
        bias = None if self.logit_bias is None else {_token_id(k): v for k, v in self.logit_bias.items()}
        return SamplingParams(
            **(model_defaults | given), n=self.n, seed=self.seed, stop=self.stop, max_tokens=max_tokens,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs, logit_bias=bias,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _token_id(key: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None


class CompletionRequest(SamplingFields):
    "POST /v1/completions."
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0)
    echo: Literal[False] = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    "POST /v1/chat/completions."
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None               # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
