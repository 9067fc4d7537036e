"""A training process's memory management: the C allocator's thresholds, and Python's collector.

Keep the C allocator from handing every freed tensor back to the OS (glibc only; a no-op elsewhere).

Dask's nanny starts workers with `MALLOC_TRIM_THRESHOLD_=65536` (`distributed.nanny.pre-spawn-environ`),
which helps long-lived pandas workers give memory back. For training it is ruinous: setting any malloc
threshold turns off glibc's dynamic mmap threshold, so every tensor above 128 KiB (each activation and
gradient) is mmapped and unmapped again, and the next step faults its pages back in. Measured on this
machine (docs/design/traps.md): one CNN step of batch 128 took 96 ms instead of 28 ms, half of it
system time. `tune_allocator` puts back the thresholds that glibc's dynamic mode would reach (32 MiB
mmap, 64 MiB trim) in the running process, whatever the environment said.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's ceiling for its dynamic mmap threshold on 64-bit
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # the ratio glibc's dynamic mode keeps

_tuned = False
_frozen = False


def tune_allocator() -> bool:
    """Set the malloc thresholds of this process once; True if they are set (glibc Linux)."""
    global _tuned
    if _tuned:
        return True
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.warning("mallopt refused the thresholds; tensors may be re-faulted every step")
    _tuned = ok
    return ok


def freeze_startup_objects() -> bool:
    """Move every live object Python's collector tracks into its permanent generation (`gc.freeze`), once
    per process; True the first time.

    Why: a Dask worker that has imported torch tracks about 210,000 objects (340,000 with a job's model
    built), nearly all of them modules, classes and functions that live as long as the process. Every full
    collection scans them all, and one came about every 20 s of training: 116 to 204 ms each here, a pause
    of the shard or the compute loop that the whole step waits for (a sync transformer run of 23 s paused
    320 ms in full collections, about 1.4% of it). Frozen, they are never scanned again: the same run had
    no full collection at all, and its young collections scanned only the objects made since.

    Garbage is collected first, so none is frozen: that collection is the one full scan left (0.1 to 0.2 s),
    and it is why the callers run this where it costs least: a data server's start (the job's start), a
    standby's warm-up (so a promotion finds it done, unless the standby joined too late to be warmed), a
    compute loop after its first step (not on a joining worker's way to that step). A frozen object that
    later becomes part of a garbage cycle is never freed, which is why it runs once."""
    global _frozen
    if _frozen:
        return False
    _frozen = True
    gc.collect()
    gc.freeze()
    return True
