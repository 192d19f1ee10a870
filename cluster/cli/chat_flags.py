"""`pdserve serve`'s chat flags, by vLLM's names: which format tool calls and reasoning are
read in (router/chat) and whether `tool_choice: auto` may read calls."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    add_generation_config_argument(p)
    chat = p.add_argument_group("chat (OpenAI tools and reasoning)")
    chat.add_argument(
        "--tool-call-parser",
        default="",
        metavar="NAME",
        help="format the model writes tool calls in: hermes, qwen3_coder, llama3_json, mistral",
    )
    chat.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let `tool_choice: auto` (the default with tools) read calls with that parser",
    )
    chat.add_argument(
        "--reasoning-parser",
        default="",
        metavar="NAME",
        help="split <think> reasoning into reasoning_content: qwen3, deepseek_r1",
    )
    chat.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="a Jinja chat template to use instead of the model's (default: the model's)",
    )
    chat.add_argument(
        "--default-chat-template-kwargs",
        default="",
        metavar="JSON",
        help="template variables for every request that does not set them, e.g. "
        "'{\"enable_thinking\": false}'",
    )


def add_generation_config_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="sampling defaults for requests that leave them unset: the checkpoint's "
        "generation_config.json (auto), none (vllm), or that directory's",
    )


def chat_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The `AppConfig` fields the flags set."""
    return {
        "tool_call_parser": args.tool_call_parser,
        "enable_auto_tool_choice": args.enable_auto_tool_choice,
        "reasoning_parser": args.reasoning_parser,
        "chat_template": args.chat_template.read_text() if args.chat_template else "",
        "default_chat_template_kwargs": args.default_chat_template_kwargs,
        "generation_config": args.generation_config,
    }
