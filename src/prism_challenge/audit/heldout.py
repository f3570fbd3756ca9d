"""Held-out evaluation: the trained model and its random-init twin on a fixed val prefix.

After the scored run the trusted parent holds the scored model's ``state_dict`` (saved by the
harness, not the submission). This module then scores, in a separate bounded process:

* the **twin**: ``build_model(ctx)`` under the forced seed, untrained;
* the **trained** model: built the same way, then loaded from ``torch.load(state,
  weights_only=True)`` (tensors only: a planted pickle cannot run code), each tensor in its own
  dtype (:func:`~prism_challenge.evaluator.statedict.load_scored_state`: a model the loop cast to
  bf16 is scored in bf16); the twin takes the dtypes of the model that scored batch 0, the
  audit's snapshot of step 0 (:func:`~prism_challenge.evaluator.statedict.in_dtypes_of`; without
  an audit, ``build_model``'s own);

on the same rows of a deterministic byte-budget prefix of the ``val`` split
(:func:`prism_challenge.data.stream.heldout_stream`: whole documents while their UTF-8 bytes
total at most ``max_bytes``, in the train stream's layout ``EOT doc EOT doc ...``), cut into
overlapping rows by :class:`prism_challenge.evaluator.rows.RowAssembler` exactly as the feeder
cuts the train stream, and scored by :func:`prism_challenge.evaluator.instrument.score_batch`
(eval mode, no_grad, logits sliced to ``V``, float64 sums; a non-finite batch is charged
``2 ln V`` nats per target, :func:`~prism_challenge.evaluator.instrument.charge`). So

    val_bpb = sum(nats) / ln 2 / sum(target bytes)         (the training score's definition)
    heldout_delta = val_bpb(twin) - val_bpb(trained)       (> 0: the training helped)

The figures keep each batch's nats per model and each batch's bytes (the trusted side's counts):
the spread of the trained model's per-batch bpb is the val side of the memorization gap's
standard error (:mod:`prism_challenge.score.gapnoise`).

**Probes.** Every held-out batch of the trained model is also probed in process
(:func:`~prism_challenge.evaluator.instrument.check_causal`; the twin is not: a non-causal twin
only lowers the delta). The in-process probe can be answered from a cache by a model that
remembers the rows it has just scored, so the blind probe (:mod:`prism_challenge.audit.blindprobe`)
recomputes the prediction of a token in a second, fresh process that never saw its future;
a mismatch is ``HeldoutError("contract: ...")``, which zeroes the run. Every forward runs under
the bundle's ``scoring_autocast``, as in the stream.

**Process boundary.** The process that scores imports the submission's architecture, so it is
untrusted from the moment of that import. :func:`run_heldout` therefore keeps everything that
decides the figures on the trusted side: it cuts the rows itself, sends the child only token
ids (never text, never a data path) and the state bytes over stdin, and computes targets, bytes
and bpb from its own counts, taking only nats per model and batch from the child. The child applies its
rlimits (address space, file size, open files; soft = hard) before the submission is imported,
redirects file descriptor 1 to stderr so submitted prints cannot forge the result line, and
dies with its parent. Run it inside :func:`prism_challenge.evaluator.isolation.sandbox_prefix`
(``writable=[]``, the data directory, caches and salts ``hidden``): it then needs no file but
the interpreter and the bundle. What it cannot prevent, like the training runner: code running
in the child's address space (the submitted ``forward``) can tamper with the in-process
computation; the static gates (no monkeypatching, no introspection) are the defence there.

``python -m prism_challenge.audit.heldout CONFIG.json`` runs it standalone (trusted use: it reads the
val split from ``data_dir`` and ``state_path`` itself) and prints one JSON line.

The code is split by side of the boundary: :mod:`~prism_challenge.audit.heldout_parent` (the
trusted side, :func:`run_heldout`), :mod:`~prism_challenge.audit.heldout_child` (what the child
computes, :func:`evaluate_config`) and :mod:`~prism_challenge.audit.heldout_wire` (the frames
between them, :class:`HeldoutError`); this module is the child's entry point and keeps the
public names.
"""

