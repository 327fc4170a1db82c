#!/usr/bin/python3
"""Writes the seed corpus of the net fuzz harnesses (tests/fuzz/corpus/).

Run from anywhere; the files are committed, so this only needs running again
when the wire format changes. Encodings are written by hand (no msgpack
module needed) to mirror docs/net.md.
"""
import hashlib
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))

# ---- msgpack, the few encodings we need -------------------------------------------
def mp_str(s):
    b = s.encode()
    if len(b) < 32:
        return bytes([0xa0 | len(b)]) + b
    if len(b) < 256:
        return b"\xd9" + bytes([len(b)]) + b
    return b"\xda" + struct.pack(">H", len(b)) + b

def mp_uint(v):
    if v < 128:
        return bytes([v])
    if v < 256:
        return b"\xcc" + bytes([v])
    if v < 65536:
        return b"\xcd" + struct.pack(">H", v)
    if v < 2**32:
        return b"\xce" + struct.pack(">I", v)
    return b"\xcf" + struct.pack(">Q", v)

def mp_map(pairs, wide=False):
    n = len(pairs)
    head = b"\xdf" + struct.pack(">I", n) if wide else (bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n))
    return head + b"".join(k + v for k, v in pairs)

def msg(t, v, extra=(), wide=False):
    return mp_map([(mp_str("t"), mp_uint(t)), (mp_str("v"), mp_uint(v))] + list(extra), wide)

MSG_SEEDS = {
    "minimal": msg(1, 1),
    "map32_header": msg(7, 2, wide=True),
    "fields": msg(3, 1, [
        (mp_str("seq"), mp_uint(12345)),
        (mp_str("name"), mp_str("peer-17")),
        (mp_str("neg"), b"\xd3" + struct.pack(">q", -5)),
        (mp_str("f64"), b"\xcb" + struct.pack(">d", 0.25)),
        (mp_str("f32"), b"\xca" + struct.pack(">f", 1.5)),
        (mp_str("yes"), b"\xc3"),
        (mp_str("nil"), b"\xc0"),
        (mp_str("bin"), b"\xc4\x03abc"),
        (mp_str("u64"), mp_uint(2**64 - 1)),
    ]),
    "nested": msg(4, 1, [
        (mp_str("members"), b"\x92" + mp_map([(mp_str("k"), b"\xc4\x04abcd"), (mp_str("inc"), mp_uint(3))]) +
         mp_map([(mp_str("k"), b"\xc4\x04efgh"), (mp_str("inc"), mp_uint(9))])),
        (mp_str("deep"), b"\x91" * 13 + b"\xc0"),
        (mp_str("arr16"), b"\xdc\x00\x03\x01\x02\x03"),
        (mp_str("long"), mp_str("x" * 300)),
    ]),
    "bomb_array32_4G": b"\xdd\xff\xff\xff\xff",
    "bomb_array32_512M": b"\xdd\x20\x00\x00\x00",
    "bomb_in_map": msg(1, 1, [(mp_str("x"), b"\xdd\xff\xff\xff\xff")]),
    "bomb_nested_array32": b"\xdd\x00\x00\x00\x01" * 32 + b"\xc0",
    "bomb_nested_array32_in_map": msg(1, 1, [(mp_str("x"), b"\xdd\x00\x00\x00\x01" * 32 + b"\xc0")]),
    "bomb_depth33": msg(1, 1, [(mp_str("x"), b"\x91" * 32 + b"\xc0")]),
    "bomb_map32_4G": msg(1, 1, [(mp_str("x"), b"\xdf\xff\xff\xff\xff")]),
    "bomb_str32_4G": msg(1, 1, [(mp_str("x"), b"\xdb\xff\xff\xff\xff")]),
    "ext_timestamp": msg(1, 1, [(mp_str("x"), b"\xd6\xff\x00\x00\x00\x00")]),
    "reserved_c1": msg(1, 1, [(mp_str("x"), b"\xc1")]),
    "trailing": msg(1, 1) + b"\x00",
    "truncated": msg(3, 1, [(mp_str("name"), mp_str("peer-17"))])[:-3],
    "no_type": mp_map([(mp_str("v"), mp_uint(1))]),
}

# ---- frames --------------------------------------------------------------------------
READY, MSG, BEGIN, DATA, END, ABORT, RESULT, BYE = range(1, 9)
F32, F16, BF16 = 1, 2, 3

def rec(t, a, b, payload=b""):
    return struct.pack(">BIIH", t, a, b, len(payload)) + payload

def begin(dtype, digest, chunk, meta=b""):
    return bytes([dtype, 1 if digest else 0, 0, 0]) + struct.pack(">I", chunk) + meta

