"""Reference code lengths (issue 29, part 5): the text is the bytes the bpb counts, the values
equal the libraries' own compression of a text the test builds itself, the cache is read on a
second call, the manifest field validates against the checked-in schema, and the console, the
comparison and the service's page show them."""

from __future__ import annotations

import copy
import gzip
import hashlib
import io
import json
import logging
import lzma
import re
import threading
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import zstandard
from fixtures_data import SALT_HEX, make_rows, read_split_rows, write_parquet, write_salt
from pydantic import ValidationError
from rich.console import Console

from prism_challenge.research.compare import group_runs, load_runs
from prism_challenge.research.compare_report import HEADERS, html_report, print_report, rows
from prism_challenge.data import refcodes
from prism_challenge.data.manifest import DataError
from prism_challenge.data.prepare import prepare
from prism_challenge.data.stream import iter_token_chunks
from prism_challenge.evaluator.feeder import RowAssembler
from prism_challenge.research.report import print_summary
from prism_challenge.manifest.results import SCHEMA_PATH, RunManifest
from prism_challenge.manifest.run_manifest import MANIFEST_NAME
from prism_challenge.tokenizers import reference_tokenizer

ROWS = make_rows(300, seed=29, words=(1, 200))
ROWS[7]["text"] += " héllo wörld ✓ 𝄞"  # multi-byte UTF-8: a gpt2 token may cut inside a character
SCORED = json.loads((Path(__file__).parent / "data" / "scored_manifest.v2.json").read_text())
RECORD = {"bytes": 3999, "text_sha256": "ab" * 32, "zstd-19": 2.5, "xz-9e": 2.25, "gzip-9": 3.0}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("refcodes")
    src = write_parquet(base / "in.parquet", ROWS)
    return prepare(src, base / "d", salt_file=write_salt(base / "salt", SALT_HEX), shard_docs=40).manifest


def _documents(data) -> bytes:
    """The train split's documents' UTF-8 bytes, concatenated, read with pyarrow directly."""
    return b"".join(r["text"].encode("utf-8") for r in read_split_rows(data, "train"))


def _scored_targets(data, tok, token_budget, rows=3, seq_len=17):
    """What the feeder scores: the target bytes it counts, and the bytes the target tokens stand for."""
    asm = RowAssembler(iter_token_chunks(data, tok), token_budget=token_budget)
    counted, targets = 0, []
    while (cut := asm.cut(rows, seq_len)) is not None:
        counted += int(cut.target_bytes.sum())
        targets += cut.tokens[:, 1:].reshape(-1).tolist()
    return counted, tok.decode_bytes(targets)


@pytest.mark.parametrize("name", ["gpt2", "bytes"])
@pytest.mark.parametrize("token_budget", [2, 1000, 4321, None])
def test_the_text_is_exactly_the_bytes_the_scored_targets_stand_for(data, name, token_budget):
    tok = reference_tokenizer(name)
    counted, decoded = _scored_targets(data, tok, token_budget)
    assert len(decoded) == counted > 0
    assert refcodes.scored_text(data, counted) == decoded
    if token_budget is None:  # the whole stream: every document
        assert decoded == _documents(data) and counted == data.utf8_bytes("train")


def test_the_codes_equal_the_libraries_on_a_text_the_test_builds(data, tmp_path):
    n = 12_345
    text = _documents(data)[:n]
    record = refcodes.reference_codes(data, n, cache_root=tmp_path)
    zstd_out = zstandard.ZstdCompressor(level=19).compress(text)
    xz = lzma.LZMACompressor(format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)
    xz_out = xz.compress(text) + xz.flush()
    gz = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: a gzip member, as gzip -9 writes it
    gz_out = gz.compress(text) + gz.flush()
    # each output is a code of the text: it decodes back to it
    assert zstandard.ZstdDecompressor().decompress(zstd_out) == lzma.decompress(xz_out) == gzip.decompress(gz_out) == text
    assert record == {"bytes": n, "text_sha256": hashlib.sha256(text).hexdigest(),
                      "zstd-19": 8 * len(zstd_out) / n, "xz-9e": 8 * len(xz_out) / n, "gzip-9": 8 * len(gz_out) / n}
    assert record["xz-9e"] < record["gzip-9"] < 8  # English-like text: xz codes it best, all below 8 bits


def test_a_second_call_reads_the_cache(data, tmp_path, monkeypatch):
    calls = []
    real = refcodes.code_lengths
    monkeypatch.setattr(refcodes, "code_lengths", lambda text: calls.append(len(text)) or real(text))
    first = refcodes.reference_codes(data, 5000, cache_root=tmp_path)
    path = refcodes.cache_path(data, 5000, tmp_path)
    assert path == tmp_path / "refcodes" / f"{data.sha256}-train-5000.json" and calls == [5000]
    cached = json.loads(path.read_text())
    assert cached["record"] == first and cached["manifest_sha256"] == data.sha256
    assert cached["libraries"] == refcodes.library_versions()
    assert refcodes.reference_codes(data, 5000, cache_root=tmp_path) == first and calls == [5000]  # a hit
    assert refcodes.reference_codes(data, 5001, cache_root=tmp_path) != first and calls == [5000, 5001]
    # other library versions, or a damaged file: computed again, and the same figures
    cached["libraries"]["libzstd"] = "0.0.1"
    path.write_text(json.dumps(cached))
    assert refcodes.reference_codes(data, 5000, cache_root=tmp_path) == first and calls[-1] == 5000
    assert json.loads(path.read_text())["libraries"] == refcodes.library_versions()
    path.write_text("{not json")
    assert refcodes.reference_codes(data, 5000, cache_root=tmp_path) == first and len(calls) == 4
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, f"{data.sha256}-train-5001.json"])


