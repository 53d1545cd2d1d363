"""The model's own tokenizer and chat format: DeepSeek-V4's encoding rules by hand (reasoning, tool calls), a real
BPE tokenizer with a tokenizer_config.json chat template, ``data.tokenizer=auto`` from ``model.checkpoint``, and
the start-up refusals (a tokenizer larger than the embedding, missing special tokens, a checkpoint without a
tokenizer), and the logged choice of the built-in template."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from dsv4.data import ByteTokenizer, HFTokenizer, chat_segments, tokenize_chat
from dsv4.data.chat import render_chat
from dsv4.data.datamodule import DSV4DataModule
from dsv4.data.defaults import resolve_chat_template
from dsv4.data.deepseek_v4_chat import SPECIAL_TOKENS
from dsv4.data.tokenizers import single_id
from dsv4.training.schema import register_schema
from dsv4.training.spec import build_run_spec
from tests.unit.data.model_tokenizer import JINJA_TEMPLATE, write_tokenizer_dir

CONF = Path(__file__).resolve().parents[3] / "conf"
B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"

REASONING_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "add"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "add again"},
]


def _compose(overrides):
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="finetune", overrides=overrides)


def test_deepseek_v4_multi_turn_reasoning_by_hand():
    assert chat_segments(REASONING_CHAT, "deepseek_v4") == [
        (B, False),
        ("Be brief.", False),
        (f"{U}2+2?{A}<think>", False),
        (f"add</think>4{E}", True),
        (f"{U}and 3+3?{A}<think>", False),
        (f"add again</think>6{E}", True),
    ]


def test_deepseek_v4_chat_mode_and_tool_calls_by_hand():
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    calls = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
             '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    assert chat_segments(messages, "deepseek_v4") == [
        (B, False),
        (f"{U}weather?{A}</think>", False),
        (calls + E, True),
        (f"{U}<tool_result>sunny</tool_result>{A}</think>", False),
        (f"Sunny.{E}", True),
    ]


def test_deepseek_v4_refuses_tool_schemas():
    with pytest.raises(ValueError, match=r"x.jsonl:2: messages\[0\] carries `tools`"):
        chat_segments([{"role": "system", "content": "s", "tools": [{"type": "function"}]},
                       {"role": "user", "content": "q"}], "deepseek_v4", where="x.jsonl:2")


def test_real_tokenizer_masks_exactly_the_assistant_turns(tmp_path):
    tok = HFTokenizer(write_tokenizer_dir(tmp_path / "ckpt"))
    assert all(single_id(tok, t) is not None for t in SPECIAL_TOKENS)
    ids, mask = tokenize_chat(REASONING_CHAT, tok, "deepseek_v4")
    assert ids == tok.encode(render_chat(REASONING_CHAT, "deepseek_v4"))
    supervised = [i for i, m in zip(ids, mask) if m]
    assert supervised == tok.encode(f"add</think>4{E}") + tok.encode(f"add again</think>6{E}")
    prompt = [i for i, m in zip(ids, mask) if not m]
    assert prompt == (tok.encode(B) + tok.encode("Be brief.") + tok.encode(f"{U}2+2?{A}<think>")
                      + tok.encode(f"{U}and 3+3?{A}<think>"))
    assert ids.count(single_id(tok, E)) == 2 and mask[ids.index(single_id(tok, E))]


def test_tokenizer_config_template_multi_turn_reasoning_by_hand(tmp_path):
    """The chat_template of a real tokenizer's tokenizer_config.json, rendered with its bos / eos tokens: the
    supervised segments are exactly the assistant messages (reasoning included), the role header is not."""
    tok = HFTokenizer(write_tokenizer_dir(tmp_path / "ckpt", chat_template=JINJA_TEMPLATE))
    assert tok.chat_template == JINJA_TEMPLATE and tok.template_vars["eos_token"] == E
    segments = chat_segments(REASONING_CHAT, tok.chat_template, template_vars=tok.template_vars)
    assert segments == [
        (B, False),
        ("Be brief.", False),
        (f"{U}2+2?", False),
        (A, False),
        (f"<think>add</think>4{E}", True),
        (f"{U}and 3+3?", False),
        (A, False),
        (f"<think>add again</think>6{E}", True),
    ]
    ids, mask = tokenize_chat(REASONING_CHAT, tok, tok.chat_template, template_vars=tok.template_vars)
    assert ids == tok.encode("".join(text for text, _ in segments))
    assert ids == tok.encode(render_chat(REASONING_CHAT, tok.chat_template, template_vars=tok.template_vars))
    assert [i for i, m in zip(ids, mask) if m] == tok.encode(f"<think>add</think>4{E}") + tok.encode(
        f"<think>add again</think>6{E}")


@pytest.mark.parametrize("template, expected", [(None, "deepseek_v4"), (JINJA_TEMPLATE, JINJA_TEMPLATE)])
def test_checkpoint_tokenizer_and_template_are_the_default(tmp_path, template, expected):
    """``model.checkpoint=<dir with tokenizer.json>`` and ``data=jsonl``: that tokenizer and its template (the
    tokenizer_config.json one, else DeepSeek-V4's rules) with no data overrides."""
    ckpt = write_tokenizer_dir(tmp_path / "ckpt", chat_template=template)
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}\n')
    spec = build_run_spec(_compose(["seq_len=256", f"model.checkpoint={ckpt}", "data=jsonl", f"data.path={data}"]))
    assert spec.data["tokenizer"] == str(ckpt) and spec.data["chat_template"] == expected
    assert "chat_template_file" not in spec.data
    module = DSV4DataModule(source=dict(spec.data), seq_len=spec.seq_len, shard_multiple=spec.model.shard_multiple,
                            overlong=spec.overlong, cache_dir=str(tmp_path / "cache"), num_proc=1)
    labels = module.build_dataset()[0].labels[0]
    assert labels[labels != -100].tolist() == HFTokenizer(ckpt).encode(f"4{E}")  # the answer and its end only
    plain = build_run_spec(_compose(["seq_len=256", "data=jsonl", f"data.path={data}"]))
    assert (plain.data["tokenizer"], plain.data["chat_template"]) == ("byte", None)  # the tiny model: bytes


