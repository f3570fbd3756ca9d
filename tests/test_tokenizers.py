import hashlib

import numpy as np
import pytest

from prism_challenge.tokenizers import (
    GPT2_ENCODER_JSON_SHA256,
    GPT2_VOCAB_BPE_SHA256,
    TokenizerError,
    gpt2_files,
    reference_tokenizer,
    vocab_size_of,
)

# Accents, CJK and emoji: GPT-2 splits several of these inside a character.
TRICKY = "naïve café — 日本語のテキスト 🤖🎉 Ünïcödé ✓ e\u0301 \U0001f469\u200d\U0001f4bb"


def test_gpt2_files_match_tiktoken_pins():
    bpe, enc = gpt2_files()
    assert hashlib.sha256(open(bpe, "rb").read()).hexdigest() == GPT2_VOCAB_BPE_SHA256
    assert hashlib.sha256(open(enc, "rb").read()).hexdigest() == GPT2_ENCODER_JSON_SHA256


def test_vocab_sizes():
    assert vocab_size_of("gpt2") == 50257 and reference_tokenizer("gpt2").eot_token == 50256
    assert vocab_size_of("bytes") == 257 and reference_tokenizer("bytes").eot_token == 256
    with pytest.raises(TokenizerError, match="unknown tokenizer 'llama'"):
        reference_tokenizer("llama")


def test_gpt2_known_ids():
    # Independent reference: GPT-2 encodes "Hello world" as [15496, 995] (OpenAI's published ids).
    assert reference_tokenizer("gpt2").encode("Hello world") == [15496, 995]


@pytest.mark.parametrize("name", ["gpt2", "bytes"])
def test_token_bytes_sum_to_utf8_length(name):
    tok = reference_tokenizer(name)
    ids = tok.encode(TRICKY)
    lengths = tok.byte_lengths()
    assert int(lengths[np.asarray(ids)].sum()) == len(TRICKY.encode("utf-8"))
    assert tok.decode_bytes(ids) == TRICKY.encode("utf-8")
    assert lengths[tok.eot_token] == 0


def test_gpt2_splits_inside_a_character():
    tok = reference_tokenizer("gpt2")
    table = tok.token_bytes_table()
    pieces = [table[i] for i in tok.encode("🤖")]
    # the robot is 4 UTF-8 bytes and no single GPT-2 token holds all of it
    assert sum(map(len, pieces)) == 4 and len(pieces) > 1
    with pytest.raises(UnicodeDecodeError):
        pieces[0].decode("utf-8")
