"""``prism data``: ``prepare`` a locked data directory, show its ``info``, build a token ``cache``.

:func:`add_data_parser` registers the ``data`` command on the main parser's subparsers; each
subcommand sets ``func`` to a ``(args) -> int`` exit code: 0 on success, 1 when the data is bad
(one ``error:`` line on stderr naming the file, and line or shard), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from prism_challenge.data.manifest import MANIFEST_NAME, DataError


def _size(text: str) -> int:
    """A count with an optional decimal suffix: ``1000``, ``10k``, ``50M``, ``2G``."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)[bB]?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 1000, 10k, 50M, 2G)")
    n = int(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()]
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def add_data_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``data`` (``prepare``, ``info``, ``cache``) on an argparse subparsers object.

    Returns:
        The ``data`` parser.
    """
    data = subparsers.add_parser("data", help="prepare and inspect locked data directories",
                                 description="Prepare and inspect locked data directories.")
    sub = data.add_subparsers(dest="data_command", metavar="{prepare,info,cache}")
    sub.required = True

    p = sub.add_parser(
        "prepare",
        help="build a partitioned data directory from a source",
        description="Read documents, drop exact duplicate texts, partition them train/val/test "
        "(95/2.5/2.5 percent) by HMAC-SHA256(secret salt, id), and write zstd parquet shards and a "
        "hashed MANIFEST.json. The directory is built beside DIR and renamed into place at the end.",
    )
    p.add_argument("--source", nargs="+", required=True, metavar="SOURCE",
                   help="'fineweb-edu' (Hugging Face HuggingFaceFW/fineweb-edu at a pinned commit), "
                   "'builtin' (the offline default corpus), or local .parquet/.jsonl/.jsonl.gz/.jsonl.zst "
                   "files or folders of them in the FineWeb-Edu schema")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="the data directory to create")
    lim = p.add_mutually_exclusive_group()
    lim.add_argument("--max-docs", type=_size, metavar="N", help="read at most N source documents")
    lim.add_argument("--max-bytes", type=_size, metavar="N",
                     help="read documents while their UTF-8 text totals at most N bytes (suffixes k, M, G)")
    p.add_argument("--subset", help="fineweb-edu subset (default sample-10BT)")
    p.add_argument("--revision", metavar="SHA", help="fineweb-edu commit (default: the pinned 87f09149...)")
    p.add_argument("--allow-unpinned", action="store_true",
                   help="allow --revision to be a branch or tag name; the resolved commit is recorded")
    p.add_argument("--hub-mirror", type=Path, metavar="DIR",
                   help="read fineweb-edu from a local directory laid out like the Hub repo "
                   "(the repo tree, or a huggingface_hub cache folder with refs/ and snapshots/)")
    p.add_argument("--salt-file", type=Path, metavar="PATH",
                   help="the secret partition salt: reused if it exists, else created (mode 0600); "
                   "default DIR.salt beside DIR; never inside DIR")
    p.add_argument("--dataset", help="dataset name to record for local files")
    p.add_argument("--license", help="license to record for local files")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")
    p.add_argument("--shard-bytes", type=_size, default=None, metavar="N",
                   help="UTF-8 text bytes per shard (default 64M)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_prepare)

    i = sub.add_parser("info", help="show a data directory's MANIFEST and verify its shards",
                       description="Print the MANIFEST as tables and verify every shard's sha256.")
    i.add_argument("dir", type=Path, metavar="DIR", help="a data directory (holds MANIFEST.json)")
    i.add_argument("--shards", action="store_true", help="list every shard")
    i.add_argument("--no-verify", action="store_true", help="do not hash the shards")
    i.add_argument("--salt-file", type=Path, metavar="PATH", help="also check this salt against the commitment")
    i.set_defaults(func=cmd_info)

    c = sub.add_parser("cache", help="build (or verify) the train split's token cache",
                       description="Tokenize the train split once into the memory-mapped token cache "
                       "that runs read (built on first use otherwise).")
    c.add_argument("dir", type=Path, metavar="DIR", help="a data directory (holds MANIFEST.json)")
    c.add_argument("--tokenizer", default="gpt2", help="reference tokenizer (gpt2 or bytes; default gpt2)")
    c.add_argument("--workers", type=int, default=None, help="tokenizer threads (default: CPUs, at most 8)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_cache)
    return data


def _error(command: str, msg: str) -> int:
    print(f"prism data {command}: error: {msg}", file=sys.stderr)
    return 1


def cmd_prepare(args: argparse.Namespace) -> int:
    """``prism data prepare``: see :func:`prism_challenge.data.prepare.prepare`."""
    from prism_challenge.data.prepare import SHARD_BYTES, prepare
    from prism_challenge.data.progress import progress_callback

    total = args.max_bytes
    try:
        with progress_callback(not args.no_progress and "auto", "reading documents", total) as cb:
            result = prepare(
                args.source[0] if len(args.source) == 1 else args.source,
                args.out,
                subset=args.subset,
                revision=args.revision,
                allow_unpinned=args.allow_unpinned,
                hub_mirror=args.hub_mirror,
                max_docs=args.max_docs,
                max_bytes=args.max_bytes,
                salt_file=args.salt_file,
                dataset=args.dataset,
                license=args.license,
                force=args.force,
                shard_bytes=args.shard_bytes or SHARD_BYTES,
                progress=cb,
            )
    except DataError as exc:
        return _error("prepare", str(exc))
    except OSError as exc:  # e.g. no permission or no space to write the output
        return _error("prepare", f"{exc.filename or args.out}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        print(f"prism data prepare: interrupted; {args.out} was not written", file=sys.stderr)
        return 130
    m = result.manifest
    counts = ", ".join(f"{s} {m.documents(s):,} docs / {m.utf8_bytes(s):,} B" for s in m.split_names)
    print(f"wrote {m.root} ({counts}; {m.data.get('duplicates_dropped', 0)} duplicates dropped)")
    print(f"MANIFEST sha256 {m.sha256}")
    verb = "created" if result.salt_created else "reused"
    print(f"salt {verb}: {result.salt_file} (secret; keep it outside anything you publish)")
    return 0


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (dict, list)):
        import json

        return json.dumps(value, sort_keys=True)
    return str(value)


def cmd_info(args: argparse.Namespace) -> int:
    """``prism data info``: print the MANIFEST as tables and verify every shard."""
    from rich.console import Console
    from rich.table import Table

    from prism_challenge.data.manifest import load_manifest
    from prism_challenge.data.partition import read_salt_file

    try:
        m = load_manifest(args.dir)
    except DataError as exc:
        return _error("info", str(exc))
    console = Console(highlight=False)
    d = m.data
    head = Table(title=f"{args.dir / MANIFEST_NAME}", show_header=False, title_justify="left")
    head.add_column("field", style="bold")
    head.add_column("value", overflow="fold")
    source = d.get("source") or {}
    rows = [
        ("MANIFEST sha256", m.sha256),
        ("schema", d.get("schema")),
        ("tool", f"{(d.get('tool') or {}).get('name')} {(d.get('tool') or {}).get('version')}"),
        ("source", source.get("kind")),
        ("dataset", d.get("dataset")),
        ("subset", d.get("subset")),
        ("revision", d.get("revision")),
        ("license", d.get("license")),
        ("salt sha256", d.get("salt_sha256")),
        ("documents read", d.get("documents_read")),
        ("UTF-8 bytes read", d.get("utf8_bytes_read")),
        ("duplicates dropped", d.get("duplicates_dropped")),
        ("columns", ", ".join(d.get("columns") or [])),
        ("limits", f"max_docs={_fmt(source.get('max_docs'))} max_bytes={_fmt(source.get('max_bytes'))}"),
    ]
    for f in source.get("files") or []:
        rows.append(("file", f"{f.get('path')}: {f.get('documents_read', 0):,} docs read"
                     + (f" sha256 {f['sha256']}" if f.get("sha256") else "")))
    for k, v in rows:
        head.add_row(k, _fmt(v) if not isinstance(v, int) else f"{v:,}")
    console.print(head)

    failures: list[str] = []
    table = Table(title="splits", title_justify="left")
    for col in ("split", "shards", "documents", "UTF-8 bytes", "verified"):
        table.add_column(col, justify="right" if col in ("shards", "documents", "UTF-8 bytes") else "left")
    shard_rows = []
    for name in m.split_names:
        status = "skipped" if args.no_verify else "ok"
        for shard in m.shards(name):
            state = "-"
            if not args.no_verify:
                try:
                    m.verify_shard(shard)
                    state = "ok"
                except DataError as exc:
                    failures.append(str(exc))
                    status = state = "FAILED"
            shard_rows.append((name, shard["path"], shard.get("documents"), shard.get("utf8_bytes"), shard["sha256"], state))
        table.add_row(name, f"{len(m.shards(name)):,}", f"{m.documents(name):,}", f"{m.utf8_bytes(name):,}", status)
    console.print(table)
    if args.shards:
        st = Table(title="shards", title_justify="left")
        for col in ("split", "path", "documents", "UTF-8 bytes", "sha256", "verified"):
            st.add_column(col)
        for r in shard_rows:
            st.add_row(*(_fmt(x) for x in r))
        console.print(st)
    if args.salt_file is not None:
        try:
            m.check_salt(read_salt_file(args.salt_file))
            console.print(f"salt {args.salt_file}: matches salt_sha256")
        except DataError as exc:
            failures.append(str(exc))
    for msg in failures:
        _error("info", msg)
    return 1 if failures else 0


def cmd_cache(args: argparse.Namespace) -> int:
    """``prism data cache``: build or verify the train split's token cache."""
    from prism_challenge.data.cache import ensure_token_cache, token_cache_dir
    from prism_challenge.data.manifest import load_manifest
    from prism_challenge.data.progress import progress_callback
    from prism_challenge.tokenizers import TokenizerError, reference_tokenizer

    try:
        tok = reference_tokenizer(args.tokenizer)
        m = load_manifest(args.dir)
        path = token_cache_dir(m, tok)
        with progress_callback(not args.no_progress and "auto", f"tokenizing train ({tok.name})",
                               m.utf8_bytes("train")) as cb:
            cache = ensure_token_cache(m, tok, workers=args.workers, progress=cb)
    except (DataError, TokenizerError) as exc:
        return _error("cache", str(exc))
    except OSError as exc:
        return _error("cache", f"{exc.filename or args.dir}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        print("prism data cache: interrupted; no cache was written", file=sys.stderr)
        return 130
    print(f"{path}: {cache.n_documents:,} documents, {cache.n_tokens:,} tokens, {cache.utf8_bytes:,} bytes (verified)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``prism data ...`` alone (the ``prism`` CLI wires :func:`add_data_parser` itself)."""
    parser = argparse.ArgumentParser(prog="prism")
    sub = parser.add_subparsers(dest="command")
    sub.required = True
    add_data_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
