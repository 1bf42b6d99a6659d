"""What the Frontend takes from the front doors (gRPC, HTTP) and hands back: a request as parsed, and each step's
new text per choice. No protobuf here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from shared.tool_calls import ToolChoice


class Logprob(NamedTuple):
    """A token's log-probability, the top ids and their log-probabilities, its rank (1 = most likely; 0 unknown)."""
    logprob: float | None
    top_ids: list[int]
    top_logprobs: list[float]
    rank: int = 0


@dataclass(slots=True)
class GenerationInput:
    """A client's request, as parsed from protobuf or JSON."""
    prompt: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)   # role, content (+ tool_calls, tool_call_id)
    tools: list[dict] | None = None          # OpenAI's tools, rendered by the chat template (shared.tool_calls)
    tool_choice: ToolChoice | None = None    # how the answer may call them (for the reply); None: it may not
    prompt_ids: list[int] = field(default_factory=list)   # a prompt given as token ids
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False    # a stop string that ends a choice stays in its text
    skip_special_tokens: bool = True            # special tokens left out of the text
    ignore_eos: bool = False
    cache_salt: str = ""
    beam_width: int | None = None
    num_speculative_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)
    logprobs: int | None = None              # top N per token (0: the chosen token's only); None: none
    prompt_logprobs: int | None = None       # the prompt's log-probabilities (echo with logprobs), top N
    guide_kind: str = ""                     # structured output (shared.sampling_params.SamplingParams)
    guide: str = ""
    template_kwargs: dict[str, Any] = field(default_factory=dict)   # extra variables for the chat template
    thinking_open: bool = False              # set when rendered: the chat prompt ends inside <think> (reasoning)


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Logprob] | None = None        # per token of token_ids: (logprob, top ids, top logprobs)
    prompt_logprobs: tuple[list[int], list[Logprob]] | None = None   # with the first tokens: prompt ids, logprobs


@dataclass(slots=True)
class StreamChunk:
    choices: list[ChoiceDelta]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    done: bool
    draft_tokens: int = 0
    accepted_tokens: int = 0
