"""The OpenAI API's requests: JSON bodies validated into GenerationInput, every field honoured or refused.

A field OpenAI defines that changes nothing in the output (`user`, `metadata`, `store`, `service_tier`) is accepted;
one this server lacks is accepted only at the value that asks for nothing; any other name is refused with 400 and
named, as OpenAI refuses an unknown argument. Extensions (vLLM's names): `top_k` (-1 or 0 = no limit), `min_p`,
`repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`, `include_stop_str_in_output`,
`skip_special_tokens`, `cache_salt`, and structured output as `structured_outputs` ({"json" | "regex" | "choice" |
"grammar" | "json_object": ...}) or the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
besides OpenAI's `response_format`.
"""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, ValidationError

from services.router.frontend import GenerationInput
from shared.errors import InvalidRequest
from shared.tool_calls import tool_choice

Code = grpc.StatusCode

# Fields accepted only at values that ask for nothing: anything else would be silently ignored, so it is refused.
_NO_OP: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "best_of": (None, 1), "functions": (None, []),
    "function_call": (None, "none"),
    "spaces_between_special_tokens": (None, True),
}
# Fields of OpenAI's API that change nothing in the output: accepted and unused.
_UNUSED = {"metadata", "store", "service_tier"}


class ApiError(Exception):
    """A refusal the Frontend cannot make itself (an unknown model, an unsupported field)."""

    def __init__(self, status: grpc.StatusCode, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(Body):
    include_usage: bool | None = None


class GenerationRequest(Body):
    model: str | None = None              # None: the served model
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    stop: Any = None                      # a string or a list of strings
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str = ""
    user: str | None = None               # accepted, unused
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None    # token id (as a string) -> bias in [-100, 100]
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: dict[str, Any] | None = None     # {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict[str, Any] | None = None  # vLLM's: exactly one of json, regex, choice, grammar, json_object
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = None    # vLLM's: each prompt token's log-probability (after the first), top N


class CompletionRequest(GenerationRequest):
    prompt: Any = None                    # prompts_of's forms
    logprobs: int | None = None           # the top N per token (0: the chosen token's only)
    echo: bool | None = None              # the prompt before the completion (with logprobs: the prompt's too)


class ChatMessage(Body):
    role: str
    content: Any = None                   # a string, or a list of {"type": "text", "text": ...} parts
    tool_calls: list[dict[str, Any]] | None = None    # an assistant's earlier calls
    tool_call_id: str | None = None       # a tool result's call
    name: str | None = None


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage]
    tools: list[Any] | None = None
    tool_choice: Any = None               # "none", "auto", "required" or {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None     # extra variables for the chat template (vLLM's)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def _where(loc: tuple[int | str, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def parse(model: type[GenerationRequest], body: bytes) -> GenerationRequest:
    """Validates a JSON body; a bad one raises ApiError(INVALID_ARGUMENT) naming the field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = _where(err["loc"])
        raise ApiError(Code.INVALID_ARGUMENT, f"{where}: {err['msg']}" if where else
                       f"the body must be a JSON object: {err['msg']}", param=where or None) from None
    for name, value in (req.model_extra or {}).items():
        if name in _UNUSED or (name in _NO_OP and value in _NO_OP[name]):
            continue
        if name in _NO_OP:
            raise ApiError(Code.INVALID_ARGUMENT, f"{name} is not supported: this server lacks it; leave it unset",
                           param=name, code="unsupported_parameter")
        raise ApiError(Code.INVALID_ARGUMENT, f"unrecognized request argument supplied: {name}", param=name,
                       code="unknown_parameter")
    return req


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise InvalidRequest("stop must be a string or a list of strings")


MAX_PROMPTS = 32                          # prompts of one /v1/completions request


def prompts_of(prompt: Any) -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids or a list of those")
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequest(f"at most {MAX_PROMPTS} prompts a request, got {len(prompt)}")
    for i, p in enumerate(prompt):
        ids = isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        if not (isinstance(p, str) or ids) or not p:
            raise InvalidRequest(f"prompt[{i}] is empty or not a string or a list of token ids")
    return prompt


def message(i: int, m: ChatMessage) -> dict[str, Any]:
    """A chat message for the template: text content, and an assistant's calls or a tool result's id."""
    out: dict[str, Any] = {"role": m.role, "content": None if m.content is None and m.tool_calls
                           else content_text(i, m.content)}
    if m.tool_calls:
        for j, c in enumerate(m.tool_calls):
            fn = c.get("function")
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
                raise InvalidRequest(f'messages[{i}].tool_calls[{j}] needs {{"function": {{"name", "arguments"}}}}')
        out["tool_calls"] = m.tool_calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def content_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts")
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise InvalidRequest(f'messages[{i}].content[{j}] is not a {{"type": "text", "text": ...}} part; '
                                 "only text is supported")
    return "\n".join(part["text"] for part in content)


def generation_input(req: GenerationRequest, vocab_size: int) -> GenerationInput:
    """The Frontend's input for a parsed request; raises InvalidRequest on what pydantic cannot check."""
    top_k, temperature = req.top_k, req.temperature
    if top_k is not None and (top_k == -1 or top_k >= vocab_size):
        top_k = 0                                                 # no limit, as -1 means in vLLM
    inp = GenerationInput(temperature=temperature, top_p=req.top_p, top_k=top_k, seed=req.seed, n=req.n,
                          stop=_stop(req.stop), ignore_eos=req.ignore_eos, cache_salt=req.cache_salt,
                          include_stop_str_in_output=req.include_stop_str_in_output,
                          skip_special_tokens=req.skip_special_tokens,
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          repetition_penalty=req.repetition_penalty, min_p=req.min_p,
                          logit_bias=_logit_bias(req.logit_bias), min_tokens=req.min_tokens,
                          stop_token_ids=list(req.stop_token_ids or []), bad_words=list(req.bad_words or []))
    inp.guide_kind, inp.guide = structured(req)
    if isinstance(req, ChatRequest):
        inp.messages = [message(i, m) for i, m in enumerate(req.messages)]
        inp.template_kwargs = dict(req.chat_template_kwargs or {})
        if len(json.dumps(inp.template_kwargs)) > 65536:
            raise InvalidRequest("chat_template_kwargs is larger than 64 KiB")
        choice = tool_choice(req.tools, req.tool_choice, req.parallel_tool_calls is not False)
        if choice is not None and choice.mode != "none":
            inp.tools, inp.tool_choice = choice.tools, choice
            kind, spec = choice.guide()
            if kind and inp.guide_kind:
                raise ApiError(Code.INVALID_ARGUMENT, f"tool_choice {choice.mode} and a structured output cannot "
                               "be combined", param="tool_choice")
            if kind:
                inp.guide_kind, inp.guide = kind, spec
        inp.max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(Code.INVALID_ARGUMENT, "top_logprobs needs logprobs: true", param="top_logprobs")
        inp.logprobs = (req.top_logprobs or 0) if req.logprobs else None
    elif isinstance(req, CompletionRequest):
        inp.max_tokens = 16 if req.max_tokens is None else req.max_tokens     # OpenAI's default for completions
        inp.logprobs = req.logprobs
        if req.echo and req.logprobs is not None:
            inp.prompt_logprobs = req.logprobs
    if req.prompt_logprobs is not None:
        if req.stream:
            raise ApiError(Code.INVALID_ARGUMENT, "prompt_logprobs is not available when stream is enabled",
                           param="prompt_logprobs")
        inp.prompt_logprobs = max(inp.prompt_logprobs or 0, req.prompt_logprobs)
    return inp


