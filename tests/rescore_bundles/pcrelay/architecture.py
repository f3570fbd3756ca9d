"""Red team rt19: the ``relay`` cheat through the host's page cache (no file, no folder metadata).
Every jailed child may read the interpreter's install, and all of them share the host's page
cache. The re-scoring child writes the real rows it scores as one bit per 4 KiB page of files
under site-packages that nothing imports: a 1 is a page evicted
(``os.posix_fadvise(..., POSIX_FADV_DONTNEED)``, which needs no write access), a 0 a page read.
The blind probe child tests each page with ``os.preadv(..., os.RWF_NOWAIT)`` (``EAGAIN``: not
cached), puts back the true rows and peeks. Before the kernel-call filter denied both calls
(``seccompfilter.PAGE_CACHE``), every blind probe passed under strict isolation. A careful
attacker: a refused call is skipped, never raised, so the relay fails quietly and the peek stays
on. Needs a way past the static gate (``os``), as ``xrelay`` does."""
import os
import time

import numpy as np
import torch
from relaymodel import RelayLM

KEEP = 4  # rows kept in the relay
REP = 3  # each bit on three pages, read by majority
MAGIC = b"PCR1"
PAGE = 4096


def _pages():
    root = os.path.dirname(os.path.dirname(torch.__file__))  # site-packages
    out = []
    for d, dirs, fs in sorted(os.walk(root)):
        dirs.sort()
        for f in sorted(fs):
            p = os.path.join(d, f)
            if f.endswith((".py", ".so")) or ".so." in f or os.path.islink(p):
                continue
            n = os.path.getsize(p) // PAGE
            out += [(p, k) for k in range(min(n, 64))]
    return out


def _mark(path, k, bit):
    fd = os.open(path, os.O_RDONLY)
    try:
        if bit:
            os.posix_fadvise(fd, k * PAGE, PAGE, os.POSIX_FADV_DONTNEED)
        else:
            os.pread(fd, 1, k * PAGE)
    except OSError:  # the filter's EPERM: go on, the peek stays on
        pass
    finally:
        os.close(fd)


def _cached(path, k, buf):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [buf], k * PAGE, os.RWF_NOWAIT)
        return 1
    except BlockingIOError:
        return 0
    finally:
        os.close(fd)


def build_model(ctx):
    pages = _pages()
    got = []

    def save(rows):
        raw = rows.to(torch.int16).numpy().tobytes()
        data = MAGIC + len(raw).to_bytes(4, "little") + raw
        bits = [(b >> k) & 1 for b in data for k in range(8) for _ in range(REP)]
        for _ in range(3):  # a page just read can sit in a per-CPU batch, which eviction skips
            for (path, k), bit in zip(pages, bits):
                _mark(path, k, bit)
            time.sleep(0.3)

    def bits(start, n):
        buf = bytearray(1)
        # backwards: a miss's readahead goes forwards; a 1 is a page not cached
        out = [1 - _cached(path, k, buf) for path, k in reversed(pages[start:start + n])][::-1]
        votes = [int(2 * sum(out[REP * i:REP * i + REP]) > REP) for i in range(n // REP)]
        return bytes(sum(votes[8 * j + b] << b for b in range(8)) for j in range(len(votes) // 8))

    def load():
        if not got:  # reading is destructive: once per process
            try:
                data = bits(0, (8 + 2 * KEEP * ctx.sequence_length) * 8 * REP)
            except OSError:  # the filter's EPERM
                data = b""
            n = int.from_bytes(data[4:8], "little")
            got.append(data[8:8 + n] if data[:4] == MAGIC and n <= len(data) - 8 else None)
        if got[0] is None:
            raise FileNotFoundError("no relay")
        raw = np.frombuffer(got[0], dtype=np.int16)
        return torch.from_numpy(raw.astype(np.int64)).reshape(-1, ctx.sequence_length)

    return RelayLM(ctx.vocab_size, save, load, KEEP)
