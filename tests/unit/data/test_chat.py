"""dsv4.data.chat: the default template by hand, assistant-only supervision checked by decoding, one tokenization
of the whole rendering under a BPE whose merges cross the turns, and Hugging Face's template environment (through
transformers and without it)."""

from __future__ import annotations

import datetime
import logging
import sys

import pytest

from dsv4.data import DEFAULT_CHAT_TEMPLATE, ByteTokenizer, Document, HFTokenizer, chat_segments, pack_documents
from dsv4.data import chat, tokenize_chat
from dsv4.data.chat import assistant_token_mask, render_chat, supervised_spans
from dsv4.data.packer import IGNORE_INDEX
from tests.unit.data.model_tokenizer import JINJA_TEMPLATE
from tests.unit.data.test_model_chat_format import REASONING_CHAT

TWO_TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Héllo!"}]


def _supervised_text(ids, mask, tok=ByteTokenizer()):
    return tok.decode([i for i, m in zip(ids, mask) if m])


def test_two_turn_rendering_and_mask_by_hand():
    assert chat_segments(TWO_TURNS) == [
        ("<|user|>\nHi<|end|>\n", False),
        ("<|assistant|>\n", False),
        ("Héllo!<|end|>\n", True),
    ]
    tok = ByteTokenizer()
    ids, mask = tokenize_chat(TWO_TURNS, tok)
    assert tok.decode(ids) == "<|user|>\nHi<|end|>\n<|assistant|>\nHéllo!<|end|>\n"
    header = "<|user|>\nHi<|end|>\n<|assistant|>\n".encode()
    assert len(mask) == len(ids) == len(header) + len("Héllo!<|end|>\n".encode())
    assert not any(mask[: len(header)]) and all(mask[len(header):])
    assert _supervised_text(ids, mask) == "Héllo!<|end|>\n"


def test_packed_labels_decode_to_assistant_replies_only():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    tok = ByteTokenizer()
    ids, mask = tokenize_chat(messages, tok)
    rows = pack_documents([Document(ids, mask, "chat")], seq_len=128)
    labels = rows.batch.labels[0]
    assert tok.decode(labels[labels != IGNORE_INDEX].tolist()) == "4<|end|>\n6<|end|>\n"


def test_template_without_generation_prompt_supervises_whole_assistant_turn():
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    ids, mask = tokenize_chat(TWO_TURNS, ByteTokenizer(), template)
    assert _supervised_text(ids, mask) == "[assistant]Héllo!\n"


def test_template_that_is_not_prefix_stable_is_refused():
    template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match=r"x.jsonl:4: the chat template is not prefix-stable at messages\[0\]"):
        chat_segments(TWO_TURNS, template, where="x.jsonl:4")


@pytest.mark.parametrize(
    "messages, error, pattern",
    [
        ([], ValueError, "non-empty list"),
        ([{"role": "user"}], KeyError, r"messages\[0\] has no `content` field"),
        ([{"role": "user", "content": 3}], ValueError, r"messages\[0\].content must be a string, got int"),
        (["hi"], ValueError, r"messages\[0\] must be an object"),
        ([{"role": "user", "content": "Hi"}, {"role": "asistant", "content": "Hello"}], ValueError,
         r"f.jsonl:2: messages\[1\].role='asistant' is not a chat role \(one of system, developer, user, assistant, "
         r"tool, function, ipython\); did you mean 'assistant'\?"),
        ([{"role": "narrator", "content": "Once"}], ValueError, r"messages\[0\].role='narrator' is not a chat role"),
    ],
)
def test_malformed_messages(messages, error, pattern):
    with pytest.raises(error, match=pattern):
        tokenize_chat(messages, ByteTokenizer(), where="f.jsonl:2")


def test_template_that_does_not_compile():
    with pytest.raises(ValueError, match="chat template does not compile"):
        chat_segments(TWO_TURNS, "{% for m in messages %}")


# ------------------------------------------------------------------------ one tokenization of the whole chat

