"""The checkpoints of one job in one folder of any fsspec URL, written so that a reader sees one whole.

Writes are atomic for a reader: the bytes go to a temporary name (`.tmp-<random>.pt`) that no reader looks
at, then move to the final name (`ckpt-<step>.pt`). On a file system the move is a rename, atomic by POSIX.
On an object store (S3, GCS, ...) there is no rename: the move is a server-side copy to the final key and a
delete of the temporary one; the store creates an object only when its bytes are complete (one PUT, or a
multipart upload's completion, or a copy), so a reader of the final key gets all of the checkpoint or no
object at all, never part of one. A writer that dies between upload and move leaves a temporary object,
which readers ignore and the next prune removes. Readers only consider final names, newest first, and list
the folder afresh each time (another process may have written since). Old checkpoints are pruned to `keep`.
docs/storage.md says the same for users.
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

import fsspec

from ..dataset import explain_storage_error, is_object_store
from ..errors import JobConfigError
from .record import Checkpoint

log = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
_TEMPORARY = re.compile(r"^\.tmp-[0-9a-f]{32}\.pt$")


class CheckpointStore:
    """The checkpoints of one job in one folder (any fsspec URL; `storage_options` are the keyword
    arguments its filesystem needs, such as an S3 endpoint: `ElasticJob.storage_for` gives them).

    One writer per folder: the job's controller (a second controller of the same job is refused by the
    coordinator's registry). Readers may be anywhere, at any time.
    """

    def __init__(self, url: str, keep: int = 3, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.keep = keep
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        # s3fs's makedirs creates a missing *bucket*: a typo in the URL would make a bucket instead of
        # failing. An object store needs no folders anyway (a key prefix is one), so none is made there.
        self._make_folders = not is_object_store(self.fs)

    def check_writable(self) -> None:
        """Fails before training starts if the folder cannot be written."""
        probe = f"{self.root}/.prefect-elastic-probe-{uuid.uuid4().hex}"
        try:
            if self._make_folders:
                self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm_file(probe)
        except FileNotFoundError as exc:
            if not self._make_folders:
                bucket = self.root.split("/", 1)[0]
                raise JobConfigError(
                    "checkpoint",
                    self.url,
                    f"cannot write there: its bucket {bucket!r} does not exist ({exc}); fix the URL, or "
                    "create the bucket (prefect-elastic never creates buckets)",
                ) from exc
            raise self._unwritable(exc) from exc
        except Exception as exc:
            raise self._unwritable(exc) from exc

    def _unwritable(self, exc: Exception) -> JobConfigError:
        return JobConfigError(
            "checkpoint",
            self.url,
            f"cannot write there: {explain_storage_error(exc, self.storage_options)}; give a folder URL "
            "this process and the flow can write",
        )

    def _entries(self) -> list[str]:
        """The names in the folder as the store has them now (not as this process listed them before)."""
        # s3fs and others cache listings per process; a checkpoint another process wrote would be missed.
        self.fs.invalidate_cache(self.root)
        try:
            found = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in found]

    def names(self) -> list[str]:
        """The checkpoints in the folder, oldest first (temporaries and other files are not checkpoints)."""
        return sorted(n for n in self._entries() if _NAME.match(n))

    def write(self, checkpoint: Checkpoint) -> str:
        """Write `checkpoint` and return its URL; raises what the storage raised when it cannot, after
        removing its temporary (on a full disk, half a checkpoint would hold the room the next try needs)."""
        data = checkpoint.to_bytes()
        final = f"{self.root}/ckpt-{checkpoint.committed_steps:09d}.pt"
        temporary = f"{self.root}/.tmp-{uuid.uuid4().hex}.pt"
        try:
            if self._make_folders:
                self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(temporary, data)
            self.fs.mv(temporary, final)
        except BaseException:
            try:
                self.fs.rm_file(temporary)
            except Exception as exc:  # (never made, or the folder refuses removals too: the next prune)
                log.debug("removing the temporary %s: %s", temporary, exc)
            raise
        try:
            self.prune()
        except Exception as exc:
            # The checkpoint is whole under its final name; older ones stay until a prune succeeds.
            log.warning("checkpoint %s written, but pruning %s failed: %s", final, self.url, exc)
        log.info("checkpoint written: %s (step %d, %d bytes)", final, checkpoint.committed_steps, len(data))
        return self._url_of(final)

    def prune(self) -> None:
        """Keep the newest `keep` checkpoints; remove older ones and temporaries that a writer which died
        before its move left behind (the one writer of this folder is past its own move by now)."""
        entries = self._entries()
        checkpoints = sorted(n for n in entries if _NAME.match(n))
        stale = [n for n in entries if _TEMPORARY.match(n)]
        for name in [*checkpoints[: -self.keep], *stale]:
            self.fs.rm_file(f"{self.root}/{name}")

    def latest(self) -> tuple[Checkpoint, str] | None:
        """The newest checkpoint and its URL; None when the folder holds none."""
        names = self.names()
        if not names:
            return None
        path = f"{self.root}/{names[-1]}"
        return Checkpoint.from_bytes(self.fs.cat_file(path), self._url_of(path)), self._url_of(path)

    def _url_of(self, path: str) -> str:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return path if protocol == "file" else f"{protocol}://{path}"
