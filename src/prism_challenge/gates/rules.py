"""The gate rule ids: stable names, one line each.

Intake rules are raised as :class:`prism_challenge.intake.bundle.BundleError` (``.rule``): the bundle
cannot be read and ``prism check`` exits 2. Every other rule is a
:class:`prism_challenge.gates.Finding` (exit 1 when it blocks).
"""

from __future__ import annotations

INTAKE_RULES: dict[str, str] = {
    "prism:bundle-unreadable": "the path is not a bundle directory or .zip, or cannot be read",
    "prism:bad-zip": "the file is not a valid zip, or a member is encrypted or unsupported",
    "prism:too-many-files": "more files (zip members) than the intake limit",
    "prism:zip-absolute-path": "a zip member name is absolute (/x, \\x, C:x)",
    "prism:zip-parent-path": "a zip member name has a '..' component",
    "prism:zip-escape": "a zip member would land outside the extraction directory",
    "prism:zip-duplicate": "two zip members have the same name",
    "prism:zip-ratio": "a zip member's compression ratio is too high (zip bomb)",
    "prism:zip-too-large": "zip members expand past the archive limit (zip bomb)",
    "prism:symlink": "a symlink in the bundle or a symlink zip member",
    "prism:special-file": "a bundle entry that is not a regular file or directory",
    "prism:bad-suffix": "a file of another kind than .py, .md, .txt or prism.yaml",
    "prism:bytecode": "a __pycache__ folder or a .pyc/.pyo file (a bundle is source only)",
    "prism:binary-file": "a file holds a NUL byte (a bundle holds text files only)",
    "prism:not-utf8": "a file is not valid UTF-8 (the line and byte offset are named)",
    "prism:bad-name": "a file or folder name is not valid UTF-8 or holds a control character",
    "prism:module-name": "a .py path that is not made of Python identifiers",
    "prism:shadow-module": "a top-level module or code folder named like a module importable from elsewhere",
    "prism:source-too-large": "bundle files exceed the total source cap (default 512 KiB)",
}

FINDING_RULES: dict[str, str] = {
    # bundle shape
    "prism:spec": "prism.yaml is malformed, names one file twice, or an unknown tokenizer",
    "prism:missing-entrypoint": "a declared entrypoint file is missing",
    "prism:missing-symbol": "an entrypoint file does not define its declared symbol",
    "prism:encoding": "a source file is not UTF-8 (or declares another encoding)",
    "prism:syntax": "a source file does not parse",
    # AST sandbox
    "prism:import-not-allowed": "an import outside the allowlist (or a star import)",
    "prism:not-a-package": "an import from (or an entrypoint in) a bundle folder without __init__.py",
    "prism:no-network": "network access (socket, http, urllib, torch.hub, rpc, ...)",
    "prism:no-process": "process control (os, subprocess, multiprocessing, signal, exit, ...)",
    "prism:no-filesystem": "filesystem access (open, pathlib, shutil, from_file, tofile, ...)",
    "prism:no-ffi": "foreign code (ctypes, cffi, cpp_extension, load_library, jiterator, ...)",
    "prism:no-dynamic-code": "eval, exec, __import__, get_type_hints, torch.jit.script, torch.fx, ...",
    "prism:no-introspection": "frames, code, globals, builtins, class hierarchies, __dict__, id/hash addresses",
    "prism:no-interactive": "breakpoint, input, help",
    "prism:dynamic-attr": "computed attribute names (getattr, str.format) or modules used as values",
    "prism:no-pickle": "pickle-family loads (pickle, marshal, *_object collectives, __reduce__)",
    "prism:torch-io": "torch.load/torch.save not on a path built from ctx.artifacts_dir",
    "prism:torch-private": "a private (underscore) torch module or attribute",
    "prism:no-monkeypatch": "assigning into modules, classes, ctx or the harness; global hooks",
    "prism:ctx-private": "a private attribute of ctx or of the harness (ctx._runtime)",
    "prism:private-attr": "an underscore attribute on any object (x._y, x.__z__, getattr, format, match)",
    "prism:ctx-forge": "building a context or an artifacts_dir of one's own",
    "prism:determinism": "switching forced determinism or float precision (use_deterministic_algorithms, cudnn, TF32)",
    "prism:sharded-model": "FSDP, fully_shard, DTensor or a DeviceMesh: sharded models are not supported (use DDP)",
    "prism:not-allowlisted": "a path on an allowed module, or an attribute name, that is not on gates/allowlist.toml",
    "prism:too-complex": "a file too deeply nested (or too large) for the gate to parse or check",
    "prism:wall-clock": "the wall clock or a profiler (time, datetime, timeit, torch.profiler, torch.cuda.Event)",
    "prism:cuda-determinism": "an op that raises under forced determinism on CUDA only (advisory, under a CUDA device)",
    "prism:set-order": "iterating a set or frozenset (its order is its elements' hashes: memory addresses for tensors)",
    # multi-GPU contract
    "prism:ddp-init": "training.py never initializes the process group",
    "prism:ddp-wrap": "training.py never wraps the model in DDP",
    "prism:ddp-rank0-write": "a write (torch.save) is not guarded by a rank-0 test",
    "prism:ddp-destroy": "training.py never destroys the process group",
    "prism:launch-limit": "more than 8 processes, several nodes, or a non-local rendezvous",
    # parameter cap (bounded child)
    "prism:param-cap": "unique parameter+buffer elements exceed the cap",
    "prism:param-lazy": "a lazy parameter or buffer is still uninitialized after one forward",
    "prism:build-error": "build_model(ctx) or its first forward raised",
    "prism:build-timeout": "build_model(ctx) and one forward ran past the time limit",
    "prism:build-memory": "build_model(ctx) and one forward ran past the memory limit",
}

RULES: dict[str, str] = {**INTAKE_RULES, **FINDING_RULES}
"""Every rule id -> its one-line description."""

CONTRACT_RULES = frozenset(
    {
        "prism:ddp-init",
        "prism:ddp-wrap",
        "prism:ddp-rank0-write",
        "prism:ddp-destroy",
        "prism:launch-limit",
    }
)
"""Rules about how the bundle is launched; they do not make its code unsafe to execute."""