BPE_CHATS = [("Hi", "Hello!"), ("Hey", "Hola"), ("How?", "Hmm, fine."), ("Hat", "Hot")]
FOUR_TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": "How?"}, {"role": "assistant", "content": "Hot"}]
GENERATION_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}"
                       "{% generation %}{{ m['content'] }}<|end|>\n{% endgeneration %}"
                       "{% else %}{{ m['content'] }}<|end|>\n{% endif %}{% endfor %}")
"""The default template with the assistant text in ``{% generation %}`` (transformers' assistant-mask markup)."""


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A BPE without a pre-tokenizer, trained on default-template chats: its merges cross the turn boundaries."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import models, trainers

    corpus = [f"<|user|>\n{u}<|end|>\n<|assistant|>\n{a}<|end|>\n" for u, a in BPE_CHATS]
    tok = FastTokenizer(models.BPE())
    tok.train_from_iterator(corpus * 10, trainers.BpeTrainer(vocab_size=60, show_progress=False))
    directory = tmp_path_factory.mktemp("bpe")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    return directory


@pytest.mark.parametrize("where", ["tokenizer.json", "directory"])  # the tokenizers library / transformers
def test_bpe_merging_across_turns_trains_on_the_ids_of_the_whole_rendering(bpe_dir, where):
    tok = HFTokenizer(bpe_dir / "tokenizer.json" if where == "tokenizer.json" else bpe_dir)
    assert (tok._hf is None) == (where == "tokenizer.json")
    rendered = "<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\nHow?<|end|>\n<|assistant|>\nHot<|end|>\n"
    assert render_chat(FOUR_TURNS) == rendered
    ids, mask = tokenize_chat(FOUR_TURNS, tok)
    assert ids == tok.encode(rendered)
    # the merges cross the turn boundaries, so tokenizing turn by turn gives other ids
    assert [i for text, _ in chat_segments(FOUR_TURNS) for i in tok.encode(text)] != ids
    pieces = [tok.decode([i]) for i in ids]
    assert pieces == ["<|user|>\nH", "i", "<|end|>\n<|assistant|>\nH", "el", "l", "o", "!<|end|>\n",
                      "<|user|>\nH", "o", "w", "?", "<|end|>\n<|assistant|>\nHo", "t", "<|end|>\n"]
    # the replies with their end markers are characters [33, 47) and [82, 93); a token is supervised iff it holds
    # one of their characters, so the two tokens that end in a reply's first characters are
    assert rendered[33:47] == "Hello!<|end|>\n" and rendered[82:93] == "Hot<|end|>\n"
    assert mask == [False, False, True, True, True, True, True, False, False, False, False, True, True, True]


