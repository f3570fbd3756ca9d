"""``prism.yaml``: a bundle's declared entrypoints, tokenizer and scoring autocast.

:func:`read_spec_full` reads the optional spec file of a bundle directory (the fields are listed
in :mod:`prism_challenge.intake.bundle`); a malformed file, an unknown field or a bad value is a
:class:`~prism_challenge.intake.refusal.BundleError` with rule ``prism:spec`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from prism_challenge.intake.refusal import BundleError

SPEC_FILE = "prism.yaml"
DEFAULT_ARCHITECTURE = ("architecture.py", "build_model")
DEFAULT_TRAINING = ("training.py", "train")
DEFAULT_TOKENIZER = "gpt2"
SCORING_AUTOCAST = ("fp32", "bf16", "fp16")
"""``scoring_autocast`` values: the dtype the harness's scoring forwards run under
``torch.autocast`` (stream, probes, held-out, audit); ``fp32`` is no autocast. Not declared: the
profile's ``[scoring] autocast`` (``EvalOptions.scoring_autocast``)."""
DEFAULT_SCORING_AUTOCAST = None


@dataclass(frozen=True)
class Entrypoint:
    """A ``file:symbol`` pair inside the bundle (``file`` relative to the bundle root)."""

    file: str
    symbol: str

    @property
    def module(self) -> str:
        """Import name of the file (its path without ``.py``, dots for separators)."""
        return self.file[: -len(".py")].replace("/", ".")


def _spec_error(message: str, line: int = 0) -> BundleError:
    return BundleError(message, rule="prism:spec", line=line)


def _yaml_error(exc: yaml.YAMLError) -> BundleError:
    """One line for PyYAML's multi-line error: ``prism.yaml line N: not valid YAML: <problem>``."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or not problem:
        return _spec_error(f"{SPEC_FILE}: not valid YAML: {' '.join(str(exc).split())}")
    line = mark.line + 1
    message = f"{SPEC_FILE} line {line}: not valid YAML: {' '.join(str(problem).split())}"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None and context_mark.line != mark.line:
        message += f" ({' '.join(str(context).split())} from line {context_mark.line + 1})"
    return _spec_error(message, line)


def _parse_entrypoint(spec: object, default: tuple[str, str], where: str) -> Entrypoint:
    if spec is None:
        return Entrypoint(*default)
    if isinstance(spec, str):
        file, _, symbol = spec.partition(":")
        symbol = symbol or default[1]
    elif isinstance(spec, dict):
        file = spec.get("file", default[0])
        symbol = spec.get("symbol", default[1])
    else:
        raise _spec_error(f"{SPEC_FILE}: field '{where}' must be 'file.py:symbol' or a mapping")
    if not isinstance(file, str) or not isinstance(symbol, str):
        raise _spec_error(f"{SPEC_FILE}: field '{where}' must name a file and a symbol as strings")
    if not file.endswith(".py") or file.startswith("/") or ".." in Path(file).parts:
        raise _spec_error(
            f"{SPEC_FILE}: field '{where}' must name a .py file inside the bundle, got {file!r}"
        )
    if not all(part.isidentifier() for part in file[: -len(".py")].split("/")):
        raise _spec_error(
            f"{SPEC_FILE}: field '{where}' file {file!r} is not an importable module path"
        )
    if not symbol.isidentifier():
        raise _spec_error(f"{SPEC_FILE}: field '{where}' symbol {symbol!r} is not an identifier")
    return Entrypoint(file, symbol)


def read_spec(root: Path) -> tuple[Entrypoint, Entrypoint, str]:
    """Read ``prism.yaml`` (if any) and return (architecture, training, tokenizer name).

    Raises:
        BundleError: see :func:`read_spec_full`.
    """
    return read_spec_full(root)[:3]


def read_spec_full(root: Path) -> tuple[Entrypoint, Entrypoint, str, str | None]:
    """Read ``prism.yaml`` (if any): (architecture, training, tokenizer name, scoring autocast).

    ``scoring_autocast`` is one of :data:`SCORING_AUTOCAST`, or ``None`` when not declared (the
    run's profile then chooses, ``EvalOptions.scoring_autocast``).

    Raises:
        BundleError: (rule ``prism:spec``) malformed YAML (one line,
            ``prism.yaml line N: not valid YAML: <problem>``, with ``.line`` set), unknown
            fields, bad values, or both entrypoints in one file; the message names the field.
    """
    path = root / SPEC_FILE
    data: dict = {}
    if path.is_file():
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise _yaml_error(exc) from None
        except UnicodeDecodeError as exc:
            raise _spec_error(f"{SPEC_FILE}: not valid UTF-8 (byte {exc.start})") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise _spec_error(f"{SPEC_FILE}: the top level must be a mapping")
        data = loaded
    unknown = set(data) - {"architecture", "training", "tokenizer", "scoring_autocast", "name", "description"}
    if unknown:
        raise _spec_error(f"{SPEC_FILE}: unknown field(s) {sorted(map(str, unknown))}")

    def _section(key: str) -> object:
        sec = data.get(key)
        if isinstance(sec, dict) and "entrypoint" in sec:
            return sec["entrypoint"]
        if sec is not None and not isinstance(sec, dict):
            raise _spec_error(f"{SPEC_FILE}: field '{key}' must be a mapping with 'entrypoint'")
        return None

    arch = _parse_entrypoint(_section("architecture"), DEFAULT_ARCHITECTURE, "architecture.entrypoint")
    train = _parse_entrypoint(_section("training"), DEFAULT_TRAINING, "training.entrypoint")
    tokenizer = data.get("tokenizer", DEFAULT_TOKENIZER)
    if not isinstance(tokenizer, str):
        raise _spec_error(f"{SPEC_FILE}: field 'tokenizer' must be a string")
    autocast = data.get("scoring_autocast", DEFAULT_SCORING_AUTOCAST)
    if autocast is not DEFAULT_SCORING_AUTOCAST and (not isinstance(autocast, str) or autocast not in SCORING_AUTOCAST):
        raise _spec_error(f"{SPEC_FILE}: field 'scoring_autocast' must be one of {', '.join(SCORING_AUTOCAST)} "
                          f"(the dtype of the harness's scoring forward under torch.autocast), got {autocast!r}")
    if arch.file == train.file:
        raise _spec_error(
            f"{SPEC_FILE}: architecture and training entrypoints must be distinct files "
            f"(both are {arch.file})"
        )
    return arch, train, tokenizer, autocast
