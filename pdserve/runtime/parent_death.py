"""A child that dies with its parent: the rank processes (runtime/launcher.py) and the processes
`pdserve up` starts (router/launch.py) must not outlive what started them, however it dies."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG; nothing elsewhere).
    Safe as a Popen preexec_fn: no locks, no allocation beyond ctypes' call."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
