"""Data pipeline: documents -> tokenizer -> first-fit-decreasing packer -> packed dataset -> dp sampler -> batches.

    docs = build_documents("stdlib", max_bytes=2_000_000)            # or "jsonl" / "hf" (DATA_SOURCES) with a path
    dataset = build_packed_dataset(docs, seq_len=1024, shard_multiple=128, pad_id=0, cp_size=2)
    sampler = DistributedPackedSampler(len(dataset), dp_rank, dp_size, seed=0)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler, collate_fn=TokenBatch.stack)

The same rows prepared once on disk and memory-mapped by every later start: :func:`dsv4.data.prepared.prepare_dataset`
(``python -m dsv4.data prepare``). The tokenizer and chat template a run uses by default (the model checkpoint's):
:mod:`dsv4.data.defaults`; DeepSeek-V4's chat encoding: :mod:`dsv4.data.deepseek_v4_chat`.

Batches are :class:`dsv4.batch.TokenBatch` (``input_ids``, ``labels``, ``seq_ids``, ``positions`` ``[B, S]``); see
:mod:`dsv4.data.packer` for the exact row layout.
"""

from dsv4.batch import IGNORE_INDEX, TokenBatch
from dsv4.data.chat import DEFAULT_CHAT_TEMPLATE, chat_segments, render_chat, tokenize_chat
from dsv4.data.dataset import DistributedPackedSampler, build_packed_dataset
from dsv4.data.packer import PackedRows, PackStats, first_fit_decreasing, pack_documents
from dsv4.data.sources import (DATA_KINDS, DATA_SOURCES, DataSource, Document, SourceArgs, build_documents,
                               hf_documents, jsonl_documents, stdlib_corpus)
from dsv4.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "DATA_KINDS",
    "DATA_SOURCES",
    "DEFAULT_CHAT_TEMPLATE",
    "DataSource",
    "DistributedPackedSampler",
    "Document",
    "HFTokenizer",
    "IGNORE_INDEX",
    "PackStats",
    "PackedRows",
    "SourceArgs",
    "TokenBatch",
    "Tokenizer",
    "build_documents",
    "build_packed_dataset",
    "build_tokenizer",
    "chat_segments",
    "first_fit_decreasing",
    "hf_documents",
    "jsonl_documents",
    "pack_documents",
    "render_chat",
    "stdlib_corpus",
    "tokenize_chat",
]
