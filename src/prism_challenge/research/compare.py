"""``prism compare RUN_DIR...``: rank runs exactly as the challenge ranks them, and say which
runs cannot be compared.

Runs are read from their manifests (directories, globs, or a folder of runs such as a seed
repeat's). Runs are *comparable* when they share the comparability key (:func:`comparability`):
the profile (name and sha256), the data MANIFEST sha256, the tokenizer basis (``bytes`` when no
token or step budget makes the covered text depend on the tokenizer, else the tokenizer), the
budgets and the world size. Each comparable group's runs are ranked by
:func:`prism_challenge.score.verdict.rank` (each run an entry; a run stopped under 99 % of its budget
is ``short``: :func:`prism_challenge.score.crown.is_short`); when there is more than one group a
warning names the fields that differ. Seed repeats (same bundle sha256, same key and settings,
different seeds) are summarised as mean and sample standard deviation (``statistics.stdev``,
ddof=1). Every variant (a bundle and its settings, :func:`variant`) is then a group of seed
runs, ranked by the crown rule (:func:`crown`: :func:`prism_challenge.score.crown.rank_groups`), with
the one-sided Welch p against the first and the difference in mean bpb with its 95 % interval.
"""

from __future__ import annotations

import glob
import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prism_challenge.manifest.run_manifest import MANIFEST_NAME, load_run_manifest
from prism_challenge.score.crown import (
    DEFAULT_SIGNIFICANCE_P,
    Difference,
    RankedGroup,
    RunGroup,
    budget_share,
    is_short,
    rank_groups,
    welch_difference,
)
from prism_challenge.score.verdict import rank

KEY_FIELDS = ("profile", "data", "tokenizer basis", "budgets", "world size")


class CompareError(ValueError):
    """A run directory or pattern that names no run manifest, or a manifest that cannot be read."""


@dataclass
class Run:
    """One run: its directory, manifest and the figures the ranking reads."""

    run_dir: Path
    manifest: dict[str, Any]
    label: str = ""

    @property
    def short(self) -> bool:
        """The loop stopped the run under 99 % of its budget (recomputed from the manifest, so
        runs from before the ``short`` flag count too)."""
        stream = self.manifest.get("stream") or {}
        return is_short(stream.get("stop_reason"), budget_share(stream, self.manifest.get("budgets") or {}))

    @property
    def scored(self) -> bool:
        return self.manifest.get("status") == "scored" and (self.manifest.get("score") or {}).get(
            "prequential_bpb") is not None

    def entry(self) -> dict[str, Any]:
        """The mapping :func:`~prism_challenge.score.verdict.rank` takes."""
        m, v = self.manifest, self.manifest.get("verdict") or {}
        flags = list(v.get("flags", ["heldout_unavailable"] if not v else []))
        return {
            "id": str(self.run_dir), "run": self, "prequential_bpb": m["score"]["prequential_bpb"],
            "heldout_delta": (v.get("heldout") or {}).get("heldout_delta"), "submitted_at": m.get("created_at", ""),
            "anti_cheat_multiplier": v.get("anti_cheat_multiplier"), "final_score": v.get("final_score"),
            "memorization_penalty": v.get("memorization_penalty"),
            "flags": flags + ["short"] if self.short and "short" not in flags else flags,
        }


@dataclass
class Group:
    """Comparable runs, in the challenge's order."""

    key: dict[str, Any]
    runs: list[Run] = field(default_factory=list)


def find_runs(patterns: Iterable[str]) -> list[Path]:
    """Run directories named by ``patterns``: a run directory, a glob (``prism-runs/*``), or a
    folder whose sub-directories are runs (a seed repeat's ``--out``). Order: as given, sorted
    within a glob, each directory once.

    Raises:
        CompareError: a pattern that names no run directory.
    """
    out: list[Path] = []
    for pattern in patterns:
        paths = [Path(p) for p in sorted(glob.glob(pattern))] if glob.has_magic(pattern) else [Path(pattern)]
        found = []
        for p in paths:
            if (p / MANIFEST_NAME).is_file():
                found.append(p)
            elif p.is_file() and p.name == MANIFEST_NAME:
                found.append(p.parent)
            elif p.is_dir():
                found += sorted(c for c in p.iterdir() if (c / MANIFEST_NAME).is_file())
        if not found:
            raise CompareError(f"{pattern}: no run directory (a directory holding {MANIFEST_NAME}) there")
        out += [p.resolve() for p in found if p.resolve() not in out]
    return out


