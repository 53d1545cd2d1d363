"""Data pipeline: documents -> tokenizer -> first-fit-decreasing packer -> packed dataset -> dp sampler -> THD batch.

    docs = build_documents("stdlib", max_bytes=2_000_000)            # or "jsonl" / "hf" with a local path
    dataset = build_packed_dataset(docs, seq_len=1024, alignment=8, pad_id=0, cp_size=2)
    sampler = DistributedPackedSampler(len(dataset), dp_rank, dp_size, seed=0)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler, collate_fn=collate_packed)

Batches hold ``input_ids/labels/position_ids [B, S]``, ``seq_lens/seq_lens_padded [B, D]`` (-1000 padded) and
``qkv_format="thd"``; see :mod:`dsv4.data.packer` for the exact row layout.
"""

from dsv4.data.chat import DEFAULT_CHAT_TEMPLATE, chat_segments, tokenize_chat
from dsv4.data.dataset import DistributedPackedSampler, PackedDataset, build_packed_dataset, collate_packed
from dsv4.data.packer import IGNORE_INDEX, SEQ_LENS_PAD, PackedRows, PackStats, pack_documents
from dsv4.data.sources import DATA_KINDS, Document, build_documents, hf_documents, jsonl_documents, stdlib_corpus
from dsv4.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "DATA_KINDS",
    "DEFAULT_CHAT_TEMPLATE",
    "DistributedPackedSampler",
    "Document",
    "HFTokenizer",
    "IGNORE_INDEX",
    "PackStats",
    "PackedDataset",
    "PackedRows",
    "SEQ_LENS_PAD",
    "Tokenizer",
    "build_documents",
    "build_packed_dataset",
    "build_tokenizer",
    "chat_segments",
    "collate_packed",
    "hf_documents",
    "jsonl_documents",
    "pack_documents",
    "stdlib_corpus",
    "tokenize_chat",
]
