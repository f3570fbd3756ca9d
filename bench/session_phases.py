"""The phases of the GPU session (``bench/gpu_session.sh``), one per subcommand.

``python bench/session_phases.py PHASE --device cuda|cpu [--dry-run] --budget-s S --result FILE``
runs one phase within ``S`` seconds and writes its outcome to ``FILE`` as JSON: ``{"phase",
"status": "ok"|"failed", "problems": [...], ...figures}``. Phases:

* ``facts``: the host (nvidia-smi, torch and CUDA, capability, driver, Python, disk, memory,
  cgroup, the sandbox backend), that PRISM's modules import, and the embedded corpus built once;
* ``children``: the jailed CUDA check child, then two ``prism eval`` runs with the held-out stage
  and the audit on, whose children start CUDA under the sandbox: the example, and its variant
  ``cuda-count`` (``bench/variants.py``: ``torch.cuda.device_count()`` in ``build_model``, before
  CUDA starts in a child);
* ``probes``: the example's variants ``bf16-cast``, ``autocast-loop`` and ``compile``
  (``bench/variants.py``, written from the example for the run), each a small ``prism eval`` (on a dry run the compile probe
  names the ``aot_eager`` backend: :data:`DRY_COMPILE`);
* ``bigmodel``: ``bench/bundles/gpt2-100m`` (about 100M parameters) against the bare loop
  (``bench/bare_loop.py``) in bf16 (``scoring_autocast: bf16``, the loop under bf16 autocast)
  and in fp32: tokens per second of both and the ratio, 16 batches of 16 x 512 tokens each.

``bench/session_summary.py`` gathers the phases' results into one summary JSON and a table.

Every run of every phase is honest and must come out clean (``gpu_smoke.honest_problems``).
``--dry-run`` runs the same code on the CPU with small sizes (the 100M model shrunk to a few
thousand parameters per layer); only what needs a GPU to mean anything (nvidia-smi, a CUDA check
that succeeds) is read as its CPU answer, and said so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
from variants import write_variant  # noqa: E402

# (device, dry-run) sizes: tokens, seq_len, held-out bytes
TINY = {"device": (8_192, 256, 100_000), "dry": (2_048, 64, 20_000)}
# the large model: constants rewritten in its copies, and its runs' token budgets
BIG = {"device": {"tokens": 131_072, "seq_len": 512, "batch": 16, "dims": {}},
       "dry": {"tokens": 2_048, "seq_len": 64, "batch": 2, "dims": {"D_MODEL": 32, "N_HEAD": 2, "N_LAYER": 2}}}
IMPORTS = ("prism_challenge.cli", "prism_challenge.cli_eval", "prism_challenge.pipeline", "prism_challenge.manifest.certificate",
           "prism_challenge.manifest.verify", "prism_challenge.audit.heldout", "prism_challenge.audit.rescore_child",
           "prism_challenge.evaluator.runner", "prism_challenge.evaluator.rank", "prism_challenge.data.builtin",
           "prism_challenge.data.sources", "prism_challenge.tokenizers")


class Phase:
    """One phase's outcome as it is built: problems, figures, and a deadline for its runs."""

    def __init__(self, name: str, a: argparse.Namespace):
        self.name, self.a, self.problems, self.data = name, a, [], {}
        self.deadline = time.monotonic() + a.budget_s - 3.0

    def left(self, cap: float) -> float:
        """Seconds the next run may take: ``cap``, or what is left of the phase if less."""
        return max(1.0, min(cap, self.deadline - time.monotonic()))

    def run_eval(self, key: str, bundle: Path, *, tokens: int, seq_len: int, heldout: int, cap: float) -> dict:
        """One honest ``prism eval``, recorded under ``key``; its problems become the phase's."""
        from gpu_smoke import prism_eval, run_record

        if self.deadline - time.monotonic() < 10:
            self.problems.append(f"{key}: not run: no time left in the phase's {self.a.budget_s:.0f} s")
            print(f"[{self.name}] {key}: not run (no time left)", flush=True)
            return {}
        t0 = time.monotonic()
        rec = run_record(prism_eval(bundle, self.a.device, tokens=tokens, seq_len=seq_len, heldout_bytes=heldout,
                                    threads=self.a.threads, timeout_s=self.left(cap)))
        self.data[key] = rec
        self.problems += [f"{key}: {p}" for p in rec["problems"]]
        print(f"[{self.name}] {key}: {'ok' if not rec['problems'] else 'FAILED'} in {time.monotonic() - t0:.1f} s; "
              f"final_score {rec['final_score']}, flags {rec['flags']}, audit passed {rec['audit_passed']}"
              f"{'' if rec['audit_error'] is None else ', audit error ' + str(rec['audit_error'])[:300]}, "
              f"tokens/s {rec['tokens_per_s'] or 0:,.0f}", flush=True)
        for p in rec["problems"]:
            print(f"[{self.name}] {key}: {p}", flush=True)
        if rec.get("output_tail"):
            print(f"[{self.name}] {key} output: {rec['output_tail']}", flush=True)
        return rec

    def finish(self) -> int:
        status = "failed" if self.problems else "ok"
        out = {"phase": self.name, "status": status, "device": self.a.device, "dry_run": self.a.dry_run,
               "problems": self.problems, **self.data}
        Path(self.a.result).write_text(json.dumps(out, indent=1, default=str))
        print(f"[{self.name}] {status}" + "".join(f"\n[{self.name}]   {p}" for p in self.problems), flush=True)
        return 0 if status == "ok" else 1


