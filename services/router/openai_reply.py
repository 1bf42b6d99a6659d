"""The OpenAI API's answers: whole responses and stream chunks of chat and text completions, with usage and
log-probabilities in OpenAI's shapes."""
from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from services.router.generation_io import ChoiceDelta, GenerationInput, Logprob, StreamChunk
from shared.tool_stream import ToolCallStream
from shared.errors import PeerUnavailable
from shared.reasoning import split as split_reasoning
from shared.tool_calls import ToolChoice


def _usage(c: StreamChunk) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": c.cached_tokens}}


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


_Tokens = tuple[list[int], list[Logprob]]        # a choice's token ids and their log-probabilities


@dataclass(slots=True)
class _Reply:
    """One request's answer in OpenAI's shapes, whole or as stream chunks; `tok` (the Frontend's tokenizer) names
    the tokens of log-probabilities, when the request asked for them."""
    chat: bool
    model: str
    id: str
    created: int
    tok: Any = None
    tools: ToolChoice | None = None           # a chat request that may call tools (mode other than "none")
    echo: list[str] | None = None             # completions with echo: each choice's prompt text
    reasoning: bool = False                   # chat: <think>...</think> becomes reasoning_content
    chat_input: GenerationInput | None = None  # a chat request's input (its rendering tells thinking_open)
    prompt_logprobs: bool = False             # vLLM's prompt_logprobs field in the answer

    @property
    def thinking_open(self) -> bool:
        """The chat prompt ended inside <think> (known once the Frontend rendered it): answers begin in the
        reasoning."""
        return self.chat_input is not None and self.chat_input.thinking_open

    def whole(self, texts: list[str], reasons: list[str | None], last: StreamChunk,
              tokens: list[_Tokens] | None = None, prompts: list[_Tokens | None] | None = None) -> dict:
        choices = []
        for i, (t, r) in enumerate(zip(texts, reasons)):
            if not self.chat:
                body: dict[str, Any] = {"text": self.echo[i] + t if self.echo else t}
            elif self.tools is None:
                body = {"message": self.thought({"role": "assistant", "content": t})}
            else:
                message, r = self.tool_message(t, r)
                message = self.thought(message)
                body = {"message": message}
            choices.append({"index": i, **body, "logprobs": self.logprobs(*tokens[i]) if tokens else None,
                            "finish_reason": r})
            if self.prompt_logprobs and not self.chat:
                choices[-1]["prompt_logprobs"] = self.prompt_entries(*prompts[i]) if prompts and prompts[i] else None
        out = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices, "usage": _usage(last)}
        if self.prompt_logprobs and self.chat:
            out["prompt_logprobs"] = self.prompt_entries(*prompts[0]) if prompts and prompts[0] else None
        return out

    def prompt_entries(self, ids: list[int], lps: list[Logprob]) -> list[dict | None]:
        """vLLM's prompt_logprobs: None for the first prompt token, then per token {token id: {logprob, rank,
        decoded_token}} for the token itself and the most likely ones."""
        out: list[dict | None] = [None]
        for t, lp in zip(ids[1:], lps):
            entry = {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self.tok.decode([t])}}
            for rank, (i, x) in enumerate(zip(lp.top_ids, lp.top_logprobs), 1):
                entry.setdefault(str(i), {"logprob": x, "rank": rank, "decoded_token": self.tok.decode([i])})
            out.append(entry)
        return out

    def thought(self, message: dict) -> dict:
        """A chat message with its reasoning apart (shared.reasoning), when this reply splits it."""
        if not self.reasoning or not message.get("content"):
            return message
        reasoning, content = split_reasoning(message["content"], self.thinking_open)
        if reasoning is None:
            return message
        return {**message, "content": content, "reasoning_content": reasoning}

    def tool_message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """An assistant message with the calls the answer makes, and its finish reason ("tool_calls" then)."""
        reasoning, text = split_reasoning(text, self.thinking_open) if self.reasoning else (None, text)
        content, calls = self.tools.calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if not calls:
            return message, reason
        message["tool_calls"] = [c.as_openai() for c in calls]
        return message, "tool_calls" if reason == "stop" or self.tools.mode == "named" else reason

    def tool_delta(self, index: int, text: str, reason: str | None) -> dict:
        """A chat choice's whole answer as one stream delta: its calls, or its content."""
        message, reason = self.tool_message(text, reason)
        delta: dict[str, Any] = {}
        if message.get("reasoning_content"):
            delta["reasoning_content"] = message["reasoning_content"]
        if message["content"]:
            delta["content"] = message["content"]
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}

    def tool_stream_delta(self, index: int, stream: ToolCallStream, text: str, reason: str | None) -> dict:
        """A tool-calling chat choice's next stream delta: its new content and call pieces (shared.tool_stream);
        the last one's finish reason is "tool_calls" when it called, as in a whole answer."""
        content, calls = stream.push(text, final=reason is not None)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        if reason is not None and stream.called and (reason == "stop" or self.tools.mode == "named"):
            reason = "tool_calls"
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}

    def chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> dict:
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                               "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            out["usage"] = usage
        return out

    def delta(self, index: int, text: str, reason: str | None, role: bool = False,
              tokens: tuple[list[int], list[Logprob], int] | None = None) -> dict:
        lp = self.logprobs(*tokens) if tokens else None
        if not self.chat:
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
        delta: dict[str, str] = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}

    def reasoning_delta(self, index: int, reasoning: str, content: str, reason: str | None,
                        lp: dict | None = None) -> dict:
        delta = {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": content} if content else {})}
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}

    def logprobs(self, ids: list[int], lps: list[Logprob], offset: int = 0) -> dict:
        """Chat: {"content": [{token, logprob, bytes, top_logprobs}]}; completions: tokens, token_logprobs,
        top_logprobs (the chosen token among them, as vLLM answers) and text_offset from `offset` characters."""
        names: dict[int, str] = {}

        def name(t: int) -> str:
            if t not in names:
                names[t] = self.tok.decode([t])
            return names[t]
        if self.chat:
            def entry(t: int, x: float) -> dict:
                return {"token": name(t), "logprob": x, "bytes": list(name(t).encode())}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, x) for i, x in zip(top, xs)]}
                                for t, (lp, top, xs, _) in zip(ids, lps)]}
        offsets = []
        for t in ids:
            offsets.append(offset)
            offset += len(name(t))
        return {"tokens": [name(t) for t in ids], "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [None if lp is None else {name(t): lp, **{name(i): x for i, x in zip(top, xs)}}
                                 for t, (lp, top, xs, _) in zip(ids, lps)], "text_offset": offsets}