def load_runs(dirs: Sequence[Path]) -> list[Run]:
    """The runs of ``dirs``, labelled by their shortest distinct directory names.

    Raises:
        CompareError: a manifest that is not valid JSON or not a PRISM v2 run manifest.
    """
    runs = []
    for d in dirs:
        try:
            runs.append(Run(d, load_run_manifest(d)))
        except (ValueError, OSError) as exc:
            raise CompareError(f"{d / MANIFEST_NAME}: cannot read the run manifest: {exc}") from None
    for r in runs:
        r.label = r.run_dir.name if [q.run_dir.name for q in runs].count(r.run_dir.name) == 1 else \
            f"{r.run_dir.parent.name}/{r.run_dir.name}"
    return runs


def comparability(m: dict[str, Any]) -> dict[str, Any]:
    """The comparability key of a run manifest (:data:`KEY_FIELDS`)."""
    budgets = m.get("budgets") or {}
    profile = m.get("profile") or {}
    tokenizer = m.get("tokenizer") or {}
    by_tokens = budgets.get("token_budget") is not None or budgets.get("step_budget") is not None
    return {
        "profile": f"{profile.get('name')} ({str(profile.get('sha256'))[:12]})" if profile else None,
        "data": (m.get("data") or {}).get("manifest_sha256"),
        "tokenizer basis": f"tokens of {tokenizer.get('name')}" if by_tokens else "bytes (any tokenizer)",
        "budgets": {k: v for k, v in sorted(budgets.items()) if v is not None},
        "world size": (m.get("compute") or {}).get("world_size"),
    }


def group_runs(runs: Sequence[Run]) -> list[Group]:
    """Scored runs split into comparable groups (first appearance order), each ranked by
    :func:`~prism_challenge.score.verdict.rank`."""
    groups: list[Group] = []
    for r in runs:
        if not r.scored:
            continue
        key = comparability(r.manifest)
        g = next((g for g in groups if g.key == key), None)
        if g is None:
            groups.append(g := Group(key))
        g.runs.append(r)
    for g in groups:
        g.runs = [e["run"] for e in rank([r.entry() for r in g.runs])]
    return groups


def warnings(groups: Sequence[Group]) -> list[str]:
    """One warning per field that differs between groups (empty: every run is comparable)."""
    if len(groups) < 2:
        return []
    out = [f"{len(groups)} groups of runs that are not comparable; each is ranked on its own"]
    for f in KEY_FIELDS:
        values = [json.dumps(g.key[f], sort_keys=True) for g in groups]
        if len(set(values)) > 1:
            out.append(f"{f} differs: " + " | ".join(f"group {i + 1}: {v}" for i, v in enumerate(values)))
    return out


def variant(m: dict[str, Any]) -> str:
    """Everything but the seed that makes two runs of one bundle the same experiment (a JSON
    string: the bundle sha256, the comparability key, config, profile, device, tokenizer)."""
    profile = dict(m.get("profile") or {})
    profile["overridden"] = [f for f in profile.get("overridden", []) if f != "seed"]
    return json.dumps([(m.get("bundle") or {}).get("sha256"), comparability(m), m.get("config"), profile,
                       (m.get("compute") or {}).get("device"), (m.get("tokenizer") or {}).get("name")],
                      sort_keys=True)


def settings(m: dict[str, Any]) -> dict[str, Any]:
    """A run's settings by name, for saying how two variants of one bundle differ
    (:func:`differences`): the bundle's sha256, device, tokenizer, profile, the options given
    over the profile, the held-out bytes (``verdict.heldout.max_bytes``) and each ``config`` field
    (``config.<name>``)."""
    profile = m.get("profile") or {}
    heldout = (m.get("verdict") or {}).get("heldout") or {}
    out: dict[str, Any] = {
        "bundle sha256": str((m.get("bundle") or {}).get("sha256"))[:12],
        "device": (m.get("compute") or {}).get("device"),
        "tokenizer": (m.get("tokenizer") or {}).get("name"),
        "profile": f"{profile.get('name')} ({str(profile.get('sha256'))[:12]})" if profile else None,
        "options over the profile": sorted(f for f in profile.get("overridden", []) if f != "seed"),
        "held-out bytes": heldout.get("max_bytes"),
    }
    out.update({f"config.{k}": v for k, v in sorted((m.get("config") or {}).items())})
    return out


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """``"<setting>: <a's> -> <b's>"`` for each of :func:`settings` that differs between the
    manifests ``a`` and ``b``, in :func:`settings`' order."""
    sa, sb = settings(a), settings(b)
    return [f"{k}: {json.dumps(sa.get(k), sort_keys=True)} -> {json.dumps(sb.get(k), sort_keys=True)}"
            for k in dict.fromkeys([*sa, *sb])
            if json.dumps(sa.get(k), sort_keys=True) != json.dumps(sb.get(k), sort_keys=True)]


