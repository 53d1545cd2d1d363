"""dsv4.data.chat: the default template by hand and assistant-only supervision checked by decoding."""

from __future__ import annotations

import pytest

from dsv4.data import ByteTokenizer, Document, chat_segments, pack_documents, tokenize_chat
from dsv4.data.packer import IGNORE_INDEX

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
