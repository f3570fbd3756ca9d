"""``run_gates``: every static gate in order, before any training.

1. intake (:func:`prism_challenge.intake.bundle.open_bundle`): directory or hardened ``.zip``, UTF-8
   text files only, no module named like one importable from elsewhere;
2. ``prism.yaml``, entrypoint files and symbols, UTF-8 and syntax of every own ``.py``
   (:mod:`prism_challenge.gates.ownmodules`: no import from a folder without ``__init__.py``);
3. the AST sandbox (:mod:`prism_challenge.gates.sandbox`);
4. the multi-GPU contract and launch limits (:mod:`prism_challenge.gates.contract`);
5. the parameter cap in a bounded child (:mod:`prism_challenge.gates.param_count`), only when
   nothing above makes the code unsafe to execute.
"""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prism_challenge.evaluator.jail import Jail

from prism_challenge.intake.bundle import Bundle, BundleError
from prism_challenge.intake.refusal import IntakeLimits
from prism_challenge.intake.spec import Entrypoint, read_spec
from prism_challenge.intake.tree import hash_tree
from prism_challenge.intake.frozen import freeze
from prism_challenge.gates.astindex import BundleIndex
from prism_challenge.gates.complexity import deepest, guarded
from prism_challenge.gates.contract import check_contract, launch_findings
from prism_challenge.gates.cudadeterminism import cuda_determinism_findings, is_cuda
from prism_challenge.gates.findings import Finding, GateReport
from prism_challenge.gates.ownmodules import is_own_module, with_not_a_package
from prism_challenge.gates.parsing import defines_symbol, parse_source
from prism_challenge.gates.rules import CONTRACT_RULES
from prism_challenge.gates.sandbox import check_modules
from prism_challenge.gates.scopebuild import build_module
from prism_challenge.gates.scopes import ModuleInfo, module_name

DEFAULT_MAX_PARAMETERS = 150_000_000
_FALLBACK_VOCAB = {"gpt2": 50257, "bytes": 257}
_CHILD_RULES = {
    "timeout": "prism:build-timeout",
    "memory": "prism:build-memory",
    "tasks": "prism:build-tasks",
    "audit": "prism:audit",
    "lazy": "prism:param-lazy",
}


def tokenizer_vocab_size(name: str) -> int | None:
    """V of a reference tokenizer name, or ``None`` when the name is unknown."""
    try:
        from prism_challenge.tokenizers import vocab_size_of
    except ImportError:  # the tokenizers module ships with the harness; keep the gate standalone
        return _FALLBACK_VOCAB.get(name)
    try:
        return vocab_size_of(name)
    except (ValueError, KeyError):
        return None


