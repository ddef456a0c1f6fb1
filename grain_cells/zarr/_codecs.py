"""Decoding one stored zarr chunk in the caller's thread (numcodecs, crc32c).

Design notes: docs/reference/design.md#zarr-codecs.
"""

from __future__ import annotations

import dataclasses

import numcodecs
import numpy as np
import zarr

from grain_cells.formats import ChunkDecodeError

MAX_UINT_64 = 2**64 - 1
# zarr's v3 bytes-to-bytes codecs decoded by numcodecs: its name, the decoder.
_NUMCODECS = {
    "ZstdCodec": ("zstd", lambda c: numcodecs.Zstd(level=c.level, checksum=c.checksum)),
    "BloscCodec": ("blosc", lambda c: numcodecs.Blosc()),
    "GzipCodec": ("gzip", lambda c: numcodecs.GZip(level=c.level)),
}


def _crc32c_check(raw) -> memoryview:
    import google_crc32c

    view = memoryview(raw)
    if len(view) < 4:
        raise ChunkDecodeError(f"{len(view)} bytes, too short for its crc32c")
    body, stored = view[:-4], int.from_bytes(view[-4:], "little")
    found = google_crc32c.value(bytes(body))
    if found != stored:
        raise ChunkDecodeError(
            f"crc32c mismatch: stored {stored:#010x}, computed {found:#010x}"
        )
    return body


def _bytes_stage(codec) -> tuple | None:
    """A v3 bytes-to-bytes codec as a decoding callable, or None if unknown."""
    name = type(codec).__name__
    if name == "Crc32cCodec":
        return ("crc32c", _crc32c_check)
    if name in _NUMCODECS:
        return (_NUMCODECS[name][0], _NUMCODECS[name][1](codec).decode)
    # zarr.codecs.numcodecs.* ("numcodecs.lz4", ...): after the `bytes`
    # codec, every codec of a chain is bytes-to-bytes.
    spec = codec.to_dict()
    cname = str(spec.get("name", ""))
    if not cname.startswith("numcodecs."):
        return None
    try:
        config = {"id": cname[len("numcodecs.") :], **(spec.get("configuration") or {})}
        return (cname, numcodecs.get_codec(config).decode)
    except (ValueError, KeyError, TypeError):
        return None


@dataclasses.dataclass(frozen=True)
class Codec:
    """Decodes the stored bytes of one (inner) chunk; `stages`: `(name, decode)`."""

    stored_dtype: np.dtype
    chunk_shape: tuple[int, ...]
    order: str
    stages: tuple
    shard: ShardLayout | None = None

    @classmethod
    def for_array(cls, array: zarr.Array) -> Codec | None:
        """The decoder of `array`'s chunks, or None if not one handled here."""
        meta = array.metadata
        dtype = np.dtype(array.dtype)
        if dtype.hasobject or dtype.kind not in "biuf":
            return None
        if meta.zarr_format == 2:
            stored = np.dtype(meta.to_dict()["dtype"])
            codecs = [meta.compressor, *reversed(meta.filters or ())]
            stages = tuple((c.codec_id, c.decode) for c in codecs if c is not None)
            return cls(stored, tuple(meta.chunks), meta.order, stages)
        codecs = list(meta.codecs)
        shard = None
        chunk_shape = tuple(array.chunks)
        if len(codecs) == 1 and type(codecs[0]).__name__ == "ShardingCodec":
            sc = codecs[0]
            inner = tuple(sc.chunk_shape)
            index = _v3_stages(list(sc.index_codecs), np.dtype("<u8"))
            if index is None:
                return None
            shard_shape = tuple(meta.chunk_grid.chunk_shape)
            loc = sc.index_location  # an enum in zarr 3.1, a str in 3.4
            per_shard = tuple(s // c for s, c in zip(shard_shape, inner, strict=False))
            at_end = str(getattr(loc, "value", loc)) == "end"
            nbytes = 16 * int(np.prod(per_shard)) + index[2]
            shard = ShardLayout(shard_shape, per_shard, at_end, index[1], nbytes)
            codecs, chunk_shape = list(sc.codecs), inner
        parsed = _v3_stages(codecs, dtype)
        if parsed is None:
            return None
        stored, stages, _ = parsed
        return cls(stored, chunk_shape, "C", stages, shard)

    @property
    def chunk_items(self) -> int:
        return int(np.prod(self.chunk_shape, dtype=np.int64))

    def describe(self) -> str:
        names = [n for n, _ in self.stages] or ["uncompressed"]
        return "+".join(names) + (", sharded" if self.shard else "")

    def decode(self, buf) -> np.ndarray:
        """The chunk as an array of `chunk_shape`, native order (`ChunkDecodeError`)."""
        try:
            for _, stage in self.stages:
                buf = stage(buf)
        except ChunkDecodeError:
            raise
        except Exception as e:  # codecs raise RuntimeError, ValueError, ...
            raise ChunkDecodeError(f"{type(e).__name__}: {e}") from None
        flat = np.frombuffer(buf, self.stored_dtype)
        if flat.size != self.chunk_items:
            raise ChunkDecodeError(
                f"decoded {flat.size} values, the chunk shape "
                f"{self.chunk_shape} holds {self.chunk_items}"
            )
        if not self.stored_dtype.isnative:
            flat = flat.astype(self.stored_dtype.newbyteorder("="))
        if self.order == "F" and len(self.chunk_shape) > 1:
            return flat.reshape(self.chunk_shape, order="F")
        return flat.reshape(self.chunk_shape)


def _v3_stages(codecs: list, dtype: np.dtype):
    """`(stored dtype, decode stages, trailing bytes)` of a v3 codec chain."""
    stored = dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype
    seen_bytes = False
    stages = []
    trailing = 0
    for c in codecs:
        name = type(c).__name__
        if name == "BytesCodec":
            if seen_bytes:
                return None
            seen_bytes = True
            endian = getattr(c, "endian", None)  # an enum in zarr 3.1, a str in 3.4
            endian = str(getattr(endian, "value", endian) or "little")
            if endian not in ("little", "big"):
                return None
            if dtype.itemsize > 1:
                stored = dtype.newbyteorder("<" if endian == "little" else ">")
            continue
        if not seen_bytes:  # an array-to-array codec (transpose, ...)
            return None
        stage = _bytes_stage(c)
        if stage is None:
            return None
        if stage[0] == "crc32c":
            trailing += 4
        stages.append(stage)
    if not seen_bytes:
        return None
    return stored, tuple(reversed(stages)), trailing


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Where a shard keeps its inner chunks (zarr v3 `sharding_indexed`)."""

    shard_shape: tuple[int, ...]
    per_shard: tuple[int, ...]
    at_end: bool
    index_stages: tuple
    index_nbytes: int

    def parse_index(self, raw) -> np.ndarray:
        """`(n_inner, 2)` uint64 offsets and lengths (MAX_UINT_64: absent)."""
        if len(raw) != self.index_nbytes:
            raise ChunkDecodeError(
                f"shard index is {len(raw)} bytes, expected {self.index_nbytes} "
                "(the shard is truncated)"
            )
        buf = raw
        for _, stage in self.index_stages:
            buf = stage(buf)
        return np.frombuffer(buf, "<u8").reshape(-1, 2)
