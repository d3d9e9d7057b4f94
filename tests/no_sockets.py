"""A process environment where every internet socket is refused, as on a sandboxed TPU host.

Such a host refuses ``socket(AF_INET | AF_INET6, ...)`` with EAFNOSUPPORT, loopback included,
for Python and native code alike (gloo, libzmq); unix sockets work. :func:`environment` builds
a tiny ``LD_PRELOAD`` library that does the same in the processes it is given to (their children
inherit it), or skips the test where there is no C compiler.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/socket.h>
int socket(int domain, int type, int protocol) {
    static int (*real)(int, int, int);
    if (domain == AF_INET || domain == AF_INET6) { errno = EAFNOSUPPORT; return -1; }
    if (!real) real = (int (*)(int, int, int))dlsym(RTLD_NEXT, "socket");
    return real(domain, type, protocol);
}
"""


def environment(tmp: Path, base: dict | None = None) -> dict:
    """``base`` (default: this process's environment) with internet sockets refused."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the socket-refusing preload library")
    source, library = tmp / "no_sockets.c", tmp / "libno_sockets.so"
    source.write_text(_SOURCE)
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"],
                   check=True, capture_output=True, timeout=60)
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = str(library)
    return env
