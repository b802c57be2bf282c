#!/usr/bin/env python3
"""Keep only one GPU architecture's code in the CUDA fat binaries of ELF .so files.

A CUDA extension carries its device code in the ELF section `.nv_fatbin`, as
a run of fatbin blobs (one per compiled translation unit). Each blob is a
16-byte header (magic 0xBA55ED50, version u16, header size u16, payload size
u64) followed by entries; each entry has its own header (kind u16: 1 = PTX,
2 = SASS/ELF cubin; header size u32 at +4; payload size u64 at +8; SM arch u32
at +28) and payload.

For every blob we keep, in this order of preference:
  1. its SASS entries for exactly sm_ARCH (what the GPU runs directly);
  2. else its PTX entries for arch <= ARCH (the driver JIT-compiles them);
  3. else (nothing usable on this GPU anyway) its smallest entry, so the blob
     stays well formed.
The kept entries move to the start of the blob, the blob's payload size is
updated and the freed tail is zeroed: xz squeezes zeros to nothing, and blob
start offsets (which the host code points at) do not move. So the file size is
unchanged; only its compressed size drops.

The result is a Hopper-only (ARCH=90) build. The kept cubins are byte-identical
to the originals. Usage: prune_fatbin.py ARCH FILE.so [...]  (edits in place)
"""
from __future__ import annotations

import struct
import sys

BLOB_MAGIC = 0xBA55ED50
KIND_PTX, KIND_SASS = 1, 2


def fatbin_section(data: bytes) -> tuple[int, int] | None:
    """(file offset, size) of .nv_fatbin in a 64-bit little-endian ELF, or None."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return None
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx][4]
    for name_off, _type, _flags, _addr, off, size in headers:
        end = data.index(b"\0", strtab + name_off)
        if data[strtab + name_off:end] == b".nv_fatbin":
            return off, size
    return None


def blob_entries(data: bytes, start: int, end: int) -> list[tuple[int, int, bytes]]:
    """(kind, arch, raw bytes) of every entry between start and end."""
    out, q = [], start
    while q < end:
        kind, _ver, hsize, psize = struct.unpack_from("<HHIQ", data, q)
        arch = struct.unpack_from("<I", data, q + 28)[0]
        out.append((kind, arch, bytes(data[q:q + hsize + psize])))
        q += hsize + psize
    if q != end:
        raise ValueError(f"fatbin entries overrun the blob at {start:#x}")
    return out


def choose(entries, arch):
    keep = [e for e in entries if e[0] == KIND_SASS and e[1] == arch]
    if not keep:
        keep = [e for e in entries if e[0] == KIND_PTX and e[1] <= arch]
    if not keep:
        keep = [min(entries, key=lambda e: len(e[2]))]
    return keep


def blobs(data: bytes, off: int, size: int):
    """Yield (blob start, header size, payload size) for the blobs in the section."""
    p, end = off, off + size
    while p + 16 <= end:
        magic, _ver, hsize, psize = struct.unpack_from("<IHHQ", data, p)
        if magic != BLOB_MAGIC:  # alignment padding between blobs
            p += 8
            continue
        yield p, hsize, psize
        p += hsize + psize


def prune(path: str, arch: int) -> tuple[int, int]:
    """Prune one file in place; returns (payload bytes before, after)."""
    data = bytearray(open(path, "rb").read())
    sec = fatbin_section(data)
    if sec is None:
        return 0, 0
    before = after = 0
    for p, hsize, psize in list(blobs(data, *sec)):
        start, end = p + hsize, p + hsize + psize
        keep = choose(blob_entries(data, start, end), arch)
        body = b"".join(e[2] for e in keep)
        data[start:end] = body + bytes(psize - len(body))
        struct.pack_into("<Q", data, p + 8, len(body))
        before, after = before + psize, after + len(body)
    # Re-read what we wrote: every blob must parse and hold only chosen entries.
    for p, hsize, psize in blobs(data, *sec):
        ents = blob_entries(data, p + hsize, p + hsize + psize)
        assert ents and all(e[0] != KIND_SASS or e[1] == arch for e in ents) or len(ents) == 1
    open(path, "wb").write(data)
    return before, after


def main():
    arch = int(sys.argv[1])
    total_b = total_a = 0
    for f in sys.argv[2:]:
        b, a = prune(f, arch)
        if b:
            print(f"  {f}: fatbin payload {b / 2**20:.1f} MiB -> {a / 2**20:.1f} MiB")
        total_b, total_a = total_b + b, total_a + a
    print(f"fatbin payload total {total_b / 2**20:.1f} MiB -> "
          f"{total_a / 2**20:.1f} MiB (sm_{arch})")


if __name__ == "__main__":
    main()