def run_gates(
    path: str | os.PathLike[str],
    *,
    max_parameters: int = DEFAULT_MAX_PARAMETERS,
    nproc: int = 1,
    nnodes: int = 1,
    param_timeout_s: float = 60.0,
    param_memory_bytes: int = 8 << 30,
    vocab_size: int | None = None,
    seq_len: int = 256,
    check_params: bool = True,
    limits: IntakeLimits = IntakeLimits(),
    isolation: str = "strict",
    device: str | None = None,
) -> GateReport:
    """Run every gate over a bundle directory or ``.zip``; execute nothing but the bounded
    parameter-count child.

    Args:
        path: bundle directory or ``.zip`` file.
        max_parameters: parameter cap (unique storage elements of parameters and buffers).
        nproc: processes (GPUs) the run will use; > 1 makes the multi-GPU contract blocking
            (at 1 its findings are advisories); > 8 is a ``prism:launch-limit`` finding.
        nnodes: nodes requested; > 1 is a ``prism:launch-limit`` finding.
        param_timeout_s: wall-clock limit of the parameter-count child in seconds.
        param_memory_bytes: address-space limit of that child in bytes.
        isolation: ``"strict"``: the parameter child runs in the sandbox every process that
            runs submitted code gets (:func:`prism_challenge.gates.param_parent.check_jail`);
            ``"none"``: without it (local work only).
        vocab_size: ``ctx.vocab_size`` for ``build_model``; default the bundle tokenizer's V.
        seq_len: ``ctx.sequence_length`` for ``build_model``.
        check_params: whether to run the parameter-count child at all.
        limits: intake limits.
        device: the device the run will use (``"cpu"``, ``"cuda"``, ``"auto"``; ``None``: not
            said). On CUDA, each call of an op that raises under forced determinism on CUDA
            only is an advisory ``prism:cuda-determinism`` finding
            (:mod:`prism_challenge.gates.cudadeterminism`).

    Returns:
        the report. For a ``.zip`` whose ``prism.yaml`` parsed, ``report.bundle.root`` lies in a
        fresh temporary directory (``report.extracted_dir``) that the caller owns and removes
        with :meth:`GateReport.cleanup`; when the report has no bundle that directory is
        already removed.

    Raises:
        BundleError: the bundle cannot be read (missing path, not a zip, an intake rule): the
            message names the file or member, ``.rule`` the rule. Nothing is left on disk.
        ValueError: ``nproc`` or ``nnodes`` below 1.
        RuntimeError: the harness could not run the parameter-count child.
        prism_challenge.evaluator.isolation.IsolationError: strict isolation is not available
            for the parameter child.
    """
    request = launch_findings(nproc, nnodes)
    frozen = freeze(path, limits)  # the gates and the parameter child read one read-only copy
    root, extracted = frozen.root, frozen.holder
    try:
        report = _gate(
            root,
            request,
            max_parameters=max_parameters,
            nproc=nproc,
            param_timeout_s=param_timeout_s,
            param_memory_bytes=param_memory_bytes,
            vocab_size=vocab_size,
            seq_len=seq_len,
            check_params=check_params,
            isolation=isolation,
            device=device,
        )
    except BaseException:
        frozen.remove()
        raise
    report.source = str(path)
    # name files as the user knows them (some.zip:architecture.py), never the temporary copy
    report.findings = [_unextracted(f, root, extracted, str(path)) for f in report.findings]
    if report.bundle is None:
        frozen.remove()
    else:
        report.own(extracted)  # removed by cleanup(), or with the report at the latest
    return report


def _unextracted(finding: Finding, root: Path, extracted: Path, source: str) -> Finding:
    """``finding`` with the temporary extraction path in its message replaced by ``source:``."""
    message = finding.message
    places = {str(root), str(extracted), str(root.resolve()), str(extracted.resolve())}
    for where in sorted(places, key=len, reverse=True):  # the bundle root before its parent
        message = message.replace(where + os.sep, f"{source}:").replace(where, source)
    return finding if message == finding.message else dataclasses.replace(finding, message=message)


