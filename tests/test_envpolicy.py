"""The jailed processes' environment: an allow-list with a reason for each entry, loopback-only
collectives, and the rendezvous pinned to 127.0.0.1 (evaluator/envpolicy.py, launcher.py)."""

import pytest

from prism_challenge.evaluator import envpolicy
from prism_challenge.evaluator.envpolicy import ENV_KEEP, ENV_KEEP_PREFIXES, RANK_NETWORK_ENV, sandbox_env
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
        "HOME": "/tmp",
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