def with_prompt(c: ChoiceDelta, echo: bool) -> tuple[list[int], list[Logprob]]:
    """A choice delta's tokens and log-probabilities, after its prompt's when it carries them and the request echoes
    the prompt: the first prompt token has none."""
    if c.prompt_logprobs is None or not echo:
        return list(c.token_ids), list(c.logprobs or [])
    ids, lps = c.prompt_logprobs
    return ids + list(c.token_ids), [Logprob(None, [], [])] + lps + list(c.logprobs or [])


async def _collect(gen: AsyncIterator[StreamChunk], n: int, echo: bool = False
                   ) -> tuple[list[str], list[str | None], StreamChunk, list[_Tokens] | None, list[_Tokens] | None]:
    """A whole answer: each choice's text, finish reason and log-probabilities (after the prompt's with `echo`),
    the last chunk (usage), and each choice's prompt ids and log-probabilities when they came."""
    # Nothing sized by n before the frontend has validated it (a client may send n = 10**12).
    texts: dict[int, str] = defaultdict(str)
    reasons: dict[int, str | None] = {}
    tokens: dict[int, _Tokens] = defaultdict(lambda: ([], []))
    prompts: dict[int, _Tokens] = {}
    last = None
    async for chunk in gen:
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
            if c.prompt_logprobs is not None:
                prompts.setdefault(c.index, c.prompt_logprobs)
            if c.logprobs is not None:
                ids, lps = with_prompt(c, echo)
                tokens[c.index][0].extend(ids)
                tokens[c.index][1].extend(lps)
        last = chunk
    if last is None:
        raise PeerUnavailable("the generation ended without an answer")
    return ([texts[i] for i in range(n)], [reasons.get(i) for i in range(n)], last,
            [tokens[i] for i in range(n)] if tokens else None,
            [prompts.get(i) for i in range(n)] if prompts else None)


async def merge_prompts(gens: list[AsyncGenerator[StreamChunk, None]], n: int) -> AsyncGenerator[StreamChunk, None]:
    """The streams of several prompts (n choices each) as one: prompt p's choice j becomes choice p * n + j, the
    usage adds up, and the last chunk (done) comes when every prompt is done. Closing it closes them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, gen: AsyncGenerator[StreamChunk, None]) -> None:
        try:
            async for chunk in gen:
                await queue.put((p, chunk))
            await queue.put((p, None))
        except Exception as e:                          # handed to the reader, which raises it
            await queue.put((p, e))

    tasks = [asyncio.create_task(pump(p, g)) for p, g in enumerate(gens)]
    last: dict[int, StreamChunk] = {}
    try:
        running = len(gens)
        while running:
            p, chunk = await queue.get()
            if chunk is None:
                running -= 1
                continue
            if isinstance(chunk, Exception):
                raise chunk
            last[p] = chunk
            done = len(last) == len(gens) and all(c.done for c in last.values())
            yield StreamChunk([ChoiceDelta(p * n + c.index, c.text, c.token_ids, c.finish_reason, c.logprobs,
                                           c.prompt_logprobs)
                               for c in chunk.choices],
                              sum(c.prompt_tokens for c in last.values()),
                              sum(c.completion_tokens for c in last.values()),
                              sum(c.cached_tokens for c in last.values()), done,
                              sum(c.draft_tokens for c in last.values()),
                              sum(c.accepted_tokens for c in last.values()))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
