"""Where a file is: `FileStat`, the bytes-level half of a file's identity.

What a file holds is `grain_cells.io._identity`.

Design notes: docs/reference/design.md#storage-identity.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class FileStat:
    """Where a file is and when it last changed (`os.stat` fields)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    etag: str = ""  # objects in a store: their ETag (dev, ino and ctime are 0)
    # Objects whose ETag does not follow their content (HTTP servers): a
    # digest of sampled bytes (`grain_cells.storage.remote._versions`).
    content: str = ""
    # zarr stores (a directory or bucket prefix of many keys): a digest of
    # every key with its size and modification time, or its ETag
    # (`grain_cells.zarr._store.store_digest`); the other fields are 0.
    store: str = ""

    @classmethod
    def of(cls, st: os.stat_result) -> FileStat:
        """The fields of a `stat` result."""
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def matches(self, st: os.stat_result) -> bool:
        """Whether a local file's `stat` result is this, field by field.

        No `FileStat` is built: a many-file fetch asks once per file.
        """
        return not (
            st.st_ino != self.ino
            or st.st_dev != self.dev
            or st.st_size != self.size
            or st.st_mtime_ns != self.mtime_ns
            or st.st_ctime_ns != self.ctime_ns
            or self.etag
            or self.content
            or self.store
        )

    def changes(self, now: FileStat) -> list[str]:
        """What differs between this (then) and `now`, in words."""
        out = []
        if self.store != now.store:
            return [
                "the zarr store's keys, sizes or modification times differ "
                f"(store digest {self.store[:16] or 'none'} then, "
                f"{now.store[:16] or 'none'} now): a chunk or metadata file was "
                "written, added or removed"
            ]
        if self.etag != now.etag:
            out.append(f"ETag {self.etag or 'none'} then, {now.etag or 'none'} now")
        if (self.dev, self.ino) != (now.dev, now.ino):
            out.append(
                f"the path now names another file (inode {self.ino} on device "
                f"{self.dev} then, {now.ino} on {now.dev} now)"
            )
        if self.size != now.size:
            out.append(f"size {self.size} bytes then, {now.size} now")
        if self.mtime_ns != now.mtime_ns:
            out.append(f"modified (mtime {self.mtime_ns} ns then, {now.mtime_ns} now)")
        if self.content != now.content and not out:
            # "blocks:" digests cover every byte (storage option verify_reads).
            what = (
                "digest of every block (verify_reads)"
                if (self.content or "").startswith("blocks:")
                else "digest of sampled bytes"
            )
            out.append(
                f"its bytes differ ({what} {self.content or 'none'} "
                f"then, {now.content or 'none'} now) while its size, ETag and "
                "Last-Modified are unchanged: rewritten in place with its "
                "modification time kept (rsync -t, cp -p) on a server whose ETag "
                "follows size and modification time, not content (nginx, Apache)"
            )
        if self.ctime_ns != now.ctime_ns and not out:
            out.append(
                f"inode changed (ctime {self.ctime_ns} ns then, {now.ctime_ns} "
                "now): written with its mtime restored, or its permissions changed"
            )
        return out