def _gate(
    root: Path,
    request: list[Finding],
    *,
    max_parameters: int,
    nproc: int,
    param_timeout_s: float,
    param_memory_bytes: int,
    vocab_size: int | None,
    seq_len: int,
    check_params: bool,
    isolation: str,
    device: str | None = None,
) -> GateReport:
    findings = list(request)
    hashes = hash_tree(root)
    bundle: Bundle | None = None
    try:
        arch, train, tokenizer = read_spec(root)
        bundle = Bundle(root, arch, train, tokenizer, hashes)
    except BundleError as exc:
        findings.append(Finding(exc.rule, "prism.yaml", exc.line, 0, str(exc)))

    entries: dict[str, tuple[Entrypoint, str]] = {}
    if bundle is not None:
        for ep, what in ((bundle.architecture, "architecture"), (bundle.training, "training")):
            entries[ep.file] = (ep, what)
            if ep.file not in hashes:
                findings.append(
                    Finding("prism:missing-entrypoint", ep.file, 0, 0, f"{what} entrypoint file {ep.file} is missing")
                )

    modules: list[ModuleInfo] = []
    trees: dict[str, ast.Module] = {}
    for rel in sorted(hashes):
        if not is_own_module(rel, hashes):  # a folder without __init__.py: never imported (see below)
            continue
        data = (root / rel).read_bytes()
        parsed, failed = guarded(rel, lambda: 0, lambda: parse_source(rel, data))
        text, tree, problems = parsed if parsed is not None else (None, None, [failed])
        findings.extend(problems)
        info, failed = None, None
        if tree is not None and text is not None:
            symbols = {entries[rel][0].symbol} if rel in entries else set()
            info, failed = guarded(rel, lambda: deepest(tree)[1], lambda: build_module(rel, text, tree, symbols))
        if info is None or tree is None:
            findings.extend([failed] if failed is not None else [])
            # an empty stand-in keeps the file a bundle module: its importers are not also refused
            modules.append(build_module(rel, "", ast.parse(""), ()))
            continue
        trees[rel] = tree
        modules.append(info)

    for rel, (ep, what) in sorted(entries.items()):
        if rel in trees and not defines_symbol(trees[rel], ep.symbol):
            findings.append(
                Finding("prism:missing-symbol", rel, 0, 0, f"{rel} does not define the {what} entrypoint {ep.symbol!r}")
            )

    entry_files = [(ep.file, what) for ep, what in entries.values()]
    findings.extend(_checked(modules, bundle, trees, nproc, hashes, entry_files))
    if is_cuda(device):
        findings.extend(_cuda_determinism(modules, trees))

    if bundle is not None and vocab_size is None:
        vocab_size = tokenizer_vocab_size(bundle.tokenizer)
        if vocab_size is None:
            findings.append(
                Finding("prism:spec", "prism.yaml", 0, 0, f"unknown tokenizer {bundle.tokenizer!r}")
            )

    param_count: int | None = None
    unsafe = any(f.blocking and f.rule not in CONTRACT_RULES for f in findings)
    if check_params and bundle is not None and not unsafe and vocab_size is not None:
        found, param_count = parameter_gate(
            bundle, vocab_size=vocab_size, seq_len=seq_len, max_parameters=max_parameters,
            timeout_s=param_timeout_s, memory_bytes=param_memory_bytes, isolation=isolation,
            tree=trees.get(bundle.architecture.file),
        )
        findings.extend(found)
    findings.sort(key=lambda f: (f.file, f.line, f.col, f.rule, f.message))
    return GateReport(bundle, findings, param_count, max_parameters)


def _checked(
    modules: list[ModuleInfo], bundle: Bundle | None, trees: dict[str, ast.Module], nproc: int,
    files: dict[str, str], entry_files: list[tuple[str, str]],
) -> list[Finding]:
    """The AST sandbox (with the bundle's folders that are not packages,
    :func:`~prism_challenge.gates.ownmodules.with_not_a_package`) and the multi-GPU contract over
    the parsed modules.

    Never raises: a step that fails (a recursion too deep for the gate, memory) becomes a
    ``prism:too-complex`` finding in the file it was checking (see
    :mod:`prism_challenge.gates.complexity`)."""
    first = modules[0].rel if modules else ""
    index, failed = guarded(first, lambda: 0, lambda: BundleIndex(modules))
    if index is None:
        return [failed] if failed is not None else []
    out: list[Finding] = []
    for step in (lambda: with_not_a_package(check_modules(index), index, files, entry_files),):
        found, failed = guarded(first, lambda: 0, step)
        out.extend(found or [])
        if failed is not None:
            out.append(failed)
    if bundle is not None and bundle.training.file in trees:
        train = bundle.training
        found, failed = guarded(
            train.file,
            lambda: deepest(trees[train.file])[1],
            lambda: check_contract(index, module_name(train.file), train.file, train.symbol, blocking=nproc > 1),
        )
        out.extend(found or [])
        if failed is not None:
            out.append(failed)
    return out


def _cuda_determinism(modules: list[ModuleInfo], trees: dict[str, ast.Module]) -> list[Finding]:
    """Advisories for the ops that raise under forced determinism on CUDA only; a module the
    scan fails on (it never should) is skipped: these findings only warn."""
    from prism_challenge.gates.sandbox import Checker

    index, _ = guarded("", lambda: 0, lambda: BundleIndex(modules))
    out: list[Finding] = []
    for info in modules if index is not None else []:
        if info.rel in trees:
            found, _ = guarded(info.rel, lambda: 0,
                               lambda i=info: cuda_determinism_findings(Checker(index, i), trees[i.rel], i.rel))
            out.extend(found or [])
    return out


