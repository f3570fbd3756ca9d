"""What the service does with a submitted zip before it is stored (issue 17, item 3).

1. :func:`~prism_challenge.service.archive.extract_bundle`: the zip rules (bombs, paths,
   symlinks, duplicates) and the bundle's intake rules.
2. The static gates (:func:`prism_challenge.gates.core.run_gates`: ``prism.yaml``, syntax, the
   AST sandbox, the multi-GPU contract for the profile's ``nproc``), with the parameter cap only
   when the settings ask for it (it builds the model in a sandboxed child; the evaluation runs
   it anyway). A blocking finding refuses the bundle with every finding (rule, file, line).
3. The profile's tokenizers: a bundle declaring another is refused here, not after a queue.
4. The hashes: :func:`source_sha256` (duplicates) and
   :func:`~prism_challenge.service.families.family_sha256` (the family: the architecture file
   and the bundle modules it imports; a public one has no author).

Normalized source: each ``.py`` file parsed with :mod:`ast`, every docstring (the first
statement of a module, class or function body when it is a string constant) removed, then
:func:`ast.unparse`d, which drops comments and layout; ``prism.yaml`` as what it declares (the
two entrypoints, the tokenizer, ``scoring_autocast``: ``name`` and ``description`` change no
score, and the document itself is never re-serialized, so YAML aliases cannot expand). ``.md`` and ``.txt`` files are left out: the gates refuse file access
(``prism:no-filesystem``), so a bundle's code cannot read them and they cannot change a score.
The digest is sha256 over the sorted lines ``path NUL sha256(normalized) LF``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from prism_challenge import scratch
from prism_challenge.intake.bundle import BundleError
from prism_challenge.intake.spec import SPEC_FILE, read_spec_full
from prism_challenge.gates.findings import Finding
from prism_challenge.profiles import Profile
from prism_challenge.service.archive import ArchiveError, extract_bundle
from prism_challenge.service.families import family_sha256
from prism_challenge.service.settings import ServiceSettings


class IntakeRefused(ValueError):
    """A bundle refused at intake.

    Attributes:
        code: ``gates-refused``, ``tokenizer-not-allowed``, ``bad-bundle`` or an
            :class:`~prism_challenge.service.archive.ArchiveError` code.
        message: what is wrong (file and line where known).
        stage: ``intake`` (the archive, the bundle's files) or ``gates``.
        rule: the rule id (``prism:syntax``), the first blocking finding's for ``gates-refused``.
        findings: every gate finding (``Finding.to_dict()``), blocking or advisory.
    """

    def __init__(self, code: str, message: str, *, stage: str, rule: str, findings: list[dict] | None = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.stage, self.rule = code, message, stage, rule
        self.findings = list(findings or [])


@dataclass(frozen=True)
class Intake:
    """A bundle the intake accepted: its hashes, its tokenizer and the advisory findings."""

    source_sha256: str
    family_sha256: str
    bundle_sha256: str
    tokenizer: str
    findings: list[dict] = field(default_factory=list)


def strip_docstrings(tree: ast.Module) -> ast.Module:
    """``tree`` with every docstring statement removed (in place; an emptied body gets ``pass``)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def normalized_python(text: str, rel: str) -> str:
    """The normalized source of one ``.py`` file (no comments, docstrings or layout).

    Raises:
        IntakeRefused: ``bad-bundle`` when the file cannot be parsed or unparsed (the gates
            refuse such a file first; this is the backstop).
    """
    try:
        return ast.unparse(strip_docstrings(ast.parse(text, filename=rel)))
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise IntakeRefused("bad-bundle", f"{rel}: cannot be normalized ({type(exc).__name__})", stage="intake",
                            rule="prism:syntax") from None


def _normalized_file(root: Path, rel: str) -> str | None:
    text = (root / rel).read_text(encoding="utf-8-sig")
    if rel.endswith(".py"):
        return normalized_python(text, rel)
    if rel == SPEC_FILE:  # what it declares, never the document itself (YAML aliases could expand it
        arch, train, tokenizer, autocast = read_spec_full(root)  # exponentially: "billion laughs")
        # not declared (None since issue 26: the profile's applies) reads as before, "fp32": the digests of
        # bundles stored earlier stay what they were, and declaring the old default changes no family
        return json.dumps([f"{arch.file}:{arch.symbol}", f"{train.file}:{train.symbol}", tokenizer, autocast or "fp32"])
    return None  # .md, .txt: unreadable by the bundle's code


def _digest(lines: dict[str, str]) -> str:
    h = hashlib.sha256()
    for rel in sorted(lines):
        h.update(f"{rel}\0{hashlib.sha256(lines[rel].encode()).hexdigest()}\n".encode())
    return h.hexdigest()


def source_sha256(root: Path, files: list[str]) -> str:
    """sha256 of the bundle's normalized source (see the module's docstring); ``files`` are
    bundle-relative POSIX paths."""
    out = {}
    for rel in files:
        norm = _normalized_file(root, rel)
        if norm is not None:
            out[rel] = norm
    return _digest(out)


def _refusal(findings: list[Finding]) -> IntakeRefused:
    blocking = [f for f in findings if f.blocking]
    first = blocking[0]
    lines = "; ".join(f"{f.location}: {f.rule}: {f.message}" for f in blocking[:5])
    more = f" (and {len(blocking) - 5} more)" if len(blocking) > 5 else ""
    return IntakeRefused("gates-refused", f"{len(blocking)} blocking finding(s): {lines}{more}", stage="gates",
                         rule=first.rule, findings=[f.to_dict() for f in findings])


def run_intake(data: bytes, settings: ServiceSettings, profile: Profile) -> Intake:
    """Unpack, gate and hash one submitted zip (nothing is stored).

    Raises:
        IntakeRefused: the bundle is refused (code, stage, rule and findings say why).
        prism_challenge.evaluator.isolation.IsolationError: the parameter cap was asked for and
            strict isolation is not available (the service's fault: a 500 is right).
    """
    from prism_challenge.gates.core import run_gates

    with tempfile.TemporaryDirectory(prefix="prism-intake-", dir=scratch.root()) as tmp:
        try:
            root = extract_bundle(data, Path(tmp) / "bundle", max_files=settings.max_bundle_files,
                                  max_bytes=settings.max_bundle_bytes, max_ratio=settings.max_bundle_ratio)
        except ArchiveError as exc:
            raise IntakeRefused(exc.code, exc.message, stage="intake", rule=exc.rule) from None
        opts = profile.options
        try:
            report = run_gates(root, max_parameters=opts.get("max_parameters", 150_000_000),
                               nproc=opts.get("nproc", 1), seq_len=opts.get("seq_len", 256),
                               check_params=settings.intake_parameter_check, param_timeout_s=settings.intake_timeout_s)
        except BundleError as exc:
            raise IntakeRefused("bad-bundle", str(exc).replace(str(root) + "/", ""), stage="intake",
                                rule=exc.rule) from None
        try:
            if report.blocking:
                raise _refusal(report.findings)
            bundle = report.bundle
            if bundle.tokenizer not in profile.tokenizers:
                raise IntakeRefused("tokenizer-not-allowed", f"prism.yaml: tokenizer {bundle.tokenizer!r} is not "
                                    f"allowed by profile {profile.name} (allowed: {', '.join(profile.tokenizers)})",
                                    stage="intake", rule="prism:tokenizer")
            files = sorted(bundle.file_hashes)
            return Intake(source_sha256=source_sha256(bundle.root, files),
                          family_sha256=family_sha256(bundle.root, bundle.architecture.file),
                          bundle_sha256=bundle.sha256, tokenizer=bundle.tokenizer,
                          findings=[f.to_dict() for f in report.findings])
        finally:
            report.cleanup()


__all__ = ["Intake", "IntakeRefused", "family_sha256", "normalized_python", "run_intake", "source_sha256",
           "strip_docstrings"]
