"""The jailed processes' environment: an allow-list with a reason for each entry, loopback-only
collectives, and the rendezvous pinned to 127.0.0.1 (evaluator/envpolicy.py, launcher.py)."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from prism_challenge.evaluator import envpolicy
from prism_challenge.evaluator.envpolicy import ENV_KEEP, ENV_KEEP_PREFIXES, RANK_NETWORK_ENV, sandbox_env
from prism_challenge.evaluator import isolation
from prism_challenge.evaluator.isolation import Limits
from prism_challenge.evaluator.jail import Jail
from prism_challenge.evaluator.launcher import torchrun_command

HOST = {
    "PATH": "/usr/bin", "LC_ALL": "C.UTF-8", "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64::rel/dir:/opt/compat",
    "CUDA_VISIBLE_DEVICES": "2,3", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0", "NCCL_NET": "IB",
    "NCCL_NET_PLUGIN": "aws-ofi", "NCCL_TOPO_FILE": "/etc/topo.xml", "NCCL_TOPO_DUMP_FILE": "/tmp/t.xml",
    "GLOO_SOCKET_IFNAME": "eth0", "MASTER_ADDR": "10.0.0.1", "TORCHINDUCTOR_CACHE_DIR": "/host/cache",
    "HF_TOKEN": "hf_secret", "NVIDIA_VISIBLE_DEVICES": "all", "HOME": "/root",
}


def test_the_allow_list_keeps_the_gpu_settings_and_drops_the_rest():
    env = sandbox_env(HOST)
    assert env == {
        "PATH": "/usr/bin", "LC_ALL": "C.UTF-8",
        "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64:/opt/compat",  # the empty and relative entries named the cwd
        "CUDA_VISIBLE_DEVICES": "2,3", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "NCCL_DEBUG": "INFO", "NVIDIA_VISIBLE_DEVICES": "all",
        "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_NET_PLUGIN": "none",
        "PYTHONSAFEPATH": "1", "HOME": "/tmp",
    }


def test_every_kept_variable_has_a_reason():
    for name, reason in {**ENV_KEEP, **ENV_KEEP_PREFIXES}.items():
        assert isinstance(reason, str) and len(reason) > 10, name
    # nothing that points NCCL at a network, a plugin or a topology file is kept from the host
    assert not [n for n in ENV_KEEP if n.startswith(("NCCL_NET", "NCCL_IB", "NCCL_TOPO", "NCCL_SOCKET"))]
    assert not [p for p in ENV_KEEP_PREFIXES if p.startswith(("NCCL", "TORCH", "NVIDIA"))]
    assert set(RANK_NETWORK_ENV) == {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_NET_PLUGIN"}


@pytest.mark.parametrize("value", ["", ":", "lib:./x"])
def test_a_library_path_of_relative_entries_only_is_dropped(value):
    assert "LD_LIBRARY_PATH" not in sandbox_env({"LD_LIBRARY_PATH": value})


def test_the_rendezvous_and_master_address_are_loopback():
    argv = torchrun_command(2)
    assert "--standalone" not in argv  # it would listen on localhost and publish socket.getfqdn()
    assert {"--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--local-addr=127.0.0.1"} <= set(argv)
    assert envpolicy.RENDEZVOUS_ADDR == "127.0.0.1"
    assert argv[argv.index("--nproc-per-node=2") + 1:] == ["--max-restarts=0", "--monitor-interval=0.5", "-m",
                                                           "prism_challenge.evaluator.rank"]


PLANTED = "open('planted-ran', 'w').write('yes')\n"
PROBE = "import os\nprint(os.getcwd())\ntry:\n    import plantedmod\nexcept ImportError:\n    pass"


@pytest.mark.skipif(isolation.available_backend() is None, reason="no working sandbox backend")
def test_a_module_planted_in_the_working_directory_is_never_imported_by_a_jailed_interpreter():
    """Every jailed process works in the artifacts folder, which the submission writes (the
    parameter cap's child runs build_model there while the ranks warm up, before their audit
    hook is armed): no jailed interpreter may import from it (red team). The folder is made
    beside the tests, as a run directory is beside its user: the sandbox's private /tmp hides
    the session's temporary folders, and a jailed process whose folder it cannot see works in /."""
    work = Path(tempfile.mkdtemp(prefix=".planted-", dir=Path(__file__).parent))
    try:
        (work / "plantedmod.py").write_text(PLANTED)
        bare = subprocess.run([sys.executable, "-c", PROBE], cwd=work, capture_output=True, text=True,
                              env={k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"})
        assert (work / "planted-ran").read_text() == "yes"  # the control: a bare interpreter runs it
        (work / "planted-ran").unlink()
        jail = Jail.open("strict", bundle_dir=work, hidden=[], limits=Limits(), threads=1)
        try:
            done = jail.run([sys.executable, "-c", PROBE], timeout_s=60, writable=[str(work)], cwd=work)
            assert done.stdout.decode().strip() == str(work)  # it works there, as a rank does
            assert not (work / "planted-ran").exists(), done.stderr
            done = jail.run([sys.executable, "-m", "plantedmod"], timeout_s=60, writable=[str(work)], cwd=work)
            assert done.returncode != 0 and b"No module named plantedmod" in done.stderr
            assert not (work / "planted-ran").exists()
        finally:
            jail.close()
        assert bare.returncode == 0
    finally:
        shutil.rmtree(work)
