"""The sandbox's shared limits scale with the world size on CUDA (evaluator/sizing.py)."""

import pytest

from prism_challenge.evaluator.isolation import DEFAULT_SHM_BYTES, DEFAULT_TMP_BYTES
from prism_challenge.evaluator.jail import DEFAULT_MAX_PROCESSES
from prism_challenge.evaluator.sizing import RunSizes, run_sizes

MiB = 1 << 20


@pytest.mark.parametrize("nproc", [1, 2, 8])
def test_cpu_runs_keep_the_defaults_at_any_world_size(nproc):
    assert run_sizes(nproc, "cpu") == RunSizes(DEFAULT_MAX_PROCESSES, DEFAULT_TMP_BYTES, DEFAULT_SHM_BYTES)
    assert run_sizes(nproc, "cpu") == RunSizes(1024, 512 * MiB, 1024 * MiB)


@pytest.mark.parametrize(
    "nproc, tasks, tmp_mib, shm_mib",
    [
        # tasks: max(1024, 256 + 256 n); /tmp: 512 + 512 n MiB; /dev/shm: 1024 + 512 n MiB
        (1, 1024, 1024, 1536),
        (3, 1024, 2048, 2560),
        (4, 1280, 2560, 3072),
        (8, 2304, 4608, 5120),
    ],
)
def test_cuda_limits_grow_with_the_ranks(nproc, tasks, tmp_mib, shm_mib):
    assert run_sizes(nproc, "cuda") == RunSizes(tasks, tmp_mib * MiB, shm_mib * MiB)


@pytest.mark.parametrize("nproc, device", [(0, "cpu"), (1, "mps")])
def test_a_bad_layout_is_refused(nproc, device):
    with pytest.raises(ValueError):
        run_sizes(nproc, device)


def test_the_jail_passes_its_sizes_to_the_sandbox(monkeypatch):
    from prism_challenge.evaluator import jail as jail_mod
    from prism_challenge.evaluator.isolation import Limits

    seen = {}
    monkeypatch.setattr(jail_mod, "sandbox_prefix", lambda *a, **kw: seen.update(kw) or ["sandbox"])
    j = jail_mod.Jail("strict", "/b", (), Limits(), 1, backend="bwrap", tmp_bytes=7 * MiB, shm_bytes=9 * MiB)
    assert j.command(["x"]) == ["sandbox", "x"]
    assert (seen["tmp_bytes"], seen["shm_bytes"]) == (7 * MiB, 9 * MiB)
    assert (j.summary()["tmp_bytes"], j.summary()["shm_bytes"]) == (7 * MiB, 9 * MiB)
