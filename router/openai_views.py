"""The OpenAI response objects of one request's choices: whole responses and stream chunks, built
from the router's `GenerationChunk`s, with logprobs in the completions or the chat shape. A
request with `n` choices has a view per choice (each keeps its own stream state), and
`merged` joins their whole responses into one."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from cluster.request import TokenLogprobs
from router.chat.chat_plan import ChatOptions, ChatPlan
from router.generation_chunk import GenerationChunk, Usage
from router.openai_protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    FunctionCall,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)

Scored = list[tuple[int, TokenLogprobs]]  # generated tokens with their logprobs


class _View:
    """What both views share: the request's id, creation time, model, token texts, and the
    index of the choice the view writes."""

    chunk_type: type[CompletionResponse] | type[ChatCompletionChunk]

    def __init__(
        self, id: str, created: int, model: str, token_text: Callable[[int], str], index: int = 0
    ):
        self.id, self.created, self.model = id, created, model
        self.token_text = token_text
        self.index = index

    def usage_chunk(self, usage: Usage):
        """The extra last stream chunk of `stream_options.include_usage`: usage, no choices."""
        return self.chunk_type(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=UsageInfo.of(usage),
        )


def merged(responses: list, usage: Usage):
    """One response from the whole responses of a request's choices (in index order), with
    the request's usage (`fan_out.total_usage`); the timing is choice 0's."""
    choices = [c for r in responses for c in r.choices]
    return responses[0].model_copy(update={"choices": choices, "usage": UsageInfo.of(usage)})


class CompletionView(_View):
    """One completion request's `text_completion` objects."""

    chunk_type = CompletionResponse

    def __init__(
        self, id: str, created: int, model: str, token_text: Callable[[int], str], index: int = 0
    ):
        super().__init__(id, created, model, token_text, index)
        self.offset = 0  # text_offset of the next token's logprobs entry

    def response(self, text: str, last: GenerationChunk, scored: Scored) -> CompletionResponse:
        return self._object(text, last, self._logprobs(scored), usage=UsageInfo.of(last.usage))

    def chunks(self, chunk: GenerationChunk, is_first: bool) -> Iterator[CompletionResponse]:
        if chunk.text or chunk.logprobs or chunk.finish_reason is not None:
            yield self._object(chunk.text, chunk, self._logprobs(chunk.scored()))

    def _logprobs(self, scored: Scored) -> CompletionLogprobs | None:
        if not scored:
            return None
        tokens = [self.token_text(t) for t, _ in scored]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[lp.logprob for _, lp in scored],
            top_logprobs=[{self.token_text(t): v for t, v in lp.top} for _, lp in scored],
            text_offset=offsets,
        )

    def _object(
        self,
        text: str,
        chunk: GenerationChunk,
        logprobs: CompletionLogprobs | None,
        usage: UsageInfo | None = None,
    ) -> CompletionResponse:
        choice = CompletionChoice(
            index=self.index, text=text, logprobs=logprobs, finish_reason=chunk.finish_reason
        )
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=usage,
            pdserve_timing=chunk.timing,
        )


class ChatView(_View):
    """One chat request's `chat.completion` and `chat.completion.chunk` objects; its `plan`
    splits the text into reasoning, content and tool calls (router/chat)."""

    chunk_type = ChatCompletionChunk

    def __init__(
        self,
        id: str,
        created: int,
        model: str,
        token_text: Callable[[int], str],
        plan: ChatPlan | None = None,
        index: int = 0,
    ):
        super().__init__(id, created, model, token_text, index)
        self.plan = plan or ChatPlan(ChatOptions(), None, None)
        self.stream = self.plan.stream()

    def response(self, text: str, last: GenerationChunk, scored: Scored) -> ChatCompletionResponse:
        answer = self.plan.answer(text)
        calls = [_call_out(c.id, c.name, c.arguments) for c in answer.tool_calls]
        content = answer.content if calls else answer.content or ""
        message = AssistantMessage(
            content=content, reasoning_content=answer.reasoning, tool_calls=calls or None
        )
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[
                ChatCompletionChoice(
                    index=self.index,
                    message=message,
                    logprobs=self._logprobs(scored),
                    finish_reason=_reason(last.finish_reason, bool(calls)),
                )
            ],
            usage=UsageInfo.of(last.usage),
            pdserve_timing=last.timing,
        )

    def chunks(self, chunk: GenerationChunk, is_first: bool) -> Iterator[ChatCompletionChunk]:
        # The first chunk names the role (with whatever content it has); later ones carry text.
        reasoning, content, deltas = self.stream.feed(chunk.text)
        if chunk.finish_reason is not None:
            more = self.stream.finish()
            reasoning, content, deltas = reasoning + more[0], content + more[1], deltas + more[2]
        news = reasoning or content or deltas or chunk.logprobs
        if is_first or news or chunk.finish_reason is not None:
            calls = [_call_out(d.id, d.name, d.arguments, d.index) for d in deltas]
            delta = DeltaMessage(
                role="assistant" if is_first else None,
                content=content if content or (is_first and not reasoning) else None,
                reasoning_content=reasoning or None,
                tool_calls=calls or None,
            )
            called = bool(self.stream.calls)
            choice = ChatCompletionChunkChoice(
                index=self.index,
                delta=delta,
                logprobs=self._logprobs(chunk.scored()),
                finish_reason=_reason(chunk.finish_reason, called),
            )
            yield ChatCompletionChunk(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=[choice],
                pdserve_timing=chunk.timing,
            )

    def _logprobs(self, scored: Scored) -> ChatLogprobs | None:
        if not scored:
            return None
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    **self._top(token, lp.logprob).model_dump(),
                    top_logprobs=[self._top(t, v) for t, v in lp.top],
                )
                for token, lp in scored
            ]
        )

    def _top(self, token: int, logprob: float) -> TopLogprob:
        text = self.token_text(token)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def _call_out(id: str | None, name: str | None, arguments: str, index: int | None = None):
    """A call as OpenAI writes it; in a stream the first piece has id, type and name."""
    return ToolCallOut(
        index=index,
        id=id or None,
        type="function" if name is not None else None,
        function=FunctionCall(name=name, arguments=arguments),
    )


def _reason(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's `tool_calls` for an answer that ended by calling tools."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason
