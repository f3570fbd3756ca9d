"""Challenge profiles: every setting that changes a score, in one versioned TOML file.

A profile (schema ``prism.profile.v1``, read with :mod:`tomllib`) names the data (a source, and
for FineWeb-Edu its pinned dataset, subset, revision and ``max_bytes``; or a data MANIFEST
sha256), the tokenizers allowed, ``seq_len`` (``ctx.max_seq_len``), the budgets (token, byte,
step, wall clock), ``nproc``, the device kind, the held-out bytes, the verdict policy, the
seed and the scoring precision (``[scoring] autocast``: the autocast dtype of the harness's
scoring forwards for a bundle whose ``prism.yaml`` declares no ``scoring_autocast``; ``fp32``,
no autocast, when the table is absent). Two ship with the package (:func:`profile_names`):
``local`` (the harness's defaults on the embedded corpus) and ``prism-v2`` (the challenge's
official settings).

``prism eval --profile NAME|FILE`` starts from a profile; a command-line option that sets a
different value overrides it and the run manifest records the field
(``profile: {name, sha256, overridden: [...]}``). The profile's sha256 is that of its file's bytes.
"""

from __future__ import annotations

import hashlib
import math
import tomllib
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from prism_challenge.intake.bundle import SCORING_AUTOCAST
from prism_challenge.score.verdict import Policy

SCHEMA = "prism.profile.v1"
DEFAULT_PROFILE = "local"
DEVICES = ("auto", "cpu", "cuda")
DATA_SOURCES = ("builtin", "fineweb-edu", "files")

# table -> key -> (EvalOptions attribute, accepted types, required)
_INT, _NUM = (int,), (int, float)
_FIELDS: dict[str, dict[str, tuple[str, tuple[type, ...], bool]]] = {
    "run": {
        "seq_len": ("seq_len", _INT, True),
        "nproc": ("nproc", _INT, True),
        "device": ("device", (str,), True),
        "seed": ("seed", _INT, True),
        "threads": ("threads", _INT, True),
        "max_parameters": ("max_parameters", _INT, True),
    },
    "budgets": {
        "token_budget": ("token_budget", _INT, False),
        "byte_budget": ("byte_budget", _INT, False),
        "step_budget": ("step_budget", _INT, False),
        "wall_clock_budget_s": ("wall_clock_budget", _NUM, False),
    },
    "heldout": {"bytes": ("heldout_bytes", _INT, True)},
    "scoring": {"autocast": ("scoring_autocast", (str,), False)},
}
_INT_POLICY = {"confirm_top_n", "confirm_runs"}  # Policy's integer knobs (the others are floats)
_DATA_KEYS = {"source": (str,), "dataset": (str,), "subset": (str,), "revision": (str,),
              "max_bytes": _INT, "manifest_sha256": (str,)}
_TOP_KEYS = {"schema", "name", "version", "description", "data", "tokenizers", "run", "budgets", "heldout", "policy",
             "scoring"}



class ProfileError(ValueError):
    """A profile that cannot be used: the message names the file, the field and the rule broken."""


@dataclass(frozen=True)
class DataPin:
    """What a profile says about the data (``None``: not pinned)."""

    source: str
    dataset: str | None = None
    subset: str | None = None
    revision: str | None = None
    max_bytes: int | None = None
    manifest_sha256: str | None = None


@dataclass(frozen=True)
class Profile:
    """A loaded profile.

    Attributes:
        name, version, description: from the file.
        sha256: hex sha256 of the file's bytes (recorded in the run manifest).
        path: where it was read from.
        data: the data pin.
        tokenizers: the reference tokenizers a bundle may declare.
        options: EvalOptions keyword arguments (``seq_len``, ``nproc``, ``device``, ``seed``,
            ``threads``, ``max_parameters``, the four budgets, ``heldout_bytes``, ``policy``,
            ``scoring_autocast``).
    """

    name: str
    version: int
    description: str
    sha256: str
    path: str
    data: DataPin
    tokenizers: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)


def profile_names() -> list[str]:
    """Names of the profiles shipped with the package, sorted."""
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".toml"))


def load_profile(name_or_path: str) -> Profile:
    """Load a shipped profile by name, or a profile file by path.

    Raises:
        ProfileError: unknown name, unreadable file, invalid TOML (line and column), or a field
            of the wrong type or range (named as ``FILE: [table] key``).
    """
    shipped = resources.files(__name__) / f"{name_or_path}.toml"
    if "/" not in name_or_path and not name_or_path.endswith(".toml") and shipped.is_file():
        raw, where = shipped.read_bytes(), f"profile {name_or_path!r}"
    else:
        p = Path(name_or_path)
        if not p.is_file():
            raise ProfileError(f"--profile {name_or_path}: no such profile (shipped: "
                               f"{', '.join(profile_names())}) and no such file")
        try:
            raw = p.read_bytes()
        except OSError as exc:
            raise ProfileError(f"{p}: cannot read the profile ({exc.strerror})") from None
        where = str(p)
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{where}: not valid TOML: {exc}") from None
    return _parse(doc, where, hashlib.sha256(raw).hexdigest())


def _check(where: str, key: str, value: Any, types: tuple[type, ...]) -> Any:
    if isinstance(value, bool) or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        raise ProfileError(f"{where}: {key} = {value!r}: must be {names}")
    if isinstance(value, (int, float)) and not (math.isfinite(value) and value >= 0):
        raise ProfileError(f"{where}: {key} = {value!r}: must be a finite number >= 0")
    return value


def _table(doc: dict[str, Any], where: str, name: str) -> dict[str, Any]:
    t = doc.get(name, {})
    if not isinstance(t, dict):
        raise ProfileError(f"{where}: [{name}] must be a table")
    return t


def _parse(doc: dict[str, Any], where: str, sha256: str) -> Profile:
    unknown = sorted(set(doc) - _TOP_KEYS)
    if unknown:
        raise ProfileError(f"{where}: unknown top-level key(s) {unknown}; allowed: {sorted(_TOP_KEYS)}")
    if doc.get("schema") != SCHEMA:
        raise ProfileError(f"{where}: schema = {doc.get('schema')!r}: must be {SCHEMA!r}")
    name = _check(where, "name", doc.get("name"), (str,))
    version = _check(where, "version", doc.get("version", 1), _INT)
    options: dict[str, Any] = {}
    for table, spec in _FIELDS.items():
        t = _table(doc, where, table)
        for key in sorted(set(t) - set(spec)):
            raise ProfileError(f"{where}: [{table}] {key}: unknown key; allowed: {sorted(spec)}")
        for key, (attr, types, required) in spec.items():
            if key not in t:
                if required:
                    raise ProfileError(f"{where}: [{table}] {key}: required")
                options[attr] = None
                continue
            options[attr] = _check(where, f"[{table}] {key}", t[key], types)
    if options["device"] not in DEVICES:
        raise ProfileError(f"{where}: [run] device = {options['device']!r}: must be one of {list(DEVICES)}")
    for attr in ("seq_len", "nproc", "threads", "max_parameters"):
        if options[attr] < 1:
            raise ProfileError(f"{where}: [run] {attr} = {options[attr]}: must be at least 1")
    if options["wall_clock_budget"] is not None:
        options["wall_clock_budget"] = float(options["wall_clock_budget"])
    if options["scoring_autocast"] is None:  # a profile without [scoring]: no autocast
        options["scoring_autocast"] = "fp32"
    if options["scoring_autocast"] not in SCORING_AUTOCAST:
        raise ProfileError(f"{where}: [scoring] autocast = {options['scoring_autocast']!r}: must be one of "
                           f"{list(SCORING_AUTOCAST)}")
    options["policy"] = _policy(_table(doc, where, "policy"), where)
    return Profile(name=name, version=version, description=str(doc.get("description", "")), sha256=sha256,
                   path=where, data=_data(_table(doc, where, "data"), where),
                   tokenizers=_tokenizers(_table(doc, where, "tokenizers"), where), options=options)


def _policy(t: dict[str, Any], where: str) -> Policy:
    known = set(asdict(Policy()))
    if "gap_threshold_bpb" in t:
        raise ProfileError(f"{where}: [policy] gap_threshold_bpb: no longer a setting: the memorization threshold "
                           "is measured in each run, max(gap_floor_bpb, gap_z * se_gap); set gap_z and gap_floor_bpb")
    if "rank_epsilon_bpb" in t:
        raise ProfileError(f"{where}: [policy] rank_epsilon_bpb: no longer a setting: runs within a width no longer "
                           "tie; the crown rule's Welch test decides first place at p < significance_p")
    for key in sorted(set(t) - known):
        raise ProfileError(f"{where}: [policy] {key}: unknown key; allowed: {sorted(known)}")
    values = {k: _check(where, f"[policy] {k}", v, _INT if k in _INT_POLICY else _NUM) for k, v in t.items()}
    for key in _INT_POLICY & set(values):
        if values[key] < (1 if key == "confirm_runs" else 0):
            raise ProfileError(f"{where}: [policy] {key} = {values[key]}: must be at least "
                               f"{1 if key == 'confirm_runs' else 0}")
    policy = Policy(**{k: v if k in _INT_POLICY else float(v) for k, v in values.items()})
    if not 0.0 < policy.significance_p < 1.0:
        raise ProfileError(f"{where}: [policy] significance_p = {policy.significance_p}: must be in (0, 1)")
    return policy


def _data(t: dict[str, Any], where: str) -> DataPin:
    for key in sorted(set(t) - set(_DATA_KEYS)):
        raise ProfileError(f"{where}: [data] {key}: unknown key; allowed: {sorted(_DATA_KEYS)}")
    values = {k: _check(where, f"[data] {k}", v, _DATA_KEYS[k]) for k, v in t.items()}
    if values.get("source") not in DATA_SOURCES:
        raise ProfileError(f"{where}: [data] source = {values.get('source')!r}: must be one of {list(DATA_SOURCES)}")
    return DataPin(**values)


def _tokenizers(t: dict[str, Any], where: str) -> tuple[str, ...]:
    allowed = t.get("allowed", ["gpt2", "bytes"])
    if not isinstance(allowed, list) or not allowed or not all(isinstance(x, str) for x in allowed):
        raise ProfileError(f"{where}: [tokenizers] allowed = {allowed!r}: must be a non-empty list of names")
    return tuple(allowed)


def resolve(profile: Profile, given: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The run's EvalOptions settings: the profile's, with every ``given`` value that is not
    ``None`` on top; returns them and the names of the fields whose value differs from the
    profile's (sorted; a ``data_dir`` given for a profile of the embedded corpus counts as ``data``).
    """
    settings = dict(profile.options)
    overridden = []
    for key, value in given.items():
        if value is None:
            continue
        if key == "data_dir":
            if profile.data.source == "builtin":
                overridden.append("data")
            settings[key] = value
            continue
        if settings.get(key) != value:
            overridden.append(key)
        settings[key] = value
    return settings, sorted(overridden)


def data_mismatch(pin: DataPin, manifest: dict[str, Any], manifest_sha256: str) -> list[str]:
    """How a data directory's MANIFEST differs from the profile's pin (empty: it matches).

    Compared: the source kind, and each of dataset, subset, revision, max_bytes and the
    MANIFEST sha256 that the pin sets.
    """
    source = manifest.get("source") or {}
    have = {"source": source.get("kind"), "dataset": manifest.get("dataset"), "subset": manifest.get("subset"),
            "revision": manifest.get("revision"), "max_bytes": source.get("max_bytes"),
            "manifest_sha256": manifest_sha256}
    return [f"{k}: profile {getattr(pin, k)!r}, data {have[k]!r}" for k in have
            if getattr(pin, k) is not None and getattr(pin, k) != have[k]]


def prepare_hint(pin: DataPin) -> str:
    """The ``prism data prepare`` command line that builds data matching ``pin``."""
    if pin.source == "fineweb-edu":
        parts = ["prism data prepare --source fineweb-edu"]
        if pin.subset:
            parts.append(f"--subset {pin.subset}")
        if pin.revision:
            parts.append(f"--revision {pin.revision}")
        if pin.max_bytes:
            parts.append(f"--max-bytes {pin.max_bytes}")
        return " ".join(parts) + " --out DIR"
    return f"prism data prepare --source {pin.source} --out DIR"


def manifest_record(profile: Profile, overridden: list[str]) -> dict[str, Any]:
    """The run manifest's ``profile`` entry."""
    return {"name": profile.name, "version": profile.version, "sha256": profile.sha256, "overridden": overridden}
