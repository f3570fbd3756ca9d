"""Hostile calls for tests/test_audit.py: each function is one attack, run from a bundle frame
after the audit hook is armed. Every one must end the process with the hook's refusal."""
import ctypes
import os
import socket
import subprocess
import sys


def dlopen_bundle_file(bundle_dir, target):
    ctypes.CDLL(os.path.join(bundle_dir, "lib.txt"))


def dlopen_libc(bundle_dir, target):
    ctypes.CDLL(None)


def torch_load_library(bundle_dir, target):
    import torch

    torch.ops.load_library(os.path.join(bundle_dir, "lib.txt"))


def extension_from_tmp(bundle_dir, target):
    import importlib.util

    spec = importlib.util.spec_from_file_location("evil", target)
    importlib.util.module_from_spec(spec)


def read_salt(bundle_dir, target):
    with open(target, "rb") as f:
        f.read()


def write_outside(bundle_dir, target):
    with open(target, "w") as f:
        f.write("x")


def rewrite_gated_file(bundle_dir, target):
    with open(os.path.join(bundle_dir, "attacks.py"), "a") as f:
        f.write("# rewritten\n")


def connect_loopback(bundle_dir, target):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.connect(("127.0.0.1", int(target)))


def spawn_process(bundle_dir, target):
    subprocess.run(["/bin/true"])


def os_system(bundle_dir, target):
    os.system("true")


def fork(bundle_dir, target):
    os.fork()


def import_not_allowed(bundle_dir, target):
    import xml.dom.minidom  # noqa: F401  (not imported by the harness; outside the allow-list)


def frames(bundle_dir, target):
    sys._getframe(1)


def swallowed(bundle_dir, target):
    try:
        os.system("true")
    except BaseException:
        pass
    print("survived")


def reopen_fd(bundle_dir, target):
    open(0, "rb", closefd=False)


def stdlib_lazy_import(bundle_dir, target):
    """An honest call whose stdlib code imports a module lazily (idna for a host name)."""
    return "b\u00fccher.example".encode("idna").decode()


def plant_module(bundle_dir, target):
    """Write a module where the import path might look, then have stdlib code import it."""
    import importlib

    with open(os.path.join(target, "colorsys.py"), "w") as f:
        f.write("PLANTED = True\n")
    sys.path.insert(0, target)
    importlib.import_module("colorsys")  # imported on the bundle's behalf by the stdlib
    print("survived")


def import_path_after_arm(bundle_dir, target):
    return [p for p in sys.path if p in ("", target) or p.startswith(target + os.sep)]


CALLS = []


class SneakyPath(str):
    """A path whose methods would run inside the hook, with its guard up, if the hook called them."""

    def __getitem__(self, k):
        CALLS.append(k)
        return str.__getitem__(self, k)

    def __fspath__(self):
        CALLS.append("fspath")
        return str(self)


def str_subclass_path(bundle_dir, target):
    with open(SneakyPath(os.path.join(target, "trigger.txt")), "w") as f:
        f.write("x")
    return CALLS


def relative_to_dir_fd(bundle_dir, target):
    fd = os.open(target, os.O_RDONLY)
    os.open("../data.salt", os.O_RDONLY, dir_fd=fd)
    print("survived")