def test_too_many_bytes_is_a_named_error_and_none_has_no_codes(data, tmp_path):
    total = data.utf8_bytes("train")
    with pytest.raises(DataError, match=re.escape(f"split 'train' holds {total} UTF-8 bytes, fewer than the "
                                                  f"{total + 1} scored")):
        refcodes.reference_codes(data, total + 1, cache_root=tmp_path)
    assert refcodes.reference_codes(data, 0, cache_root=tmp_path) is None
    assert refcodes.scored_text(data, total) == _documents(data)


def test_the_background_run_logs_a_failure_and_a_cancel_does_not_wait(data, tmp_path, monkeypatch, caplog):
    total = data.utf8_bytes("train")
    with caplog.at_level(logging.WARNING, logger=refcodes.__name__):
        assert refcodes.Background(data, total + 1, tmp_path).result() is None
    assert f"fewer than the {total + 1} scored" in caplog.text
    assert refcodes.Background(data, 777, tmp_path).result() == refcodes.reference_codes(data, 777, cache_root=tmp_path)
    gate = threading.Event()
    real = refcodes.code_lengths
    monkeypatch.setattr(refcodes, "code_lengths", lambda text: gate.wait(30) and real(text))
    bg = refcodes.Background(data, 778, tmp_path)
    assert bg.result(lambda: True) is None  # the compressors still run: a cancel does not wait for them
    gate.set()
    assert bg.result() == refcodes.reference_codes(data, 778, cache_root=tmp_path)


def test_against_best_is_the_lowest_code():
    assert refcodes.against_best(2.0, RECORD) == ("xz-9e", pytest.approx(-0.25))
    assert refcodes.against_best(3.5, {**RECORD, "zstd-19": 1.5}) == ("zstd-19", 2.0)


# -- the manifest field ------------------------------------------------------------------------------------------
def _with(record) -> dict:
    m = copy.deepcopy(SCORED)
    m["reference_codes"] = record
    return m


def test_the_field_validates_against_the_model_and_the_checked_in_schema():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA_PATH.read_text())
    good = _with(RECORD)
    jsonschema.validate(good, schema)
    assert RunManifest.model_validate(good).to_json_dict()["reference_codes"] == RECORD  # keys kept: "zstd-19"...
    jsonschema.validate(_with(None), schema)
    old = copy.deepcopy(SCORED)
    old.pop("reference_codes", None)  # a manifest from before the field
    assert RunManifest.model_validate(old).reference_codes is None
    for bad in ({k: v for k, v in RECORD.items() if k != "xz-9e"}, {**RECORD, "brotli": 1.0},
                {**RECORD, "gzip-9": -1.0}, {**RECORD, "bytes": 0}, {**RECORD, "text_sha256": "xyz"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(_with(bad), schema)
        with pytest.raises(ValidationError):
            RunManifest.model_validate(_with(bad))


# -- where they are shown ----------------------------------------------------------------------------------------
BPB = SCORED["score"]["prequential_bpb"]  # 8.018997...: the best code is xz-9e's 2.25
GAP = f"{BPB - 2.25:+.4f}"


def test_the_console_summary_shows_the_codes_and_the_gap():
    buf = io.StringIO()
    print_summary(Console(file=buf, width=200), SimpleNamespace(manifest=_with(RECORD), run_dir=Path("/runs/x")))
    assert f"zstd-19 2.5000 · xz-9e 2.2500 · gzip-9 3.0000; model {GAP} vs xz-9e" in buf.getvalue()
    buf = io.StringIO()
    print_summary(Console(file=buf, width=200), SimpleNamespace(manifest=_with(None), run_dir=Path("/runs/x")))
    assert re.search(r"reference codes, same bytes \(bpb\)\s+│ - ", buf.getvalue())


def test_prism_compare_shows_the_codes(tmp_path):
    for name, record in (("a", RECORD), ("b", None), ("c", RECORD)):
        (tmp_path / name).mkdir()
        m = _with(record)
        if name == "c":  # a better run on the same bytes
            m["score"]["prequential_bpb"] = m["verdict"]["prequential_bpb"] = 2.0
        (tmp_path / name / MANIFEST_NAME).write_text(json.dumps(m))
    groups = group_runs(load_runs([tmp_path / n for n in "abc"]))
    got = {row[1]: dict(zip(HEADERS, row)) for row in rows(groups[0])}
    assert {k: got["a"][k] for k in ("zstd-19", "xz-9e", "gzip-9", "bpb − best ref")} == {
        "zstd-19": "2.5000", "xz-9e": "2.2500", "gzip-9": "3.0000", "bpb − best ref": f"{GAP} xz-9e"}
    assert got["c"]["bpb − best ref"] == "-0.2500 xz-9e" and got["b"]["bpb − best ref"] == got["b"]["xz-9e"] == "-"
    buf = io.StringIO()
    print_report(Console(file=buf, width=80), groups, [])
    # the console: one line per distinct record under the table, each run's difference in rank order
    assert ("reference codes of the same 3,999 scored bytes (bpb): zstd-19 2.5000 · xz-9e 2.2500 · gzip-9 3.0000; "
            f"bpb − xz-9e: c -0.2500, a {GAP}\n") in buf.getvalue()
    page = html_report(groups, [], None)
    assert "<th>xz-9e</th>" in page and "<td>2.2500</td>" in page and f"<td>{GAP} xz-9e</td>" in page
