"""A small real BPE tokenizer (trained by the `tokenizers` library, no network) with DeepSeek-V4's special tokens,
saved as a checkpoint directory would hold it: ``tokenizer.json`` + ``tokenizer_config.json``."""

from __future__ import annotations

import json
from pathlib import Path

from dsv4.data.deepseek_v4_chat import BOS, DSML, EOS, SPECIAL_TOKENS

CORPUS = ("Be brief. 2+2? and 3+3? add again 4 6 weather? Paris sunny Sunny. <tool_result></tool_result> "
          'name="get_weather" string="true" false {} [] hello world the quick brown fox\n' + DSML)

JINJA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
                  "{% elif m['role'] == 'system' %}{{ m['content'] }}{% else %}<｜Assistant｜>"
                  "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
                  "{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
"""A prefix-stable template in the Hugging Face style (reads ``bos_token`` / ``eos_token``; renders an assistant
message's ``reasoning_content`` inside ``<think>...</think>``)."""


def write_tokenizer_dir(directory: Path, *, chat_template: str | None = None, vocab_size: int = 200,
                        specials: tuple[str, ...] = SPECIAL_TOKENS) -> Path:
    """Train a Metaspace BPE tokenizer (at most ``vocab_size`` ids, ``specials`` as added tokens) and save it with a
    ``tokenizer_config.json`` (bos / eos, and ``chat_template`` when given) into ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.decoder = decoders.Metaspace(prepend_scheme="never")
    tok.train_from_iterator([CORPUS] * 20, trainers.BpeTrainer(vocab_size=vocab_size,
                                                               special_tokens=["<pad>", *specials]))
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory
