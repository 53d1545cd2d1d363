"""Chat conversations -> token ids with an assistant-only loss mask, through a Jinja2 chat template.

A conversation is a non-empty list of ``{"role": str, "content": str}`` messages, each role one of
:data:`CHAT_ROLES` (anything else is refused, naming where); a message may also carry ``reasoning_content`` (a
string) and ``tool_calls`` (a list of objects; ``content`` may then be null). ``chat_template`` is Jinja text, or
``"deepseek_v4"`` for DeepSeek-V4's own encoding rules (:mod:`dsv4.data.deepseek_v4_chat`, which writes the
segments directly).

**Rendering** (:func:`render_chat`) is Hugging Face's: with transformers installed the template is rendered by
``transformers.utils.chat_template_utils.render_jinja_template``, the function behind ``apply_chat_template``, with
the messages as ``apply_chat_template`` passes them (keys whose value is None dropped) and the tokenizer's
``bos_token`` / ``eos_token`` / ... as variables. Without transformers (one INFO line says so) it is rendered in an
environment of this module with the same extensions and names: sandboxed Jinja2 with ``trim_blocks`` and
``lstrip_blocks``, ``{% break %}`` / ``{% continue %}``, ``{% generation %}`` blocks (rendered as their body), the
``tojson`` filter without HTML escaping (``ensure_ascii=False`` and ``indent`` / ``separators`` / ``sort_keys``),
``raise_exception(message)``, ``strftime_now(format)``, ``tools`` / ``documents`` set to none and an assistant's
``reasoning_content`` also readable as ``thinking``. Both give the same text.

**Supervised characters** are found by rendering growing prefixes of the conversation, so any template works as
long as it is *prefix-stable* (rendering ``messages[:k+1]`` starts with the rendering of ``messages[:k]``; a
ValueError names the turn otherwise):

* turn k's text is ``render(messages[:k+1])[len(render(messages[:k])):]``;
* for an assistant turn, the part up to ``render(messages[:k], add_generation_prompt=True)`` is the role header
  (not supervised); the rest (content and end-of-turn marker) is supervised, so the model learns to stop.
  Templates without a generation prompt supervise the whole assistant turn.

**Tokens** (:func:`tokenize_chat`): the whole rendering is tokenized once, so the ids trained on are exactly
``tokenizer.encode(render(messages))``, what the model reads at inference (a BPE merges across turn boundaries;
tokenizing turn by turn would train on other ids). The loss mask comes from the character offsets of the tokens:
token j is supervised iff at least one of its characters lies in a supervised span (:func:`assistant_token_mask`,
the rule of transformers' ``return_assistant_tokens_mask``). A token that straddles a span boundary (a merge of a
role header's last character with the reply's first, or of a reply's end marker with the next turn's start) is
therefore supervised: every character of every reply is inside some supervised token, so no reply loses its first
or last token, and a straddling token carries the few header characters it merged with. Role markers that are special
tokens of the tokenizer are never merged, so with a model's own tokenizer and template the supervised tokens are
exactly the reply's. A token without characters (a special token the tokenizer adds) is supervised only when it
lies strictly inside a span. With :class:`~dsv4.data.tokenizers.ByteTokenizer` decoding the supervised tokens
gives back the assistant replies (plus their end markers) verbatim.
"""

from __future__ import annotations

import bisect
import difflib
import json
import logging
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable, Sequence

from dsv4.data.deepseek_v4_chat import FORMAT_NAME as DEEPSEEK_V4_FORMAT
from dsv4.data.deepseek_v4_chat import deepseek_v4_segments
from dsv4.data.tokenizers import Tokenizer

log = logging.getLogger("dsv4")

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

_logged_fallback = False


# ---------------------------------------------------------------------------------------------- environment


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """JSON as Hugging Face chat templates expect it: no HTML escaping, keys in their order unless asked."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment() -> Any:
    """The sandboxed Jinja2 environment with the extensions, filters and globals of Hugging Face chat templates."""
    try:
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # jinja2 ships with torch; this only fires on unusual installs
        raise ImportError("chat data needs jinja2: pip install jinja2") from exc

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body (it marks assistant text for transformers'
        ``return_assistant_tokens_mask``; here the supervised text is found by prefix rendering)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    """``template`` compiled in :func:`_environment` (None for ``deepseek_v4``); ValueError if it does not compile."""
    if template == DEEPSEEK_V4_FORMAT:
        return None  # built-in encoding rules, nothing to compile
    from jinja2 import TemplateError

    try:
        return _environment().from_string(template)
    except TemplateError as exc:
        raise ValueError(f"chat template does not compile: {exc}") from exc


def _transformers_renderer() -> Callable[..., Any] | None:
    """transformers' ``render_jinja_template``, or None (logged once) when transformers cannot be imported."""
    global _logged_fallback
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError as exc:
        if not _logged_fallback:
            _logged_fallback = True
            log.info("chat templates render in dsv4's Jinja environment (the extensions and filters of Hugging Face "
                     "chat templates): transformers cannot be imported (%s)", exc)
        return None
    return render_jinja_template


def _with_reasoning_alias(message: dict) -> dict:
    """An assistant's reasoning also under ``thinking`` (the name some templates read), as transformers passes it."""
    reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning") if message.get(k) is not None),
                     None)
    if reasoning is None:
        return message
    aliased = {"thinking": reasoning}
    aliased.update(message)
    aliased["reasoning_content"] = reasoning
    return aliased


