"""The data group resolved against the model: which tokenizer and chat template a run uses, checked at start-up.

``data.tokenizer=auto`` (the default of every ``conf/data/*.yaml``) is the tokenizer of ``model.checkpoint`` when
that directory holds a ``tokenizer.json``, and the byte tokenizer without a ``model.checkpoint`` (the built-in tiny
model and corpus). A ``model.checkpoint`` without a ``tokenizer.json`` is refused (ValueError naming the directory and
the two choices, ``data.tokenizer=byte`` or a tokenizer path) rather than trained on bytes. Any other value is used
as given (``byte`` or a local tokenizer file / directory).

``data.chat_template_file=null`` is the tokenizer's own chat format: its Jinja template (``chat_template.jinja``
beside it, or ``tokenizer_config.json``'s ``chat_template``), else DeepSeek-V4's encoding rules
(:mod:`dsv4.data.deepseek_v4_chat`) when every special token they need is one id of the tokenizer (a DeepSeek-V4
release has no Jinja template), else the built-in role-marker template (:data:`dsv4.data.chat.DEFAULT_CHAT_TEMPLATE`;
one INFO line says it was chosen and why).
``deepseek_v4`` selects those encoding rules, any other value is a Jinja template file.

:func:`resolve_data_source` returns the keyword arguments of :func:`dsv4.data.build_documents` with ``tokenizer``
and ``chat_template`` resolved (so the run, its record and the prepared-data key name what is actually used) and
refuses, before any rank starts, a tokenizer with more ids than the model's embedding has rows, or one without a
special token the chat format writes (naming both sizes, or the missing tokens).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

from dsv4.data.chat import DEEPSEEK_V4_FORMAT, _compile
from dsv4.data.deepseek_v4_chat import SPECIAL_TOKENS as DEEPSEEK_V4_TOKENS
from dsv4.data.tokenizers import Tokenizer, build_tokenizer, single_id

log = logging.getLogger("dsv4")

TOKENIZER_AUTO = "auto"


def resolve_tokenizer_spec(spec: Any, checkpoint: str | None) -> Any:
    """``auto`` -> ``checkpoint`` when it holds a ``tokenizer.json``, ``byte`` without a checkpoint, and a ValueError
    naming ``checkpoint`` and the choices when it holds no tokenizer; anything else unchanged."""
    if spec != TOKENIZER_AUTO:
        return spec
    if not checkpoint:
        return "byte"
    if (Path(checkpoint) / "tokenizer.json").is_file():
        return str(checkpoint)
    raise ValueError(
        f"`data.tokenizer`=auto: `model.checkpoint`={str(checkpoint)!r} holds no tokenizer (no tokenizer.json in "
        "that directory); choose one: data.tokenizer=byte (UTF-8 bytes, 256 ids) or data.tokenizer=<path to a "
        "tokenizer.json or a tokenizer directory>")


def resolve_chat_template(tokenizer: Tokenizer, chat_template_file: str | None) -> str | None:
    """The chat template text (or ``"deepseek_v4"``) a run with ``tokenizer`` and ``data.chat_template_file`` uses;
    None = the built-in role-marker template (see the module docstring)."""
    if chat_template_file == DEEPSEEK_V4_FORMAT:
        return DEEPSEEK_V4_FORMAT
    if chat_template_file is not None:
        path = Path(chat_template_file)
        if not path.is_file():
            raise ValueError(f"`data.chat_template_file`={chat_template_file!r} is not a file (or deepseek_v4)")
        return path.read_text(encoding="utf-8")
    own = getattr(tokenizer, "chat_template", None)
    if own:
        return own
    if getattr(tokenizer, "vocab_size", 0) > len(DEEPSEEK_V4_TOKENS) and all(
            single_id(tokenizer, t) is not None for t in DEEPSEEK_V4_TOKENS):
        return DEEPSEEK_V4_FORMAT
    log.info("data: chat records (if any) render with the built-in role-marker template (<|user|>\\n...<|end|>): "
             "the tokenizer %r has no chat template and data.chat_template_file is not set", tokenizer)
    return None


def check_tokenizer(tokenizer: Tokenizer, chat_template: str | None, vocab_size: int, name: str) -> None:
    """ValueError naming both sizes when ``tokenizer`` has more ids than the embedding's ``vocab_size`` rows, or
    naming the special tokens the chat format writes that are not one id of the tokenizer."""
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"`data.tokenizer`={name!r} has {tokenizer.vocab_size} ids but the model's embedding has {vocab_size} "
            f"rows (model.vocab_size={vocab_size}); ids >= {vocab_size} would index past the embedding. Use the "
            "model's own tokenizer or a model with a larger vocabulary")
    if chat_template == DEEPSEEK_V4_FORMAT:
        required = DEEPSEEK_V4_TOKENS
    elif chat_template:
        vars_ = getattr(tokenizer, "template_vars", {}) or {}
        required = tuple(vars_[k] for k in ("bos_token", "eos_token") if k in vars_ and k in chat_template)
    else:
        required = ()
    missing = [t for t in required if single_id(tokenizer, t) is None]
    if missing:
        raise ValueError(
            f"`data.tokenizer`={name!r} lacks special tokens the chat template writes: {missing} (each must encode "
            "to one id); use the model's own tokenizer or set data.chat_template_file")


def resolve_data_source(data: Mapping[str, Any], checkpoint: str | None, vocab_size: int) -> dict[str, Any]:
    """``data`` (the source keys of the data group) with ``tokenizer`` resolved and ``chat_template_file`` replaced
    by the resolved ``chat_template``; checked against the model's ``vocab_size`` (see the module docstring)."""
    source = dict(data)
    spec = resolve_tokenizer_spec(source.get("tokenizer", TOKENIZER_AUTO), checkpoint)
    tokenizer = build_tokenizer(spec)
    template = resolve_chat_template(tokenizer, source.pop("chat_template_file", None))
    if template is not None:
        _compile(template)  # a template that does not compile stops here
    check_tokenizer(tokenizer, template, vocab_size, str(spec))
    source["tokenizer"] = spec
    source["chat_template"] = template
    return source