def test_tokenizer_larger_than_the_embedding_is_refused_at_start_up(tmp_path):
    ckpt = write_tokenizer_dir(tmp_path / "ckpt")
    n = HFTokenizer(ckpt).vocab_size
    with pytest.raises(ValueError, match=rf"`data.tokenizer`='{ckpt}' has {n} ids but the model's embedding has 100 "
                                         r"rows \(model.vocab_size=100\)"):
        build_run_spec(_compose(["seq_len=256", f"model.checkpoint={ckpt}", "model.vocab_size=100"]))


def test_tokenizer_without_the_formats_special_tokens_is_refused(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hi"}\n')
    with pytest.raises(ValueError, match=r"`data.tokenizer`='byte' lacks special tokens the chat template writes: "
                                         r"\['<｜begin▁of▁sentence｜>'"):
        build_run_spec(_compose(["seq_len=256", "data=jsonl", f"data.path={data}",
                                 "data.chat_template_file=deepseek_v4"]))


def test_checkpoint_without_a_tokenizer_stops_the_spec_naming_it(tmp_path):
    """``data=jsonl data.path=... model.checkpoint=<dir without tokenizer.json>`` (data.tokenizer=auto): the run
    spec, resolved before any rank starts, refuses it naming the directory and the two choices."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hi"}\n')
    overrides = ["seq_len=256", f"model.checkpoint={ckpt}", "data=jsonl", f"data.path={data}"]
    with pytest.raises(ValueError, match=rf"`model.checkpoint`='{ckpt}' holds no tokenizer .*data.tokenizer=byte .* or "
                                         r"data.tokenizer=<path to a tokenizer.json or a tokenizer directory>"):
        build_run_spec(_compose(overrides))
    assert build_run_spec(_compose([*overrides, "data.tokenizer=byte"])).data["tokenizer"] == "byte"


def test_the_built_in_template_is_logged_when_chosen(tmp_path, caplog):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with caplog.at_level(logging.INFO, logger="dsv4"):
        assert resolve_chat_template(ByteTokenizer(), str(template)) == template.read_text()
        assert resolve_chat_template(HFTokenizer(write_tokenizer_dir(tmp_path / "ckpt")), None) == "deepseek_v4"
        assert caplog.records == []
        assert resolve_chat_template(ByteTokenizer(), None) is None
    (record,) = caplog.records
    assert record.levelno == logging.INFO and record.getMessage() == (
        "data: chat records (if any) render with the built-in role-marker template (<|user|>\\n...<|end|>): the "
        "tokenizer ByteTokenizer(vocab_size=256, pad_id=0) has no chat template and data.chat_template_file is not set")