def parameter_gate(
    bundle: Bundle,
    *,
    vocab_size: int,
    seq_len: int = 256,
    max_parameters: int = DEFAULT_MAX_PARAMETERS,
    timeout_s: float = 60.0,
    memory_bytes: int = 8 << 30,
    jail: Jail | None = None,
    isolation: str = "strict",
    tree: ast.Module | None = None,
    context: dict | None = None,
) -> tuple[list[Finding], int | None]:
    """The parameter cap: build the model in the bounded child and count what it holds.

    Run it only on a bundle whose AST gates passed (it executes ``build_model``). Returns the
    findings (``prism:param-cap``, or why the child could not count: build error, timeout,
    memory, lazy modules) and the count of unique parameter and buffer elements (``None`` when
    the child could not count). ``tree``: the parsed architecture file, for the finding's line.
    ``jail``: where the child runs (the run's jail in ``prism eval``); default one of
    ``isolation`` with ``memory_bytes`` (:func:`~prism_challenge.gates.param_parent.check_jail`).
    A child the audit hook stopped is a ``prism:audit`` finding that names the event.
    ``context``: the run's context values (``prism eval``; see
    :func:`~prism_challenge.gates.param_parent.measure_parameters`).

    Raises:
        RuntimeError: the harness could not run the child.
    """
    # imported here: the child runs this very module with -m, which must not be imported first
    from prism_challenge.gates.param_parent import check_jail, measure_parameters

    arch = bundle.architecture
    result = measure_parameters(
        bundle.root,
        arch.module,
        arch.symbol,
        vocab_size=vocab_size,
        seq_len=seq_len,
        max_parameters=max_parameters,
        tokenizer=bundle.tokenizer,
        timeout_s=timeout_s,
        jail=jail or check_jail(bundle.root, isolation, memory_bytes=memory_bytes),
        context=context,
    )
    if tree is None:
        try:
            tree = ast.parse((bundle.root / arch.file).read_bytes())
        except (OSError, SyntaxError, ValueError):
            tree = None
    line = _def_line(tree, arch.symbol)
    if result.kind == "harness":
        raise RuntimeError(f"parameter-count child could not build a context: {result.error}")
    if result.count is None:
        rule = _CHILD_RULES.get(result.kind or "", "prism:build-error")
        where, at = raised_at(bundle.root, result.detail, arch.file, line)
        return [Finding(rule, where, at, 0, f"{_CHILD_STAGES.get(result.kind or '', arch.symbol + '(ctx)')}: "
                                            f"{result.error}")], None
    if result.count > max_parameters:
        return [Finding("prism:param-cap", arch.file, line, 0,
                        f"{result.count:,} unique parameter and buffer elements exceed the cap of {max_parameters:,}")
                ], result.count
    return [], result.count


_CHILD_STAGES = {
    "import": "importing the architecture",
    "forward": "the first forward pass (model(tokens), tokens [1, 8], under torch.no_grad())",
}
"""How a parameter-child finding names the step that failed, by kind (else ``build_model(ctx)``)."""


def raised_at(root: Path, detail: dict[str, Any], default_file: str, default_line: int) -> tuple[str, int]:
    """The bundle file and line a parameter child's error was raised at (its ``file`` and
    ``line``, :func:`~prism_challenge.gates.param_count.bundle_frame`), or the defaults when the
    child named none or named something that is not a file of the bundle: the child ran
    submitted code, so its words are checked (a relative path to a file under ``root``, a line
    number >= 1)."""
    file, line = detail.get("file"), detail.get("line")
    if not isinstance(file, str) or type(line) is not int or line < 1 or not file or file.startswith("/"):
        return default_file, default_line
    try:
        inside = (root / file).resolve().is_relative_to(root.resolve()) and (root / file).is_file()
    except (OSError, ValueError):
        inside = False
    return (file, line) if inside else (default_file, default_line)


def _def_line(tree: ast.Module | None, symbol: str) -> int:
    if tree is None:
        return 0
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == symbol:
            return stmt.lineno
    return 0
