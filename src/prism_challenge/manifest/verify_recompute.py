"""What ``prism verify`` recomputes from the manifest alone (and the revealed secret), believing
none of the manifest's own conclusions:

* :func:`check_score`: the stream's and the score's counts and totals from the curve;
* :func:`check_verdict`: the verdict, its flags and ``final_score``, rebuilt by
  :func:`prism_challenge.score.verdict.build_verdict` from the curve, the held-out figures and the
  profile's policy (:func:`policy_of`), with the held-out contract and the audit applied as the
  pipeline applies them;
* :func:`check_draws`: the audited steps, drawn again from the revealed ``run_secret``
  (:func:`prism_challenge.evaluator.auditplan.drawn_steps`);
* :func:`check_probes`: each audited slice's blind probe batches and picks, made again from the
  secret and the val split (:func:`prism_challenge.audit.rescore.probe_batch`).

Each raises :class:`Mismatch` naming the first field that differs.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace
from typing import Any

import numpy as np

CURVE_RTOL = 1e-9
"""Relative tolerance of a float re-derived from the curve (per-target floats, one rounding per
batch, then float64 sums: about 1e-16 of the total each)."""
VERDICT_ABS = 1e-12
"""Absolute tolerance beside :data:`CURVE_RTOL` for verdict floats near zero (a gap, ``gap/se``)."""
SECRET_RE = re.compile(r"^[0-9a-f]{64}$")


class Mismatch(Exception):
    """What differs, named (the first one found)."""


def _close(a: float, b: float) -> bool:
    return a == b or math.isclose(a, b, rel_tol=CURVE_RTOL, abs_tol=VERDICT_ABS)


def curve_bpb(curve: dict[str, list]) -> tuple[float, list[float]]:
    """(bpb re-derived from a manifest curve, each batch's total nats): ``sum_i
    nats_per_target_i * targets_i / ln 2 / bytes`` (:mod:`prism_challenge.score.scoring`)."""
    per, cum_t, cum_b = curve["nats_per_target"], curve["cumulative_targets"], curve["cumulative_bytes"]
    targets = [t - p for t, p in zip(cum_t, [0, *cum_t[:-1]])]
    nats = [n * t for n, t in zip(per, targets)]
    return math.fsum(nats) / math.log(2) / cum_b[-1], nats


def check_score(m: dict[str, Any]) -> tuple[float, list[float]]:
    """The score re-derived from the curve: ``stream.batches`` the curve's length, ``targets``
    and ``bytes`` (stream and score) its last cumulative values, exactly; ``total_nats``,
    ``total_bits = total_nats / ln 2`` and ``prequential_bpb = total_bits / bytes``
    (:mod:`prism_challenge.score.scoring`) within :data:`CURVE_RTOL`. Returns (bpb, nats per batch).

    Raises:
        Mismatch: the first figure that differs, named.
    """
    curve, stream, score = m["curve"], m["stream"], m["score"]
    cum_t, cum_b = curve["cumulative_targets"], curve["cumulative_bytes"]
    if not cum_b or cum_b[-1] <= 0:
        raise Mismatch("score: the curve covers no bytes")
    for name, cum in (("cumulative_targets", cum_t), ("cumulative_bytes", cum_b)):
        if any(b < a for a, b in zip([0, *cum[:-1]], cum)):
            raise Mismatch(f"score: curve.{name} decreases")
    exact = {"stream.batches": (stream["batches"], len(cum_t)), "stream.targets": (stream["targets"], cum_t[-1]),
             "stream.bytes": (stream["bytes"], cum_b[-1]), "score.targets": (score["targets"], cum_t[-1]),
             "score.bytes": (score["bytes"], cum_b[-1])}
    for name, (recorded, again) in exact.items():
        if recorded != again:
            raise Mismatch(f"score: {name} is {recorded!r} in the manifest, the curve gives {again!r}")
    bpb, nats = curve_bpb(curve)
    total = math.fsum(nats)
    floats = {"score.total_nats": (score["total_nats"], total), "score.total_bits": (score["total_bits"], total / math.log(2)),
              "score.prequential_bpb": (score["prequential_bpb"], bpb)}
    for name, (recorded, again) in floats.items():
        if not (isinstance(recorded, (int, float)) and abs(recorded - again) <= CURVE_RTOL * abs(again)):
            raise Mismatch(f"score: the curve gives {again!r} for {name}, the manifest says {recorded!r}")
    return bpb, nats


def policy_of(m: dict[str, Any], profile: str | None = None) -> tuple[Any, str]:
    """The verdict policy the run was judged under, and where it came from: its profile's
    (``profile``: a name or file to read it from instead of the shipped one of the manifest's
    name; its sha256 must be the manifest's, and so must the policy the manifest records in
    ``config.policy``); for a run without a profile, or one that overrode its profile's policy,
    the recorded policy (the default :class:`~prism_challenge.score.verdict.Policy` for a manifest that
    records none).

    Raises:
        Mismatch: the profile cannot be read or hashes otherwise, its policy is not the recorded
            one, or the run overrode its policy and the manifest records none.
    """
    from prism_challenge.profiles import ProfileError, load_profile
    from prism_challenge.score.verdict import Policy

    rec = m.get("profile")
    recorded = m["config"].get("policy")
    if recorded is not None:  # a knob absent from an older manifest (null) is its default
        recorded = {k: v for k, v in recorded.items() if v is not None}
    if rec is None or "policy" in rec.get("overridden", []):
        if recorded is not None:
            return Policy.from_record(recorded), "the policy the manifest records (no profile's)"
        if rec is not None:
            raise Mismatch(f"verdict: the run overrode profile {rec['name']}'s policy, which the manifest does not record")
        return Policy(), "the default policy (no profile)"
    try:
        p = load_profile(profile or rec["name"])
    except ProfileError as exc:
        raise Mismatch(f"verdict: the run's profile cannot be read here: {exc} (pass --profile FILE)") from None
    if p.sha256 != rec["sha256"]:
        raise Mismatch(f"verdict: profile {p.name} ({p.path}) hashes to {p.sha256}, the run's to {rec['sha256']} "
                       "(pass --profile FILE with the run's profile)")
    policy = p.options.get("policy", Policy())
    if recorded is not None and Policy.from_record(recorded) != policy:
        raise Mismatch(f"verdict: the manifest records the policy {recorded}, profile {p.name}'s is {policy}")
    return policy, f"profile {p.name} v{p.version}"


def _diff(path: str, recorded: Any, again: Any) -> str | None:
    """The first field under ``path`` where ``recorded`` and ``again`` differ (floats within
    :data:`CURVE_RTOL`; bools, ints, strings and lists of names exactly), or ``None``."""
    if isinstance(again, dict) and isinstance(recorded, dict):
        for k in sorted(set(again) | set(recorded)):
            d = _diff(f"{path}.{k}", recorded.get(k), again.get(k))
            if d:
                return d
        return None
    if isinstance(again, list) and isinstance(recorded, list) and len(again) == len(recorded):
        for i, (a, b) in enumerate(zip(recorded, again)):
            d = _diff(f"{path}[{i}]", a, b)
            if d:
                return d
        return None
    numeric = (int, float)
    if (isinstance(again, float) and isinstance(recorded, numeric) and not isinstance(recorded, bool)
            and not isinstance(again, bool) and _close(float(recorded), again)):
        return None
    if type(recorded) is type(again) and recorded == again:
        return None
    if isinstance(recorded, numeric) and isinstance(again, numeric) and not isinstance(recorded, bool) \
            and not isinstance(again, bool) and recorded == again:
        return None
    return f"{path} is {recorded!r} in the manifest, the recomputation gives {again!r}"


def recompute_verdict(m: dict[str, Any], policy: Any) -> dict[str, Any]:
    """The verdict rebuilt as the pipeline builds it: :func:`~prism_challenge.score.verdict.build_verdict`
    over the score's bpb, the curve, the vocabulary and the manifest's held-out figures under
    ``policy``; zeroed with flag ``heldout_contract`` for a held-out contract error; zeroed with
    flag ``audit`` when the audit did not pass (:func:`prism_challenge.audit.auditstage.apply`), where
    "passed" follows from the audit's batches, mismatch and error, not from its own field.

    Raises:
        Mismatch: the verdict cannot be computed from these figures.
    """
    import dataclasses

    from prism_challenge.audit.auditstage import apply as apply_audit
    from prism_challenge.score.verdict import VerdictError, budget_share, build_verdict

    v, audit = m["verdict"], m.get("audit")
    try:
        again = build_verdict(m["score"]["prequential_bpb"], m["curve"], m["tokenizer"]["vocab_size"], v.get("heldout"),
                              heldout_error=v.get("heldout_error"), policy=policy,
                              stop_reason=m["stream"].get("stop_reason"),
                              covered=budget_share(m["stream"], m["budgets"]))
    except VerdictError as exc:
        raise Mismatch(f"verdict: cannot be recomputed: {exc}") from None
    if (v.get("heldout_error") or "").startswith("contract:"):
        again = dataclasses.replace(again, anti_cheat_multiplier=0.0, final_score=0.0,
                                    flags=[*again.flags, "heldout_contract"])
    if audit is not None:
        again = apply_audit(again, SimpleNamespace(passed=audit_passed(audit)))
    return again.to_dict()


def audit_passed(audit: dict[str, Any]) -> bool:
    """Whether an audit passed by its contents: no mismatch, no error, every batch a match."""
    return audit["mismatch"] is None and audit["error"] is None and all(e["match"] for e in audit["batches"])


def check_verdict(m: dict[str, Any], policy: Any) -> dict[str, Any]:
    """:func:`recompute_verdict` must equal the manifest's verdict field by field (:func:`_diff`),
    and the audit's ``passed`` must follow from its contents. Returns the recomputed verdict.

    Raises:
        Mismatch: the first field that differs, named.
    """
    audit = m.get("audit")
    if audit is not None and audit["passed"] != audit_passed(audit):
        raise Mismatch(f"audit: passed is {audit['passed']!r}, its batches, mismatch and error give "
                       f"{audit_passed(audit)!r}")
    recomputed = recompute_verdict(m, policy)
    d = _diff("verdict", m["verdict"], recomputed)
    if d:
        raise Mismatch(d)
    return recomputed


def secret_of(m: dict[str, Any]) -> bytes:
    """The revealed ``run_secret`` (32 bytes).

    Raises:
        Mismatch: the manifest reveals none (a harness from before issue 25: its draws cannot be
            re-derived), or ``run_secret`` is not 64 lowercase hex characters.
    """
    s = m.get("run_secret")
    if s is None:
        raise Mismatch("draws: the manifest reveals no run_secret, so its audit draws cannot be re-derived "
                       "(a manifest written before issue 25 cannot be verified)")
    if not isinstance(s, str) or not SECRET_RE.match(s):
        raise Mismatch("draws: run_secret is not 64 lowercase hex characters")
    return bytes.fromhex(s)


def check_draws(m: dict[str, Any], min_audited: int | None = None) -> list[int]:
    """The audited steps drawn again from the revealed secret: ``drawn_steps(run_secret,
    stream.batches, audit.schedule.audited_batches)`` must be ``audit.batches``' steps exactly
    (a run whose audit did not pass, already zeroed, may list fewer: never one not drawn).
    The run's ``A`` must be at least ``min_audited`` (``None``: the harness's
    :data:`~prism_challenge.evaluator.auditplan.AUDITED_BATCHES`): a run signed with a smaller
    ``A`` escapes with ``(1 - f)^A``, a weaker bound than the challenge's. Returns the drawn steps.

    Raises:
        Mismatch: no revealed ``run_secret``, a schedule other than the harmonic one, an ``A``
            below ``min_audited``, or a batch missing from or added to the manifest's list (named).
    """
    from prism_challenge.evaluator.auditplan import AUDITED_BATCHES, drawn_steps

    key = secret_of(m)
    audit = m["audit"]
    sched = audit.get("schedule")
    if not isinstance(sched, dict) or sched.get("rule") != "harmonic" or not isinstance(sched.get("audited_batches"), int):
        raise Mismatch(f"draws: audit.schedule {sched!r} is not the harmonic schedule with its audited_batches")
    a = sched["audited_batches"]
    if audit.get("audited_batches_target", a) != a:
        raise Mismatch(f"draws: audit.schedule.audited_batches {a} is not audit.audited_batches_target "
                       f"{audit['audited_batches_target']}")
    floor = AUDITED_BATCHES if min_audited is None else min_audited
    if a < floor:
        raise Mismatch(f"draws: the run audited with A = {a}, below {floor} (a cheat on a fraction f of its batches "
                       f"escapes with (1 - f)^{a}); --min-audited {a} accepts it")
    drawn = drawn_steps(key, int(m["stream"]["batches"]), a)
    listed = [int(e["step"]) for e in audit["batches"]]
    extra = sorted(set(listed) - set(drawn))
    if extra or listed != sorted(set(listed)):
        raise Mismatch(f"draws: audited batch {extra[0] if extra else listed} is listed but the run_secret does not "
                       "draw it (or the list repeats or is out of order)")
    missing = [s for s in drawn if s not in set(listed)]
    if missing and audit["passed"]:
        raise Mismatch(f"draws: the run_secret draws batch {missing[0]} for the audit, which the manifest does not list "
                       f"({len(missing)} drawn batch(es) missing)")
    return drawn


def check_probes(m: dict[str, Any], inputs: dict[int, dict[str, np.ndarray]], filler: np.ndarray | None) -> int:
    """Each audited slice's stored blind probe batches (``probe_<rank>_<pass>``) and picks
    (``picks_<rank>_<pass>``) made again from the revealed secret with
    :func:`~prism_challenge.audit.rescore.probe_batch` over the val split's prefix ``filler``
    (:func:`prism_challenge.audit.auditstage.val_filler`): each must be equal, and there must be
    :data:`~prism_challenge.audit.rescore.BLIND_PASSES` of them per slice (none when the run had no
    usable filler). Returns the probes compared.

    Raises:
        Mismatch: no revealed secret (:func:`secret_of`), or a stored probe or pick that the
            secret does not give, named by step and rank.
    """
    from prism_challenge.audit.rescore import BLIND_PASSES, probe_batch

    key = secret_of(m)
    n, done = int(m["compute"]["world_size"]), 0
    for step, arrays in sorted(inputs.items()):
        for r in range(n):
            tokens = arrays[f"tokens_{r}"]
            stored = sorted(int(k.rsplit("_", 1)[1]) for k in arrays if k.startswith(f"probe_{r}_"))
            usable = filler is not None and len(filler) >= tokens.shape[1]
            if stored != (list(range(BLIND_PASSES)) if usable else []):
                raise Mismatch(f"probes: audited batch {step}, rank {r} stores blind passes {stored}; expected "
                               f"{BLIND_PASSES if usable else 0}")
            for p in stored:
                probe, picks = probe_batch(tokens, filler, key, step, r, p)
                want = np.asarray(picks, dtype=np.int64).reshape(-1, 2)
                if not np.array_equal(arrays[f"picks_{r}_{p}"], want) or not np.array_equal(arrays[f"probe_{r}_{p}"], probe):
                    raise Mismatch(f"probes: audited batch {step}, rank {r}, pass {p}: the stored blind probe is not "
                                   "the one the run_secret draws")
                done += 1
    return done