from __future__ import annotations

from prism_challenge.evaluator import childgc

if __name__ == "__main__":
    childgc.pause()  # before the imports below; until arm() (childgc)

import io
import json
import os
import sys
from pathlib import Path
from typing import Any

from prism_challenge.audit.blindprobe import BLIND_PROBES, blind_probes
from prism_challenge.audit.heldout_child import evaluate_config, score_rows
from prism_challenge.audit.heldout_parent import DEFAULT_MAX_BYTES, _figures, heldout_cuts, run_heldout
from prism_challenge.audit.heldout_wire import HeldoutError, _read_frame, _unpack_batches

TRAINED_STATE_NAME = "prism_trained_state.pt"

__all__ = [
    "BLIND_PROBES",
    "DEFAULT_MAX_BYTES",
    "TRAINED_STATE_NAME",
    "HeldoutError",
    "blind_probes",
    "heldout_cuts",
    "run_heldout",
    "score_rows",
    "evaluate_config",
]


WARM_MODULES = ("torch", "prism_challenge.evaluator.audit", "prism_challenge.evaluator.instrument",
                "prism_challenge.evaluator.interface", "prism_challenge.gates.param_count")


def _warm_up() -> None:
    """Import torch and the harness modules :func:`evaluate_config` uses, before stdin is read."""
    import importlib

    for name in WARM_MODULES:
        importlib.import_module(name)


def main(argv: list[str] | None = None) -> int:
    """``python -m prism_challenge.audit.heldout CONFIG.json`` or ``... --stdin`` (used by :func:`run_heldout`).

    Prints one JSON line on stdout: ``{"ok": true, ...figures}`` or ``{"ok": false, "error": ...}``;
    exit status 0 or 1. With ``--stdin`` the config, the token batches and the state bytes come
    as three length-prefixed frames on stdin and the line carries nats and targets only (the
    parent computes bytes and bpb).
    """
    argv = sys.argv[1:] if argv is None else argv
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever else writes to stdout lands in stderr

    def emit(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    try:
        if argv == ["--stdin"]:
            _warm_up()  # a spare imports before it is fed (Jail.warm)
            stdin = sys.stdin.buffer
            config = json.loads(_read_frame(stdin))
            batches = _unpack_batches(_read_frame(stdin))
            state: Any = io.BytesIO(_read_frame(stdin))
            batch_bytes = None
        elif len(argv) == 1:
            config = json.loads(Path(argv[0]).read_text())
            cuts = heldout_cuts(config["data_dir"], config["tokenizer"], split=config.get("split", "val"),
                                max_bytes=int(config.get("max_bytes", DEFAULT_MAX_BYTES)),
                                batch_size=int(config["batch_size"]), seq_len=int(config["seq_len"]))
            batches = [c.tokens for c in cuts]
            batch_bytes: list[int] | None = [int(c.target_bytes.sum()) for c in cuts]
            # read now, before the audit hook is armed: the state file may lie anywhere the user keeps it
            state = io.BytesIO(Path(config["state_path"]).read_bytes())
        else:
            sys.stderr.write("usage: python -m prism_challenge.audit.heldout CONFIG.json | --stdin\n")
            return 2
        result = evaluate_config(config, batches, state)
        if batch_bytes is None:
            emit({"ok": True, **result})
        else:
            if sum(batch_bytes) <= 0:
                raise HeldoutError("data: the held-out prefix covers no bytes")
            emit({"ok": True, **_figures(result, batch_bytes), "split": config.get("split", "val")})
        return 0
    except HeldoutError as exc:
        emit({"ok": False, "error": str(exc)})
    except MemoryError:
        emit({"ok": False, "error": "memory: out of memory (MemoryError)"})
    except Exception as exc:  # noqa: BLE001
        emit({"ok": False, "error": f"heldout: {type(exc).__name__}: {exc}"})
    return 1


if __name__ == "__main__":
    from prism_challenge.evaluator.childexit import exit_child

    exit_child(main())  # no interpreter teardown (childexit)
