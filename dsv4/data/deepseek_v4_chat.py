"""DeepSeek-V4's chat encoding, as ``(text, supervised)`` segments for assistant-only loss masking.

Source of the facts: the DeepSeek-V4 release on Hugging Face (``deepseek-ai/DeepSeek-V4-Flash`` /
``deepseek-ai/DeepSeek-V4-Pro``). Its README states that the release ships no Jinja chat template in
``tokenizer_config.json`` but an ``encoding/`` folder whose ``encoding_dsv4.py`` encodes OpenAI-style messages
into the model's input text. The rules implemented here (written for this package, not copied) are:

* the conversation starts with ``<｜begin▁of▁sentence｜>``;
* a ``system`` message is its content, without a role marker;
* a ``user`` (or ``developer``) message is ``<｜User｜>`` + content. ``tool`` messages carry no role marker of
  their own: consecutive ``user`` / ``tool`` messages form one user turn whose parts are joined by a blank line
  (``"\\n\\n"``), a tool result written as ``<tool_result>content</tool_result>``;
* a user turn that an assistant reply follows (or that ends the conversation) is closed by ``<｜Assistant｜>``
  and then ``<think>`` in thinking mode, ``</think>`` in chat mode (no reasoning follows);
* an assistant message is ``[reasoning_content + "</think>"] + content + [tool calls] +
  "<｜end▁of▁sentence｜>"``; the reasoning part only in thinking mode. Tool calls (OpenAI format,
  ``{"type": "function", "function": {"name", "arguments"}}`` with ``arguments`` a JSON object string) are
  ``"\\n\\n<｜DSML｜tool_calls>\\n" + invokes joined by "\\n" + "\\n</｜DSML｜tool_calls>"``, each invoke
  ``<｜DSML｜invoke name="NAME">\\n`` + parameters joined by ``"\\n"`` + ``\\n</｜DSML｜invoke>``, each parameter
  ``<｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>`` for a string value (written as is) and
  ``string="false"`` with the value in JSON otherwise (``arguments`` that is not a JSON object becomes one string
  parameter named ``arguments``).

Thinking mode is chosen per conversation: a conversation in which some assistant message has a
``reasoning_content`` renders in thinking mode with the reasoning of **every** assistant turn kept (the reference
encoder's ``drop_thinking=False``; at inference it drops the reasoning of turns before the last user message, which
would leave the earlier turns without the reasoning the data holds). Any other conversation renders in chat mode.
Under these rules the rendering is prefix-stable.

Supervised (``True``) is exactly the text of every assistant message: its reasoning, ``</think>``, content, tool
calls and ``<｜end▁of▁sentence｜>``, so the model learns to reason, answer, call tools and stop. The
``<｜Assistant｜><think>`` opener belongs to the prompt, as it does when the model generates. Tool schemas
(``tools`` on a system message) are not rendered: a message carrying ``tools`` is refused, naming it.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END)
"""Tokens the encoding needs as single ids of the tokenizer (checked at start-up)."""

FORMAT_NAME = "deepseek_v4"
"""The value of ``chat_template`` (and of ``data.chat_template_file``) that selects this encoding."""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _tool_call_text(call: Any, where: str) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}: a tool call must be {{\"type\": \"function\", \"function\": {{\"name\": str, "
                         f"\"arguments\": str}}}}, got {call!r:.120}")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        values = parsed if isinstance(parsed, dict) else {"arguments": arguments}
    elif isinstance(arguments, dict):
        values = arguments
    else:
        raise ValueError(f"{where}: tool call `arguments` must be a JSON object string, got "
                         f"{type(arguments).__name__}")
    params = [f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
              f'{value if isinstance(value, str) else _json(value)}</{DSML}parameter>' for key, value in values.items()]
    return f'<{DSML}invoke name="{function["name"]}">\n' + "\n".join(params) + f"\n</{DSML}invoke>"


def _assistant_text(message: dict, thinking: bool, where: str) -> str:
    text = ""
    if thinking:
        text += (message.get("reasoning_content") or "") + THINK_END
    text += message.get("content") or ""
    calls = message.get("tool_calls")
    if calls:
        invokes = "\n".join(_tool_call_text(call, where) for call in calls)
        text += f"\n\n<{DSML}tool_calls>\n{invokes}\n</{DSML}tool_calls>"
    return text + EOS


def deepseek_v4_segments(messages: Sequence[dict], *, where: str = "<messages>") -> list[tuple[str, bool]]:
    """The conversation rendered by the DeepSeek-V4 rules (module docstring) as ``(text, supervised)`` segments;
    their concatenation is the whole rendering and the supervised ones are exactly the assistant messages."""
    thinking = any(m.get("role") == "assistant" and m.get("reasoning_content") for m in messages)
    segments: list[tuple[str, bool]] = [(BOS, False)]
    user_parts: list[str] = []

    def close_user(next_is_reply: bool) -> None:
        if not user_parts:
            return
        opener = (ASSISTANT + (THINK_START if thinking else THINK_END)) if next_is_reply else ""
        segments.append((USER + "\n\n".join(user_parts) + opener, False))
        user_parts.clear()

    for i, message in enumerate(messages):
        role = message["role"]
        if message.get("tools"):
            raise ValueError(f"{where}: messages[{i}] carries `tools`; the deepseek_v4 chat format does not render "
                             "tool schemas: write them into the system message's content")
        if role in ("user", "tool", "function", "ipython"):
            content = message.get("content") or ""
            user_parts.append(content if role == "user" else f"<tool_result>{content}</tool_result>")
        elif role == "developer":
            close_user(False)
            user_parts.append(message.get("content") or "")
            close_user(i + 1 == len(messages) or messages[i + 1]["role"] == "assistant")
        elif role == "system":
            close_user(False)
            segments.append((message.get("content") or "", False))
        else:  # assistant
            close_user(True)
            segments.append((_assistant_text(message, thinking, f"{where}: messages[{i}]"), True))
    close_user(True)  # a conversation ending with a user turn ends with the generation opener
    return [(text, supervised) for text, supervised in segments if text]
