"""Which control-token strings inside a document become single ids: pinned on Qwen2.5's own added-token list.

The list below is `added_tokens_decoder` of Qwen2.5's published tokenizer_config.json (the same for every Qwen2.5
base and instruct size): id, content, `special`. Every entry there has lstrip, rstrip, single_word and normalized
false. The test tokenizer is the tiny byte-level BPE of `extract.tiny` with these tokens added in this order, so
ids differ from Qwen's (the tiny vocabulary is small) but contents and flags are Qwen2.5's.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from extract.batching import Tokenizer
from extract.tiny import write_tiny_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]

QWEN25_ADDED_TOKENS = [
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
]
SINGLE_ID = [content for _, content, special in QWEN25_ADDED_TOKENS if not special]
SPLIT = [content for _, content, special in QWEN25_ADDED_TOKENS if special]


@pytest.fixture(scope="module")
def qwen25_tokenizer_dir(tmp_path_factory) -> pathlib.Path:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RawTokenizer

    directory = tmp_path_factory.mktemp("qwen25-tokenizer")
    write_tiny_tokenizer(directory, vocab=384)  # already holds <|endoftext|>, <|im_start|>, <|im_end|> as special
    raw = RawTokenizer.from_file(str(directory / "tokenizer.json"))
    present = {token.content for token in raw.get_added_tokens_decoder().values()}
    for _, content, special in QWEN25_ADDED_TOKENS:
        if content not in present:
            token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False)
            (raw.add_special_tokens if special else raw.add_tokens)([token])
    raw.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["additional_special_tokens"] = [c for c in SPLIT if c != "<|endoftext|>"]
    config["split_special_tokens"] = False  # as Qwen2.5 publishes it; the pipeline passes True per call
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def document_with_every_control_string() -> str:
    return " and ".join(f"x{content}y" for _, content, _ in QWEN25_ADDED_TOKENS)


def test_exactly_the_non_special_added_tokens_are_single_ids(qwen25_tokenizer_dir):
    tokenizer = Tokenizer(qwen25_tokenizer_dir, max_seq_len=4096)
    assert tokenizer.single_id_strings == tuple(SINGLE_ID)
    added = {token.content: token_id for token_id, token in tokenizer.hf.added_tokens_decoder.items()}
    (ids,) = tokenizer.encode([document_with_every_control_string()])
    ids = ids.tolist()
    for content in SINGLE_ID:
        assert ids.count(added[content]) == 1, content
    for content in SPLIT:
        assert added[content] not in ids, content
    # Nothing is lost either way: the ids decode to the document.
    assert tokenizer.hf.decode(ids) == document_with_every_control_string()


def test_our_ids_are_autotokenizers_and_the_tokenizers_librarys_with_the_same_settings(qwen25_tokenizer_dir):
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import AutoTokenizer

    text = document_with_every_control_string()
    (ours,) = Tokenizer(qwen25_tokenizer_dir, max_seq_len=4096).encode([text])
    auto = AutoTokenizer.from_pretrained(qwen25_tokenizer_dir)
    assert ours.tolist() == auto(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    raw = RawTokenizer.from_file(str(qwen25_tokenizer_dir / "tokenizer.json"))
    raw.encode_special_tokens = True  # what split_special_tokens sets on the Rust tokenizer
    assert ours.tolist() == raw.encode(text, add_special_tokens=False).ids
    # Without split_special_tokens (AutoTokenizer's default for Qwen2.5) the special ones would be ids too.
    default = auto(text, add_special_tokens=False)["input_ids"]
    assert sum(1 for i in default if auto.convert_ids_to_tokens(i) in SPLIT) == len(SPLIT)


def test_extraction_docs_name_exactly_the_single_id_strings():
    docs = (REPO / "docs" / "EXTRACTION.md").read_text()
    section = docs[docs.index("### Control-token strings") :]
    section = section[: section.index("\n## ")]
    for content in SINGLE_ID:
        assert f"`{content}`" in section, content
    for content in SPLIT:
        assert f"`{content}`" in section, content