def _sh(argv: list[str], timeout_s: float = 20.0) -> str | None:
    from bounded import run_bounded

    if shutil.which(argv[0]) is None:
        return None
    done = run_bounded(argv, timeout_s)
    return (done.stdout + done.stderr).strip()


def _cgroup() -> dict:
    rec = {"self": Path("/proc/self/cgroup").read_text().strip() if Path("/proc/self/cgroup").exists() else None}
    root = Path("/sys/fs/cgroup")
    for name in ("cgroup.controllers", "memory.max", "cgroup.subtree_control"):
        p = root / name
        rec[name] = p.read_text().strip() if p.exists() else None
    rec["writable"] = os.access(root, os.W_OK)
    return rec


def _memory() -> dict:
    info = {}
    if Path("/proc/meminfo").exists():
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                info[key] = value.strip()
    return info


def phase_facts(a: argparse.Namespace) -> int:
    """The host, PRISM's imports (each failure a problem), the corpus built once; on a CUDA
    session a torch that sees no GPU is a problem. Exit status 0 when ok."""
    ph = Phase("facts", a)
    ph.data.update(python=sys.version.split()[0], executable=sys.executable, platform=platform.platform(),
                   cpus=os.cpu_count(), uid=os.getuid(), memory=_memory(), cgroup=_cgroup(),
                   disk_free_gib={p: round(shutil.disk_usage(p).free / 2**30, 1) for p in ("/", tempfile.gettempdir())
                                  if os.path.exists(p)})
    ph.data["nvidia_smi"] = _sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used,compute_cap",
                                 "--format=csv,noheader"])
    failed = {}
    for mod in IMPORTS:
        try:
            __import__(mod)
        except Exception as exc:  # noqa: BLE001 - any import error is the finding
            failed[mod] = f"{type(exc).__name__}: {exc}"
    ph.data["imports_failed"] = failed
    ph.problems += [f"import {m}: {e}" for m, e in failed.items()]
    import torch

    cuda = torch.cuda.is_available()
    ph.data["torch"] = {"version": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": cuda,
                        "devices": torch.cuda.device_count() if cuda else 0,
                        "name": torch.cuda.get_device_name(0) if cuda else None,
                        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
                        "bf16": torch.cuda.is_bf16_supported() if cuda else None}
    if a.device == "cuda" and not cuda:
        ph.problems.append("torch.cuda.is_available() is False on a --device cuda session")
    if not failed:
        from prism_challenge.data.builtin import ensure_builtin
        from prism_challenge.evaluator import gpu, isolation

        ph.data["driver"] = gpu.driver_version()
        ph.data["sandbox_backend"] = isolation.available_backend()
        t0 = time.monotonic()
        ph.data["corpus"] = str(ensure_builtin())
        ph.data["corpus_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(ph.data, indent=1, default=str), flush=True)
    return ph.finish()


def phase_children(a: argparse.Namespace) -> int:
    """The jailed CUDA check child (on a CPU host it must report ``is_available() is False``),
    then the example and the cuda-count bundle with held-out and audit children. Exit status 0 when ok."""
    from prism_challenge.evaluator import gpu
    from prism_challenge.evaluator.isolation import Limits
    from prism_challenge.evaluator.jail import Jail

    ph = Phase("children", a)
    with tempfile.TemporaryDirectory() as d:
        jail = Jail.open("strict", bundle_dir=d, hidden=[], limits=Limits(), threads=1)
        try:
            ph.data["cuda_check"] = {"ok": True, "stack": gpu.start_cuda_check(jail, 1).result()}
        except gpu.CudaCheckError as exc:
            ph.data["cuda_check"] = {"ok": False, "error": str(exc)}
        finally:
            jail.close()
    check = ph.data["cuda_check"]
    if a.device == "cuda" and not check["ok"]:
        ph.problems.append(f"the jailed CUDA check child: {check['error']}")
    if a.device == "cpu" and (check["ok"] or "is_available() is False" not in check["error"]):
        ph.problems.append(f"the jailed CUDA check child on a CPU host: want 'is_available() is False', got {check}")
    print(f"[children] jailed CUDA check child: {json.dumps(check)[:600]}", flush=True)
    tokens, seq_len, heldout = TINY["dry" if a.dry_run else "device"]
    with tempfile.TemporaryDirectory(prefix="prism-probes-") as d:
        count = write_variant("cuda-count", Path(d) / "cuda-count")
        for key, bundle in (("example", ROOT / "examples" / "tiny-1m"), ("cuda_count", count)):
            ph.run_eval(key, bundle, tokens=tokens, seq_len=seq_len, heldout=heldout, cap=90)
    return ph.finish()


DRY_COMPILE = ("torch.compile(model)", 'torch.compile(model, backend="aot_eager")')
"""The dry run's one change to the compile probe: Dynamo and AOTAutograd as on the GPU, without
inductor's C++ build of the kernels (90 s of a 2-core machine; on CUDA inductor writes Triton)."""


def phase_probes(a: argparse.Namespace) -> int:
    """The three probe bundles, each a small honest run that must come out clean. Exit status 0 when ok."""
    ph = Phase("probes", a)
    tokens, seq_len, heldout = TINY["dry" if a.dry_run else "device"]
    with tempfile.TemporaryDirectory(prefix="prism-probes-") as d:
        for key, name in (("bf16cast", "bf16-cast"), ("autocast", "autocast-loop"), ("compile", "compile")):
            bundle = write_variant(name, Path(d) / name)  # compile last: the slowest to start
            if key == "compile" and a.dry_run:
                text = (bundle / "training.py").read_text()
                if text.count(DRY_COMPILE[0]) != 1:
                    raise ValueError(f"{bundle.name}/training.py: want one '{DRY_COMPILE[0]}'")
                (bundle / "training.py").write_text(text.replace(*DRY_COMPILE))
                ph.data["compile_backend"] = "aot_eager (dry run)"
            ph.run_eval(key, bundle, tokens=tokens, seq_len=seq_len, heldout=heldout, cap=120)
    return ph.finish()


def big_variant(work: Path, precision: str, dims: dict[str, int], batch: int) -> Path:
    """A copy of ``bench/bundles/gpt2-100m`` under ``work``: ``dims`` (``D_MODEL``, ...) and
    ``BATCH`` rewritten, ``scoring_autocast: <precision>`` (``"fp32"`` or ``"bf16"``) in its
    ``prism.yaml`` whatever the profile's, and for ``"bf16"`` the loop's ``AUTOCAST`` on.

    Raises:
        ValueError: a constant to rewrite is not in the bundle as ``NAME = <int>`` once.
    """
    out = work / f"gpt2-100m-{precision}"
    shutil.copytree(BENCH / "bundles" / "gpt2-100m", out)

    def rewrite(file: str, name: str, value: str) -> None:
        p = out / file
        text, n = re.subn(rf"^{name} = \S+$", f"{name} = {value}", p.read_text(), flags=re.M)
        if n != 1:
            raise ValueError(f"{p}: want one line '{name} = ...', found {n}")
        p.write_text(text)

    for name, value in dims.items():
        rewrite("architecture.py", name, str(value))
    rewrite("training.py", "BATCH", str(batch))
    if precision == "bf16":
        rewrite("training.py", "AUTOCAST", "True")
    with open(out / "prism.yaml", "a") as f:
        f.write(f"scoring_autocast: {precision}\n")
    return out


def phase_bigmodel(a: argparse.Namespace) -> int:
    """The large model in bf16 then fp32: the harness's run, then the bare loop on the batches the
    harness streamed; tokens per second over each stream and their ratio (bare time / harness
    time). A run that fails, carries a flag or whose audit did not pass is a problem."""
    from overhead import BenchFailure, cut_batches, run_bare, run_harness

    ph = Phase("bigmodel", a)
    size = BIG["dry" if a.dry_run else "device"]
    with tempfile.TemporaryDirectory(prefix="prism-big-") as d:
        for precision in ("bf16", "fp32"):  # the chosen scoring precision first
            bundle = big_variant(Path(d), precision, size["dims"], size["batch"])
            try:
                h = run_harness(str(bundle), size["tokens"], size["seq_len"], a.threads, "strict", device=a.device,
                                timeout_s=ph.left(150))
                npz = Path(d) / f"batches-{precision}.npz"
                cut_batches(str(bundle), h["tokens"], size["batch"], size["seq_len"], npz)
                b = run_bare(str(bundle), npz, 50257, size["seq_len"], a.threads, device=a.device,
                             timeout_s=ph.left(90))
            except BenchFailure as exc:
                ph.problems.append(f"{precision}: {str(exc)[:800]}")
                print(f"[bigmodel] {precision}: FAILED: {str(exc)[:800]}", flush=True)
                continue
            tokens = h["tokens"]
            rec = {"tokens": tokens, "harness_tokens_per_s": tokens / h["stream"],
                   "bare_tokens_per_s": tokens / b["stream"],
                   "ratio_stream": b["stream"] / h["stream"], "ratio_whole": b["total"] / h["whole"],
                   "harness_whole_s": h["whole"], "harness_after_stream_s": h["after"], "bare_total_s": b["total"],
                   "final_score": h["final_score"], "flags": h["flags"], "audit_passed": h["audit_passed"],
                   "bpb": h["bpb"]}
            ph.data[precision] = rec
            ph.problems += [f"{precision}: flag {f}" for f in h["flags"] if f != "heldout_unavailable"]
            ph.problems += [f"{precision}: audit not passed"] if h["audit_passed"] is not True else []
            print(f"[bigmodel] {precision}: {tokens:,} tokens; harness {rec['harness_tokens_per_s']:,.0f} "
                  f"tokens/s over the stream, bare {rec['bare_tokens_per_s']:,.0f}: ratio {rec['ratio_stream']:.3f} (whole command "
                  f"{rec['ratio_whole']:.3f}; after the stream {h['after']:.1f} s); final_score {h['final_score']}, "
                  f"flags {h['flags']}, audit passed {h['audit_passed']}", flush=True)
    return ph.finish()


PHASES = {"facts": phase_facts, "children": phase_children, "probes": phase_probes, "bigmodel": phase_bigmodel}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("phase", choices=list(PHASES))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--result", required=True, help="this phase's result JSON")
    a = p.parse_args()
    return PHASES[a.phase](a)


if __name__ == "__main__":
    sys.exit(main())
