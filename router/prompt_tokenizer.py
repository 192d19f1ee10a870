"""`PromptTokenizer`: a client's text (a prompt, chat messages) to token ids, bounded before any
tokenizer work and never holding up the router's event loop for long.

What it refuses, with INVALID_ARGUMENT naming the field, before the tokenizer sees the text:
- text that is not valid Unicode (a lone surrogate, which JSON can escape): it has no UTF-8;
- a prompt of more than `max_prompt_bytes` = `max_model_len * MAX_BYTES_PER_TOKEN` bytes of
  UTF-8. No vocabulary in use averages that many bytes a token over a whole context, so such a
  prompt could not fit anyway; refusing it on its size costs nothing, tokenizing it first
  cost seconds of the router's loop;
- chat: more than `MAX_CHAT_MESSAGES` messages, or message contents of more than
  `max_prompt_bytes` together; the rendered chat is then bounded like a prompt.

Text of up to `INLINE_BYTES` is tokenized on the loop (a thread hop would cost more than the
work); longer text, and chats of many messages, on a small thread pool of its own: the Rust
tokenizer lets the GIL go while it encodes, so the loop keeps streaming other requests' tokens.
The tokenizer is only read (encode, decode, chat template), never reconfigured, so the pool's
threads and the loop may use it at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cluster.errors import InvalidArgument

T = TypeVar("T")

MAX_BYTES_PER_TOKEN = 16
INLINE_BYTES = 4096
MAX_CHAT_MESSAGES = 4096
TOKENIZER_THREADS = 2


# Names the chat template call sets itself: a request's `chat_template_kwargs` may not.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "chat_template",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "documents",
        "tokenizer",
    }
)


@dataclass(frozen=True)
class TemplateCall:
    """How one request renders its chat: extra template variables (`chat_template_kwargs`,
    over the server's defaults, e.g. Qwen3's `enable_thinking`), whether to open the
    assistant's turn, or to continue its last message instead; `template` is the server's
    own template text (`--chat-template`), "" for the model's."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template: str = ""

    def __post_init__(self) -> None:
        bad = sorted(set(self.kwargs) & RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise InvalidArgument(
                f"chat_template_kwargs may not set {bad}", param="chat_template_kwargs"
            )
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidArgument(
                "continue_final_message continues the last message: it needs "
                "add_generation_prompt false",
                param="continue_final_message",
            )


class PromptTokenizer:
    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        """`tokenizer`: a Hugging Face tokenizer, or None for a checkpoint without one (then
        only token ids are served)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_prompt_bytes = max_model_len * MAX_BYTES_PER_TOKEN
        self._pool: ThreadPoolExecutor | None = None

    async def encode(self, prompt: str, param: str = "prompt") -> list[int]:
        """The prompt's token ids (no special tokens added)."""
        if self.tokenizer is None:
            raise InvalidArgument("this model has no tokenizer: send prompt_token_ids", param)
        size = self._checked_size(prompt, param)
        if size > self.max_prompt_bytes:
            raise InvalidArgument(
                f"{param} is {size} bytes; this model's context of {self.max_model_len} tokens "
                f"takes at most {self.max_prompt_bytes} bytes of text "
                f"({MAX_BYTES_PER_TOKEN} a token)",
                param=param,
            )
        encode = self.tokenizer.encode
        if size <= INLINE_BYTES:
            return encode(prompt, add_special_tokens=False)
        return await self._off_loop(lambda: encode(prompt, add_special_tokens=False))

    async def chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        template: TemplateCall | None = None,
    ) -> list[int]:
        """Chat messages rendered with the chat template (the model's, or the server's
        `--chat-template`) as `template` asks, tokenized."""
        template = template or TemplateCall()
        own = self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None)
        if self.tokenizer is None or not (template.template or own):
            raise InvalidArgument(
                "this model has no chat template (a server takes one by --chat-template)",
                param="messages",
            )
        if len(messages) > MAX_CHAT_MESSAGES:
            raise InvalidArgument(
                f"at most {MAX_CHAT_MESSAGES} messages, got {len(messages)}", param="messages"
            )
        size = sum(self._checked_size(m["content"], "messages") for m in messages)
        if tools:
            size += self._checked_size(json.dumps(tools), "tools")
        size += self._checked_size(json.dumps(template.kwargs), "chat_template_kwargs")
        if size > self.max_prompt_bytes:
            raise InvalidArgument(
                f"the messages' contents are {size} bytes; this model's context of "
                f"{self.max_model_len} tokens takes at most {self.max_prompt_bytes} bytes of "
                f"text ({MAX_BYTES_PER_TOKEN} a token)",
                param="messages",
            )

        def render() -> str:
            try:
                return self.tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    chat_template=template.template or None,
                    tokenize=False,
                    add_generation_prompt=template.add_generation_prompt,
                    continue_final_message=template.continue_final_message,
                    **template.kwargs,
                )
            except Exception as e:  # a template error is the caller's malformed messages
                raise InvalidArgument(f"cannot render messages: {e}", param="messages") from e

        inline = size <= INLINE_BYTES and len(messages) <= 64
        text = render() if inline else await self._off_loop(render)
        return await self.encode(text, param="messages")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _checked_size(text: str, param: str) -> int:
        """`text`'s size in UTF-8; text with no UTF-8 (a lone surrogate) is refused."""
        try:
            return len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise InvalidArgument(
                f"{param} is not valid Unicode: {e.reason} at character {e.start}", param=param
            ) from None

    async def _off_loop(self, work: Callable[[], T]) -> T:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, "pdserve-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)
