"""Chat conversations -> token ids with an assistant-only loss mask, through a Jinja2 chat template.

A conversation is a non-empty list of ``{"role": str, "content": str}`` messages, each role one of
:data:`CHAT_ROLES` (anything else is refused, naming where); a message may also carry ``reasoning_content`` (a
string) and ``tool_calls`` (a list of objects; ``content`` may then be null). ``chat_template`` is Jinja text, or
``"deepseek_v4"`` for DeepSeek-V4's own encoding rules (:mod:`dsv4.data.deepseek_v4_chat`, which writes the
segments directly). The template is rendered the way
Hugging Face chat templates are (sandboxed Jinja2, ``trim_blocks`` and ``lstrip_blocks``, variables ``messages``
and ``add_generation_prompt``, plus a ``raise_exception`` helper).

Which characters are supervised is found by rendering growing prefixes of the conversation, so any template works
as long as it is *prefix-stable* (rendering ``messages[:k+1]`` starts with the rendering of ``messages[:k]``; a
ValueError names the turn otherwise):

* turn k's text is ``render(messages[:k+1])[len(render(messages[:k])):]``;
* for an assistant turn, the part up to ``render(messages[:k], add_generation_prompt=True)`` is the role header
  (not supervised); the rest (content and end-of-turn marker) is supervised, so the model learns to stop.
  Templates without a generation prompt supervise the whole assistant turn.

Every segment is tokenized separately and the ids are concatenated, so ``loss_mask[j]`` is exactly "token j lies
in an assistant reply". With :class:`~dsv4.data.tokenizers.ByteTokenizer` decoding the supervised tokens gives
back the assistant replies (plus their end markers) verbatim.
"""

from __future__ import annotations

import difflib
from functools import lru_cache
from typing import Any, Sequence

from dsv4.data.deepseek_v4_chat import FORMAT_NAME as DEEPSEEK_V4_FORMAT
from dsv4.data.deepseek_v4_chat import deepseek_v4_segments
from dsv4.data.tokenizers import Tokenizer


ASSISTANT_ROLE = "assistant"

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
"""Roles a message may have. Any other role is refused (naming the line): a misspelt ``asistant`` would otherwise
render as some other speaker and silently never be trained on."""

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Role markers around every message: ``<|user|>\\nHi<|end|>\\n<|assistant|>\\nHello<|end|>\\n``."""


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template raised: {message}")


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    if template == DEEPSEEK_V4_FORMAT:
        return None  # built-in encoding rules, nothing to compile
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # jinja2 ships with torch; this only fires on unusual installs
        raise ImportError("chat data needs jinja2: pip install jinja2") from exc
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise ValueError(f"chat template does not compile: {exc}") from exc


def validate_messages(messages: Any, where: str) -> list[dict]:
    """Check ``messages`` is a non-empty list of ``{role: str, content: str}``; ValueError/KeyError naming ``where``."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects, got "
                         f"{type(messages).__name__} {messages!r:.80}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: messages[{i}] must be an object, got {type(message).__name__}")
        calls = message.get("tool_calls")
        for key in ("role", "content"):
            if key not in message and not (key == "content" and calls):
                raise KeyError(f"{where}: messages[{i}] has no `{key}` field (keys: {sorted(message)})")
            if key == "content" and message.get(key) is None and calls:
                continue  # an assistant turn that only calls tools
            if not isinstance(message[key], str):
                raise ValueError(f"{where}: messages[{i}].{key} must be a string, got {type(message[key]).__name__}")
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"{where}: messages[{i}].reasoning_content must be a string, got "
                             f"{type(reasoning).__name__}")
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
            raise ValueError(f"{where}: messages[{i}].tool_calls must be a list of objects, got {calls!r:.80}")
        if message["role"] not in CHAT_ROLES:
            close = difflib.get_close_matches(message["role"], CHAT_ROLES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{where}: messages[{i}].role={message['role']!r} is not a chat role (one of "
                             f"{', '.join(CHAT_ROLES)}){hint}")
    return messages


def _render(template: Any, messages: Sequence[dict], add_generation_prompt: bool, where: str, extra: dict) -> str:
    try:
        return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **extra)
    except ValueError:
        raise
    except Exception as exc:  # jinja2 UndefinedError, TypeError inside the template, ...
        raise ValueError(f"{where}: rendering the chat template failed: {type(exc).__name__}: {exc}") from exc


def chat_segments(
    messages: Sequence[dict],
    chat_template: str | None = None,
    *,
    where: str = "<messages>",
    template_vars: dict | None = None,
) -> list[tuple[str, bool]]:
    """The rendered conversation as ``(text, supervised)`` segments whose concatenation is the full rendering."""
    validate_messages(list(messages), where)
    if chat_template == DEEPSEEK_V4_FORMAT:
        return deepseek_v4_segments(messages, where=where)
    template = _compile(chat_template or DEFAULT_CHAT_TEMPLATE)
    extra = dict(template_vars or {})
    try:
        prev = _render(template, [], False, where, extra)
    except ValueError:
        prev = ""  # some templates refuse an empty conversation; then nothing precedes the first turn
    segments: list[tuple[str, bool]] = [(prev, False)]
    for k, message in enumerate(messages):
        full = _render(template, messages[: k + 1], False, where, extra)
        if not full.startswith(prev):
            raise ValueError(
                f"{where}: the chat template is not prefix-stable at messages[{k}] (the rendering of "
                f"messages[:{k + 1}] does not start with that of messages[:{k}]); assistant-only loss masking needs "
                "a prefix-stable template"
            )
        if message["role"] == ASSISTANT_ROLE:
            head = _render(template, messages[:k], True, where, extra)
            if head.startswith(prev) and full.startswith(head) and len(head) > len(prev):
                segments.append((head[len(prev):], False))
                segments.append((full[len(head):], True))
            else:
                segments.append((full[len(prev):], True))
        else:
            segments.append((full[len(prev):], False))
        prev = full
    return [(text, supervised) for text, supervised in segments if text]


def tokenize_chat(
    messages: Sequence[dict],
    tokenizer: Tokenizer,
    chat_template: str | None = None,
    *,
    where: str = "<messages>",
    template_vars: dict | None = None,
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and the per-token loss mask (True = assistant reply token)."""
    ids: list[int] = []
    mask: list[bool] = []
    for text, supervised in chat_segments(messages, chat_template, where=where, template_vars=template_vars):
        piece = tokenizer.encode(text)
        ids.extend(piece)
        mask.extend([supervised] * len(piece))
    return ids, mask