def seed_repeats(group: Group) -> list[dict[str, Any]]:
    """Seed repeats in a group: runs of one bundle with the same settings and different seeds
    (two or more), with the mean and sample std (ddof=1) of ``prequential_bpb`` and ``final_score``."""
    by: dict[str, list[Run]] = {}
    for r in group.runs:
        by.setdefault(variant(r.manifest), []).append(r)
    out = []
    for runs in by.values():
        if len({r.manifest.get("seed") for r in runs}) < 2:
            continue
        row: dict[str, Any] = {"bundle": Path((runs[0].manifest.get("bundle") or {}).get("path", "?")).name,
                               "bundle_sha256": runs[0].manifest["bundle"]["sha256"], "n": len(runs),
                               "seeds": [r.manifest.get("seed") for r in runs], "runs": [r.label for r in runs]}
        for key, get in (("prequential_bpb", lambda m: m["score"]["prequential_bpb"]),
                         ("final_score", lambda m: (m.get("verdict") or {}).get("final_score"))):
            values = [float(get(r.manifest)) for r in runs if get(r.manifest) is not None]
            row[key] = {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
                        "values": values}
        out.append(row)
    return sorted(out, key=lambda row: row["prequential_bpb"]["mean"])


@dataclass(frozen=True)
class CrownRow:
    """One variant of a group ranked by the crown rule.

    Attributes:
        ranked: its place and figures (:class:`~prism_challenge.score.crown.RankedGroup`; bpb).
        label: the bundle's directory name (``#2``... added when two variants share it).
        runs: its runs, in the group's order.
        vs_leader: ``mean - leader's mean`` with its 95 % Welch interval and p
            (:func:`~prism_challenge.score.crown.welch_difference`); ``None`` for the leader and where
            either side has fewer than 2 runs.
        namesake: for a ``#N`` label, the label of the first variant of the same name, and
            ``differs`` what sets them apart (:func:`differences`); else ``None`` and ``()``.
    """

    ranked: RankedGroup
    label: str
    runs: list[Run]
    vs_leader: Difference | None
    namesake: str | None = None
    differs: tuple[str, ...] = ()


def crown(group: Group, p: float = DEFAULT_SIGNIFICANCE_P) -> list[CrownRow]:
    """The group's variants (:func:`variant`: a bundle and its settings; its seed runs) ranked by
    :func:`~prism_challenge.score.crown.rank_groups`: order by the earliest ``created_at`` of each; short
    when any of its runs is. Each row compared with its tier's first (:class:`CrownRow`)."""
    by: dict[str, list[Run]] = {}
    for r in group.runs:
        by.setdefault(variant(r.manifest), []).append(r)
    first = {k: min(str(r.manifest.get("created_at", "")) for r in runs) for k, runs in by.items()}
    order = {k: i for i, k in enumerate(sorted(by, key=lambda k: (first[k], k)))}
    labels: dict[str, str] = {}
    namesakes: dict[str, str] = {}
    for k in sorted(by, key=order.get):
        name = Path((by[k][0].manifest.get("bundle") or {}).get("path", "?")).name
        first_k = next((j for j, label in labels.items() if label == name), None)
        labels[k] = name if first_k is None else f"{name}#{order[k] + 1}"
        if first_k is not None:
            namesakes[k] = first_k
    ranked = rank_groups([RunGroup(k, tuple(float(r.manifest["score"]["prequential_bpb"]) for r in runs), order[k],
                                   short=any(r.short for r in runs)) for k, runs in by.items()], p)
    leaders = {g.short: g for g in ranked if g.leads}
    bpbs = {k: [float(r.manifest["score"]["prequential_bpb"]) for r in runs] for k, runs in by.items()}
    return [CrownRow(g, labels[g.key], by[g.key],
                     None if g.leads else welch_difference(bpbs[g.key], bpbs[leaders[g.short].key]),
                     labels[namesakes[g.key]] if g.key in namesakes else None,
                     tuple(differences(by[namesakes[g.key]][0].manifest, by[g.key][0].manifest))
                     if g.key in namesakes else ())
            for g in ranked]