def test_mask_equals_transformers_assistant_tokens_mask(bpe_dir):
    """transformers' apply_chat_template(return_assistant_tokens_mask=True) on the same chat and tokenizer, with the
    reply marked by {% generation %}: the same ids and the same mask."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(bpe_dir), local_files_only=True)
    out = hf.apply_chat_template(FOUR_TURNS, chat_template=GENERATION_TEMPLATE, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    ids, mask = tokenize_chat(FOUR_TURNS, HFTokenizer(bpe_dir), GENERATION_TEMPLATE)
    assert (ids, mask) == (list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]])
    assert tokenize_chat(FOUR_TURNS, HFTokenizer(bpe_dir)) == (ids, mask)  # the default template: same text


def test_assistant_token_mask_rule():
    spans = [(3, 6), (10, 12)]
    offsets = [(0, 3), (2, 4), (4, 5), (5, 8), (8, 10), (9, 11), (12, 13), (0, 0), (4, 4), (6, 6), (11, 11)]
    assert assistant_token_mask(offsets, spans) == [False, True, True, True, False, True, False,
                                                    False, True, False, True]
    assert supervised_spans([("ab", False), ("cd", True), ("e", True), ("", True), ("f", False), ("g", True)]) == [
        (2, 5), (6, 7)]


def test_tokenizer_without_offsets_is_refused_for_chats():
    class NoOffsets:
        vocab_size, pad_id = 256, 0

        def encode(self, text):
            return list(text.encode())

    with pytest.raises(ValueError, match=r"chat data needs token offsets: tokenizer .*NoOffsets.* has no "
                                         r"encode_with_offsets"):
        tokenize_chat(TWO_TURNS, NoOffsets())


# ------------------------------------------------------------------- Hugging Face's template environment

ENV_TEMPLATE = ("{{ strftime_now('%d %B %Y') }}\n{% for m in messages %}{% if m['role'] == 'tool' %}{% break %}"
                "{% endif %}<|{{ m['role'] }}|>{% if m.content is defined %}{{ m.content }}{% endif %}"
                "{% if m.thinking is defined %}<think>{{ m.thinking }}</think>{% endif %}"
                "{% if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{% endif %}\n{% endfor %}")
"""``strftime_now``, ``{% break %}`` (at the first tool message), ``tojson`` (no HTML escaping, keys in order,
non-ASCII kept), a None ``content`` dropped and ``reasoning_content`` read as ``thinking``."""

TOOL_CHAT = [
    {"role": "user", "content": "Weather in <Zürich>?"},
    {"role": "assistant", "content": None, "reasoning_content": "look it up",
     "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": {"city": "Zürich", "days": 2}}}]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "Sunny."},
]


def _expected_env_text(day: datetime.datetime) -> str:
    # trim_blocks: the newline after a block tag ({% endif %}) is dropped, the one after {{ ... }} kept
    return (f"{day.strftime('%d %B %Y')}\n<|user|>Weather in <Zürich>?<|assistant|><think>look it up</think>"
            '[{"type": "function", "function": {"name": "get", "arguments": {"city": "Zürich", "days": 2}}}]')


@pytest.fixture(params=["transformers", "fallback"])
def renderer(request, monkeypatch):
    """``transformers``: its render_jinja_template, counted; ``fallback``: transformers cannot be imported."""
    from transformers.utils import chat_template_utils

    if request.param == "fallback":
        monkeypatch.setitem(sys.modules, "transformers.utils.chat_template_utils", None)  # import -> ImportError
        monkeypatch.setattr(chat, "_logged_fallback", False)
        return request.param, None
    calls = []
    real = chat_template_utils.render_jinja_template

    def counted(*args, **kwargs):
        calls.append(kwargs["chat_template"])
        return real(*args, **kwargs)

    monkeypatch.setattr(chat_template_utils, "render_jinja_template", counted)
    return request.param, calls


def test_template_with_break_strftime_now_and_tojson_renders(renderer, caplog):
    path, calls = renderer
    before = datetime.datetime.now()
    with caplog.at_level(logging.INFO, logger="dsv4"):
        text = render_chat(TOOL_CHAT, ENV_TEMPLATE)
        assert render_chat(TOOL_CHAT, ENV_TEMPLATE) == text
    assert text in {_expected_env_text(before), _expected_env_text(datetime.datetime.now())}
    fallback_lines = [r.getMessage() for r in caplog.records if "dsv4's Jinja environment" in r.getMessage()]
    if path == "transformers":
        assert calls == [ENV_TEMPLATE, ENV_TEMPLATE] and fallback_lines == []
    else:
        assert len(fallback_lines) == 1 and "transformers cannot be imported" in fallback_lines[0]
    with pytest.raises(ValueError, match=r"x.jsonl:3: rendering the chat template failed: TemplateError: "
                                         r"a system message first"):
        render_chat(TWO_TURNS, "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message "
                               "first') }}{% endif %}", where="x.jsonl:3")


def test_both_renderers_give_the_same_text(monkeypatch, bpe_dir):
    templates = [ENV_TEMPLATE, GENERATION_TEMPLATE, DEFAULT_CHAT_TEMPLATE, JINJA_TEMPLATE]
    vars_ = {"bos_token": "<s>", "eos_token": "</s>"}
    chats = [TOOL_CHAT, FOUR_TURNS, REASONING_CHAT]

    def render_all():
        return ([render_chat(c, t, template_vars=vars_) for t in templates for c in chats]
                + [render_chat(c, t, template_vars=vars_, add_generation_prompt=True) for t in templates for c in chats]
                + [tokenize_chat(FOUR_TURNS, HFTokenizer(bpe_dir), t) for t in templates[1:3]])

    with_transformers = render_all()
    monkeypatch.setitem(sys.modules, "transformers.utils.chat_template_utils", None)
    assert chat._transformers_renderer() is None
    assert render_all() == with_transformers