def _render(template: str, messages: Sequence[dict], add_generation_prompt: bool, where: str, extra: dict) -> str:
    compiled = _compile(template)  # a template that does not compile is refused the same way on both paths
    plain = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as apply_chat_template passes them
    render = _transformers_renderer()
    try:
        if render is not None:
            rendered, _ = render(conversations=[plain], chat_template=template,
                                 add_generation_prompt=add_generation_prompt, **extra)
            return rendered[0]
        return compiled.render(messages=[_with_reasoning_alias(m) for m in plain], tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **extra)
    except Exception as exc:  # raise_exception's TemplateError, jinja2 UndefinedError, TypeError inside the template
        raise ValueError(f"{where}: rendering the chat template failed: {type(exc).__name__}: {exc}") from exc


def render_chat(
    messages: Sequence[dict],
    chat_template: str | None = None,
    *,
    add_generation_prompt: bool = False,
    where: str = "<messages>",
    template_vars: dict | None = None,
) -> str:
    """The conversation rendered by ``chat_template`` (default :data:`DEFAULT_CHAT_TEMPLATE`) as Hugging Face's
    ``apply_chat_template(..., tokenize=False)`` renders it (module docstring), ``template_vars`` (``bos_token``,
    ``eos_token``, ...) as template variables. ``deepseek_v4``: the text of its segments (which already end with the
    generation opener when the conversation ends with a user turn; ``add_generation_prompt`` is ignored)."""
    validate_messages(list(messages), where)
    if chat_template == DEEPSEEK_V4_FORMAT:
        return "".join(text for text, _ in deepseek_v4_segments(messages, where=where))
    return _render(chat_template or DEFAULT_CHAT_TEMPLATE, messages, add_generation_prompt, where,
                   dict(template_vars or {}))


# ------------------------------------------------------------------------------------------------- messages


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


def chat_segments(
    messages: Sequence[dict],
    chat_template: str | None = None,
    *,
    where: str = "<messages>",
    template_vars: dict | None = None,
) -> list[tuple[str, bool]]:
    """The rendered conversation as ``(text, supervised)`` segments whose concatenation is the full rendering
    (:func:`render_chat`); the supervised ones are the assistant turns (module docstring)."""
    validate_messages(list(messages), where)
    if chat_template == DEEPSEEK_V4_FORMAT:
        return deepseek_v4_segments(messages, where=where)
    template = chat_template or DEFAULT_CHAT_TEMPLATE
    extra = dict(template_vars or {})
    try:
        prev = _render(template, [], False, where, extra)
    except ValueError:
        _compile(template)  # a template that does not compile is refused as such
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


# --------------------------------------------------------------------------------------------------- tokens


def supervised_spans(segments: Sequence[tuple[str, bool]]) -> list[tuple[int, int]]:
    """The ``[start, end)`` character spans of the supervised segments in their concatenation, adjacent ones
    joined; sorted and disjoint."""
    spans: list[tuple[int, int]] = []
    pos = 0
    for text, supervised in segments:
        if supervised and text:
            if spans and spans[-1][1] == pos:
                spans[-1] = (spans[-1][0], pos + len(text))
            else:
                spans.append((pos, pos + len(text)))
        pos += len(text)
    return spans


def assistant_token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """``mask[j]`` = token j, with character offsets ``offsets[j] = (start, end)``, overlaps one of the sorted,
    disjoint ``spans``: ``start < span_end and end > span_start`` (a straddling token is supervised; a token
    without characters only strictly inside a span)."""
    starts = [s for s, _ in spans]
    mask = []
    for start, end in offsets:
        k = bisect.bisect_left(starts, end) - 1  # the last span starting before the token ends
        mask.append(k >= 0 and start < spans[k][1])
    return mask


def encode_with_offsets(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """``tokenizer.encode(text)`` and each token's ``(start, end)`` character offsets in ``text``; ValueError for a
    tokenizer that cannot report offsets."""
    encode = getattr(tokenizer, "encode_with_offsets", None)
    if encode is None:
        raise ValueError(f"chat data needs token offsets: tokenizer {tokenizer!r} has no "
                         "encode_with_offsets(text) -> (ids, offsets); use 'byte', a Hugging Face tokenizer, or add it")
    ids, offsets = encode(text)
    if len(ids) != len(offsets):
        raise ValueError(f"tokenizer {tokenizer!r}: encode_with_offsets gave {len(ids)} ids but {len(offsets)} offsets")
    return [int(i) for i in ids], [(int(s), int(e)) for s, e in offsets]


def tokenize_chat(
    messages: Sequence[dict],
    tokenizer: Tokenizer,
    chat_template: str | None = None,
    *,
    where: str = "<messages>",
    template_vars: dict | None = None,
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation, ``tokenizer.encode(render_chat(messages, ...))`` exactly, and the
    per-token loss mask (True = the token overlaps an assistant reply; module docstring)."""
    segments = chat_segments(messages, chat_template, where=where, template_vars=template_vars)
    ids, offsets = encode_with_offsets(tokenizer, "".join(text for text, _ in segments))
    return ids, assistant_token_mask(offsets, supervised_spans(segments))