def transfer_digest(count, dtype, chunk_elems, chunks):
    root = hashlib.blake2b(digest_size=32, person=b"rumor.bulk.root\x00")
    root.update(struct.pack(">QBI", count, dtype, chunk_elems))
    for i, c in enumerate(chunks):
        leaf = hashlib.blake2b(c, digest_size=32, person=b"rumor.bulk.leaf\x00", salt=struct.pack(">QQ", 0, i))
        root.update(leaf.digest())
    return root.digest()

def transfer(tid, count, dtype, chunk_elems, digest=True, meta=b"meta"):
    size = 4 if dtype == F32 else 2
    data = bytes((i * 7) & 0xff for i in range(count * size))
    chunks = [data[o:o + chunk_elems * size] for o in range(0, len(data), chunk_elems * size)]
    out = rec(BEGIN, tid, count, begin(dtype, digest, chunk_elems, meta))
    for i, c in enumerate(chunks):
        out += rec(DATA, tid, i * chunk_elems, c)
    out += rec(END, tid, count, transfer_digest(count, dtype, chunk_elems, chunks) if digest else b"")
    return out

SPLIT = b"\x05"
FRAME_SEEDS = {
    "sealed_msg": b"\x01" + SPLIT + rec(MSG, 0, 0, MSG_SEEDS["fields"]),
    "sealed_msgs_then_bye": b"\x01" + SPLIT + rec(MSG, 0, 0, MSG_SEEDS["minimal"]) +
        rec(MSG, 0, 0, MSG_SEEDS["nested"]) + rec(BYE, 0, 0),
    "sealed_bomb": b"\x01" + SPLIT + rec(MSG, 0, 0, MSG_SEEDS["bomb_in_map"]),
    "sealed_transfer_f32": b"\x01\x02" + transfer(1, 100, F32, 32),
    "sealed_transfer_f16": b"\x01\x09" + transfer(1, 77, F16, 16),
    "sealed_transfer_bf16_nodigest": b"\x01\x00" + transfer(1, 50, BF16, 50, digest=False),
    "sealed_two_transfers": b"\x01\x03" + transfer(1, 10, F32, 4) + rec(MSG, 0, 0, MSG_SEEDS["minimal"]) +
        transfer(2, 5, F16, 5),
    "sealed_transfer_bad_digest": b"\x01\x02" + transfer(1, 8, F32, 8)[:-32] + b"\x00" * 32,
    "sealed_refused": b"\x01\x02" + transfer(1, 16, F32, 8, meta=b"x-refuse"),
    "sealed_abort": b"\x01\x02" + rec(BEGIN, 1, 64, begin(F32, True, 16)) + rec(DATA, 1, 0, b"\x00" * 64) +
        rec(ABORT, 1, 0),
    "sealed_results": b"\x01\x02" + rec(RESULT, 1, 0) + rec(RESULT, 2, 1) + rec(RESULT, 3, 3) + rec(RESULT, 9, 0),
    "sealed_ready_on_server": b"\x01\x02" + rec(READY, 0, 0),
    "raw_4GiB_header": b"\x00\x00" + b"\xff\xff\xff\xff" + bytes([MSG]) + b"\x00" * 19,
    "raw_unsealed_frame": b"\x00\x03" + struct.pack(">IBBHQQ", 20 + 4 + 16, MSG, 0, 0, 0, 0) + b"\x80\x00\x00\x00" +
        b"\x00" * 16,
    "raw_garbage": b"\x00\x07" + bytes(range(256)),
    "hs_hello_shape": b"\x02" + b"rumr" + bytes([1, 1, 1, 3]) + bytes(32) + bytes(16),
    "hs_hello_future": b"\x02" + b"rumr" + bytes([1, 2, 3, 3]) + bytes(48),
    "hs_reject": b"\x02" + b"rumr" + bytes([0x7f, 2, 1, 1]),
    "hs_welcome_shape": b"\x02" + b"rumr" + bytes([2, 1, 1, 0]) + bytes(32) + bytes(112),
}

# mode 3: the same sealed sessions through the async (worker) path
for name in [k for k in FRAME_SEEDS if k.startswith("sealed_")]:
    FRAME_SEEDS["async_" + name[len("sealed_"):]] = b"\x03" + FRAME_SEEDS[name][1:]
FRAME_SEEDS["async_two_transfers_reverse"] = b"\x03\x83" + FRAME_SEEDS["sealed_two_transfers"][2:]
FRAME_SEEDS["async_transfer_f16_reverse"] = b"\x03\x89" + FRAME_SEEDS["sealed_transfer_f16"][2:]

def write(kind, seeds):
    d = os.path.join(HERE, "corpus", kind)
    os.makedirs(d, exist_ok=True)
    for name, data in seeds.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)

if __name__ == "__main__":
    write("msg", MSG_SEEDS)
    write("frame", FRAME_SEEDS)
    print("wrote %d msg and %d frame seeds" % (len(MSG_SEEDS), len(FRAME_SEEDS)))
