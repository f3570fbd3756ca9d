"""Harness-side probe (standard library only): attempt each denied system call with arguments the
kernel itself would reject with another errno (a bad flag, fd -1, a NULL pointer), so ``EPERM``
can only come from the kernel-call filter. Run as ``python -I -S -c <this file's text> <json>``
where the JSON maps a label to ``[number, args...]``; prints ``{label: "ok" | errno name}``."""
import ctypes
import errno
import json
import os
import sys

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}
for label, (nr, *args) in json.loads(sys.argv[1]).items():
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    if r >= 0:
        out[label] = "ok"
        if label.startswith("socket") and r > 2:
            os.close(r)
    else:
        e = ctypes.get_errno()
        out[label] = errno.errorcode.get(e, str(e))
print(json.dumps(out))