def generation_inputs(req: GenerationRequest, vocab_size: int) -> list[GenerationInput]:
    """One input per prompt: a chat request has one, a completion request one per prompt of its list."""
    inp = generation_input(req, vocab_size)
    if not isinstance(req, CompletionRequest):
        return [inp]
    return [replace(inp, prompt=p) if isinstance(p, str) else replace(inp, prompt_ids=p)
            for p in prompts_of(req.prompt)]


def structured(req: GenerationRequest) -> tuple[str, str]:
    """(guide kind, spec) of the request's structured output, ("", "") for none; at most one way of asking."""
    asked: list[tuple[str, str, Any]] = []                   # (field, kind, value)
    rf = req.response_format
    if rf is not None and rf.get("type") != "text":
        if rf.get("type") == "json_object":
            asked.append(("response_format", "json_object", ""))
        elif rf.get("type") == "json_schema" and isinstance(rf.get("json_schema"), dict) \
                and isinstance(rf["json_schema"].get("schema"), dict):
            asked.append(("response_format", "json_schema", rf["json_schema"]["schema"]))
        else:
            raise ApiError(Code.INVALID_ARGUMENT, 'response_format must be {"type": "text"}, {"type": "json_object"} '
                           'or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                           param="response_format")
    for key, value in (req.structured_outputs or {}).items():
        kind = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                "json_object": "json_object"}.get(key)
        if kind is None:
            raise ApiError(Code.INVALID_ARGUMENT, f"structured_outputs.{key} is not one of json, regex, choice, "
                           "grammar, json_object", param="structured_outputs")
        if kind != "json_object" or value:
            asked.append((f"structured_outputs.{key}", kind, "" if kind == "json_object" else value))
    for field, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        if getattr(req, field) is not None:
            asked.append((field, kind, getattr(req, field)))
    if not asked:
        return "", ""
    if len(asked) > 1:
        raise ApiError(Code.INVALID_ARGUMENT, f"ask for one structured output, not {len(asked)} "
                       f"({', '.join(a[0] for a in asked)})", param=asked[1][0])
    field, kind, value = asked[0]
    if kind in ("json_schema", "choice") and not isinstance(value, str):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise ApiError(Code.INVALID_ARGUMENT, f"{field} must be a string", param=field)
    return kind, value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        if not key.isdigit():
            raise ApiError(Code.INVALID_ARGUMENT, f"logit_bias keys must be token ids, got {key!r}",
                           param="logit_bias")
        out[int(key)] = value
    return out
