"""Token masks that keep a constrained request's output inside its grammar (xgrammar).

xgrammar was kept over llguidance by a CPU measurement: filling one row's mask for a JSON
schema cost it a fraction of llguidance's at both vocabulary sizes tried, and the mask is paid
every step, the compile once (docs/findings.md, structured output).

One `GrammarCompiler` per engine (per tokenizer) compiles each distinct constraint; each
constrained sequence holds a `GrammarState`, a matcher fed every output token. The state never
crosses a process: a decode replica, or a replica a stream migrates to, rebuilds it by replaying
the sequence's output tokens (`GrammarCompiler.state(..., replay=...)`), so it travels with the
request as its tokens do. Per step, `apply_masks` fills one bitmask row per constrained row on
the host and applies them all to the logits at once (one upload on a GPU, no per-row sync).

JSON is written compactly (no free whitespace between tokens): a model may otherwise fill its
token budget with blanks, as random-weight test models do.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from cluster.errors import InvalidArgument
from cluster.structured_output import StructuredOutput

PARAM = "structured_outputs"


def _xgr() -> Any:
    """xgrammar, imported on first use: an engine that serves no constrained request (and the
    GPU check's bare image) does not need it."""
    import xgrammar

    return xgrammar


def _ebnf_choice(options: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(o) for o in options)


def check(so: StructuredOutput) -> None:
    """Whether the constraint's text is a valid schema, regex or grammar, without a tokenizer:
    the router calls it so that a bad constraint is a 400 before any worker is touched."""
    xgr = _xgr()
    try:
        if so.kind == "json_schema":
            xgr.Grammar.from_json_schema(so.spec, any_whitespace=False)
        elif so.kind == "regex":
            xgr.Grammar.from_regex(so.spec)
        elif so.kind == "grammar":
            xgr.Grammar.from_ebnf(so.spec)
        elif so.kind == "choice":
            xgr.Grammar.from_ebnf(_ebnf_choice(json.loads(so.spec)))
    except (RuntimeError, ValueError) as e:
        raise InvalidArgument(f"invalid {so.kind}: {e}", param=PARAM) from None


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def advance(self, token: int) -> bool:
        """Feed one output token; False if the grammar refuses it (a masked row never samples
        one, so False means the mask was not applied: a bug, not a user error)."""
        return bool(self.matcher.accept_token(token))

    @property
    def done(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return bool(self.matcher.is_terminated())


class GrammarCompiler:
    """Compiles constraints for one tokenizer. `stop_token_ids` end a complete output."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        xgr = _xgr()
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def state(self, so: StructuredOutput, replay: Sequence[int] = ()) -> GrammarState:
        """A fresh state for `so`, advanced over `replay` (the output tokens so far)."""
        state = GrammarState(_xgr().GrammarMatcher(self._compile(so)))
        for token in replay:
            if not state.advance(token):
                raise InvalidArgument(
                    f"the output so far does not match the {so.kind} constraint", param=PARAM
                )
        return state

    def _compile(self, so: StructuredOutput) -> Any:
        c = self._compiler
        try:
            if so.kind == "json_schema":
                return c.compile_json_schema(so.spec, any_whitespace=False)
            if so.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if so.kind == "regex":
                return c.compile_regex(so.spec)
            if so.kind == "choice":
                return c.compile_grammar(_ebnf_choice(json.loads(so.spec)))
            return c.compile_grammar(so.spec)
        except (RuntimeError, ValueError) as e:
            raise InvalidArgument(f"invalid {so.kind}: {e}", param=PARAM) from None


def apply_masks(
    logits: torch.Tensor,  # [R, vocab] float32, changed in place
    states: Sequence[GrammarState | None],  # per row; None: unconstrained
) -> None:
    """Set to -inf every token a row's grammar does not allow next, for all rows at once."""
    rows = [r for r, s in enumerate(states) if s is not None]
    if not rows:
        return
    xgr = _xgr()
    vocab = logits.shape[-1]
    mask = xgr.allocate_token_bitmask(len(rows), vocab)  # int32 [R', ceil(vocab / 32)]
    for i, r in enumerate(rows):
        states[r].matcher.fill_next_token_bitmask(mask, i)
    full = mask.new_full((len(states), mask.shape[1]), -1)  # -1: every bit set, all allowed
    full[rows] = mask
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True))
