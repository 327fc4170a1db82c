#!/usr/bin/python3
"""Writes the seed corpus of the fuzz harnesses (tests/fuzz/corpus/).

Run from anywhere; the files are committed, so this only needs running again
when a format changes. Encodings are written by hand (no msgpack or
safetensors module needed) to mirror docs/net.md, gossip's member updates
(gossip/runtime.c) and the safetensors reader (peer/train/safetensors.c).
"""
import hashlib
import json
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
READY, MSG, BEGIN, DATA, END, ABORT, RESULT, BYE, PING = range(1, 10)
F32, F16, BF16 = 1, 2, 3

# Sealed-mode inputs are lists of records (type, a, b, payload) that the
# harness seals one after another with its peer key (fuzz_frame.c: key_in,
# AES-256-GCM, the record's index as the nonce). The transfer digest of
# protocol version 2 hashes the DATA frames' AEAD tags, so END's payload is
# computed here by sealing the same frames (python3-cryptography).
FUZZ_KEY_IN = bytes([1, 2, 3]) + bytes(29)

def rec(t, a, b, payload=b""):
    return [(t, a, b, payload)]

class Digest:
    """END's payload, worked out when the records are laid out."""
    def __init__(self, count, dtype, chunk_elems):
        self.params = struct.pack(">QBI", count, dtype, chunk_elems)

def aead_tag(pos, t, a, b, payload):
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    hdr = struct.pack(">IBBHQQ", 20 + len(payload) + 16, t, 0, 0, a, b)
    return AESGCM(FUZZ_KEY_IN).encrypt(bytes(4) + struct.pack(">Q", pos), payload, hdr)[-16:]

def records(recs):
    """The harness's input bytes for recs: u8 type, u32 a, u32 b, u16 len, payload."""
    out, tags = b"", []
    for pos, (t, a, b, payload) in enumerate(recs):
        if t == BEGIN:
            tags = []
        if isinstance(payload, Digest):
            root = hashlib.blake2b(digest_size=32, person=b"rumor.bulk.tags\x00")
            root.update(payload.params + b"".join(tags))
            payload = root.digest()
        if t == DATA:
            tags.append(aead_tag(pos, t, a, b, payload))
        out += struct.pack(">BIIH", t, a, b, len(payload)) + payload
    return out

def begin(dtype, digest, chunk, meta=b""):
    return bytes([dtype, 1 if digest else 0, 0, 0]) + struct.pack(">I", chunk) + meta

def transfer(tid, count, dtype, chunk_elems, digest=True, meta=b"meta", seed=7):
    size = 4 if dtype == F32 else 2
    data = bytes((i * seed) & 0xff for i in range(count * size))
    chunks = [data[o:o + chunk_elems * size] for o in range(0, len(data), chunk_elems * size)]
    out = rec(BEGIN, tid, count, begin(dtype, digest, chunk_elems, meta))
    for i, c in enumerate(chunks):
        out += rec(DATA, tid, i * chunk_elems, c)
    out += rec(END, tid, count, Digest(count, dtype, chunk_elems) if digest else b"")
    return out

def spliced(tid, count, chunk_elems):
    """An f32 transfer whose second chunk carries another buffer's bytes at
    the right position, sealed by the sender: the END digest (over the tags
    the sender meant to send) no longer matches: reported as corrupt."""
    good = transfer(tid, count, F32, chunk_elems)
    other = transfer(tid, count, F32, chunk_elems, seed=11)
    body = records(good)  # the digest over the intended chunks
    end = good[-1][:3] + (body[-32:],)
    return good[:2] + other[2:3] + good[3:-1] + [end]

SPLIT = b"\x05"
def sealed(split, recs):
    return b"\x01" + split + records(recs)

FRAME_SEEDS = {
    "sealed_msg": sealed(SPLIT, rec(MSG, 0, 0, MSG_SEEDS["fields"])),
    "sealed_msgs_then_bye": sealed(SPLIT, rec(MSG, 0, 0, MSG_SEEDS["minimal"]) +
        rec(MSG, 0, 0, MSG_SEEDS["nested"]) + rec(BYE, 0, 0)),
    "sealed_bomb": sealed(SPLIT, rec(MSG, 0, 0, MSG_SEEDS["bomb_in_map"])),
    "sealed_transfer_f32": sealed(b"\x02", transfer(1, 100, F32, 32)),
    "sealed_transfer_f16": sealed(b"\x09", transfer(1, 77, F16, 16)),
    "sealed_transfer_bf16_nodigest": sealed(b"\x00", transfer(1, 50, BF16, 50, digest=False)),
    "sealed_two_transfers": sealed(b"\x03", transfer(1, 10, F32, 4) + rec(MSG, 0, 0, MSG_SEEDS["minimal"]) +
        transfer(2, 5, F16, 5)),
    "sealed_transfer_bad_digest": sealed(b"\x02", transfer(1, 8, F32, 8)[:-1] + rec(END, 1, 8, b"\x00" * 32)),
    "sealed_transfer_spliced_chunk": sealed(b"\x02", spliced(1, 24, 8)),
    "sealed_transfer_reordered_chunks": sealed(b"\x02", (lambda t: t[:1] + t[2:3] + t[1:2] + t[3:])(
        transfer(1, 24, F32, 8))),
    "sealed_transfer_truncated": sealed(b"\x02", transfer(1, 24, F32, 8)[:-2] + rec(END, 1, 24, bytes(32))),
    "sealed_refused": sealed(b"\x02", transfer(1, 16, F32, 8, meta=b"x-refuse")),
    "sealed_abort": sealed(b"\x02", rec(BEGIN, 1, 64, begin(F32, True, 16)) + rec(DATA, 1, 0, b"\x00" * 64) +
        rec(ABORT, 1, 0)),
    "sealed_results": sealed(b"\x02", rec(RESULT, 1, 0) + rec(RESULT, 2, 1) + rec(RESULT, 3, 3) + rec(RESULT, 9, 0)),
    "sealed_ready_on_server": sealed(b"\x02", rec(READY, 0, 0)),
    # the heartbeat (protocol version 3): PINGs between the frames of a transfer, then one with a payload
    "sealed_pings": sealed(b"\x02", rec(PING, 250, 0) + (lambda t: t[:2] + rec(PING, 250, 0) + t[2:])(
        transfer(1, 24, F32, 8)) + rec(MSG, 0, 0, MSG_SEEDS["minimal"]) + rec(PING, 0, 0) + rec(PING, 1, 0, b"x")),
    "raw_4GiB_header": b"\x00\x00" + b"\xff\xff\xff\xff" + bytes([MSG]) + b"\x00" * 19,
    "raw_unsealed_frame": b"\x00\x03" + struct.pack(">IBBHQQ", 20 + 4 + 16, MSG, 0, 0, 0, 0) + b"\x80\x00\x00\x00" +
        b"\x00" * 16,
    "raw_garbage": b"\x00\x07" + bytes(range(256)),
    "hs_hello_shape": b"\x02" + b"rumr" + bytes([1, 2, 2, 3]) + bytes(32) + bytes(16),
    "hs_hello_v3": b"\x02" + b"rumr" + bytes([1, 2, 3, 3]) + bytes(32) + bytes(16),
    "hs_hello_future": b"\x02" + b"rumr" + bytes([1, 4, 5, 3]) + bytes(48),
    "hs_hello_v1": b"\x02" + b"rumr" + bytes([1, 1, 1, 3]) + bytes(32) + bytes(16),
    "hs_reject": b"\x02" + b"rumr" + bytes([0x7f, 2, 2, 2]),
    "hs_reject_v1": b"\x02" + b"rumr" + bytes([0x7f, 1, 1, 1]),
    "hs_welcome_shape": b"\x02" + b"rumr" + bytes([2, 2, 1, 0]) + bytes(32) + bytes(112),
}

# mode 3: the same sealed sessions through the async (worker) path
for name in [k for k in FRAME_SEEDS if k.startswith("sealed_")]:
    FRAME_SEEDS["async_" + name[len("sealed_"):]] = b"\x03" + FRAME_SEEDS[name][1:]
FRAME_SEEDS["async_two_transfers_reverse"] = b"\x03\x83" + FRAME_SEEDS["sealed_two_transfers"][2:]
FRAME_SEEDS["async_transfer_f16_reverse"] = b"\x03\x89" + FRAME_SEEDS["sealed_transfer_f16"][2:]

# ---- gossip member updates (fuzz_updates) ----------------------------------------
# Updates travel under "u" as an array of [id (bin 32), addr (str), role,
# state, incarnation, ready (bool)] (gossip_put_updates).
G_PING, G_ACK, G_PING_REQ, G_LEAVE, G_JOIN_OK, G_MEMBERS = 4, 5, 6, 7, 2, 14
SWIM_ADDR_MAX, SWIM_MAX_MEMBERS, SWIM_MAX_PIGGYBACK = 128, 4096, 16

def mp_bin(b):
    if len(b) < 256:
        return b"\xc4" + bytes([len(b)]) + b
    return b"\xc5" + struct.pack(">H", len(b)) + b

def mp_array(items):
    n = len(items)
    head = bytes([0x90 | n]) if n < 16 else (b"\xdc" + struct.pack(">H", n) if n < 65536 else
                                            b"\xdd" + struct.pack(">I", n))
    return head + b"".join(items)

def mp_bool(v):
    return b"\xc3" if v else b"\xc2"

def mp_raw_str(b):
    """A msgpack str of arbitrary bytes (not necessarily UTF-8)."""
    if len(b) < 32:
        return bytes([0xa0 | len(b)]) + b
    if len(b) < 256:
        return b"\xd9" + bytes([len(b)]) + b
    return b"\xda" + struct.pack(">H", len(b)) + b

def member_id(i):
    return hashlib.sha256(b"member %d" % i).digest()

def update(i=0, addr=None, role=0, state=0, inc=1, ready=True, id_bytes=None, fields=None):
    if fields is not None:
        return mp_array(fields)
    a = ("10.0.%d.%d:4000" % (i // 250, i % 250 + 1)).encode() if addr is None else addr
    return mp_array([mp_bin(member_id(i) if id_bytes is None else id_bytes), mp_raw_str(a), mp_uint(role),
                     mp_uint(state), mp_uint(inc), mp_bool(ready)])

def updates_msg(t, ups, extra=(), raw_u=None):
    u = raw_u if raw_u is not None else mp_array(ups)
    return msg(t, 1, [(mp_str("s"), mp_uint(7))] + list(extra) + [(mp_str("u"), u)])

ok = update()
UPDATE_SEEDS = {
    "ping_none": msg(G_PING, 1, [(mp_str("s"), mp_uint(7))]),
    "ping_0": updates_msg(G_PING, []),
    "ping_1": updates_msg(G_PING, [ok]),
    "ack_3": updates_msg(G_ACK, [update(1), update(2, state=1, inc=5), update(3, role=1, ready=False)]),
    "ping_req_2": updates_msg(G_PING_REQ, [update(4, state=2), update(5, state=3, inc=2**64 - 1)],
                              extra=[(mp_str("target"), mp_bin(member_id(9)))]),
    "leave_self": updates_msg(G_LEAVE, [update(6, state=3, inc=12, ready=False)]),
    "ack_piggyback_16": updates_msg(G_ACK, [update(i) for i in range(SWIM_MAX_PIGGYBACK)]),
    "ack_piggyback_17": updates_msg(G_ACK, [update(i) for i in range(SWIM_MAX_PIGGYBACK + 1)]),
    "join_ok_200": updates_msg(G_JOIN_OK, [update(i, state=i % 4, role=i % 2, inc=i) for i in range(200)],
                               extra=[(mp_str("model"), mp_str("mlp:784-64-10"))]),
    # SWIM_MAX_MEMBERS + 1 updates fit; one more is refused before any is read.
    "members_4097": updates_msg(G_MEMBERS, [update(i, addr=b"") for i in range(SWIM_MAX_MEMBERS + 1)]),
    "members_4098_nils": updates_msg(G_MEMBERS, [], raw_u=b"\xdc" + struct.pack(">H", SWIM_MAX_MEMBERS + 2) +
                                     b"\xc0" * (SWIM_MAX_MEMBERS + 2)),
    "arity_5": updates_msg(G_PING, [update(fields=[mp_bin(member_id(0)), mp_str("a:1"), b"\x00", b"\x00", b"\x01"])]),
    "arity_7": updates_msg(G_PING, [update(fields=[mp_bin(member_id(0)), mp_str("a:1"), b"\x00", b"\x00", b"\x01",
                                                   b"\xc3", b"\xc0"])]),
    "arity_0": updates_msg(G_PING, [b"\x90"]),
    "entry_map": updates_msg(G_PING, [mp_map([(mp_str("id"), mp_bin(member_id(0)))])]),
    "entry_nil": updates_msg(G_PING, [ok, b"\xc0"]),
    "u_map": updates_msg(G_PING, [], raw_u=mp_map([(mp_str("x"), ok)])),
    "u_str": updates_msg(G_PING, [], raw_u=mp_str("updates")),
    "u_nil": updates_msg(G_PING, [], raw_u=b"\xc0"),
    "id_str": updates_msg(G_PING, [update(fields=[mp_raw_str(member_id(0)), mp_str("a:1"), b"\x00", b"\x00",
                                                  b"\x01", b"\xc3"])]),
    "id_31": updates_msg(G_PING, [update(id_bytes=member_id(0)[:31])]),
    "id_33": updates_msg(G_PING, [update(id_bytes=member_id(0) + b"\x00")]),
    "id_0": updates_msg(G_PING, [update(id_bytes=b"")]),
    "addr_bin": updates_msg(G_PING, [update(fields=[mp_bin(member_id(0)), mp_bin(b"10.0.0.1:4000"), b"\x00",
                                                    b"\x00", b"\x01", b"\xc3"])]),
    "addr_empty": updates_msg(G_PING, [update(addr=b"")]),
    "addr_space": updates_msg(G_PING, [update(addr=b"10.0.0.1 :4000")]),
    "addr_nul": updates_msg(G_PING, [update(addr=b"10.0.0.1\x00:4000")]),
    "addr_del": updates_msg(G_PING, [update(addr=b"10.0.0.1:4000\x7f")]),
    "addr_newline": updates_msg(G_PING, [update(addr=b"10.0.0.1:4000\nX-Injected: 1")]),
    "addr_utf8": updates_msg(G_PING, [update(addr="h\u00f4te:4000".encode())]),
    "addr_127": updates_msg(G_PING, [update(addr=b"a" * (SWIM_ADDR_MAX - 7) + b":65535")]),
    "addr_128": updates_msg(G_PING, [update(addr=b"a" * (SWIM_ADDR_MAX - 6) + b":65535")]),
    "addr_long": updates_msg(G_PING, [update(addr=b"b" * 1000)]),
    "role_2": updates_msg(G_PING, [update(role=2)]),
    "role_max": updates_msg(G_PING, [update(role=2**64 - 1)]),
    "role_negative": updates_msg(G_PING, [update(fields=[mp_bin(member_id(0)), mp_str("a:1"), b"\xd0\xff", b"\x00",
                                                         b"\x01", b"\xc3"])]),
    "state_4": updates_msg(G_PING, [update(state=4)]),
    "state_float": updates_msg(G_PING, [update(fields=[mp_bin(member_id(0)), mp_str("a:1"), b"\x00",
                                                       b"\xcb" + struct.pack(">d", 1.0), b"\x01", b"\xc3"])]),
    "inc_negative": updates_msg(G_PING, [update(fields=[mp_bin(member_id(0)), mp_str("a:1"), b"\x00", b"\x00",
                                                        b"\xd3" + struct.pack(">q", -1), b"\xc3"])]),
    "ready_uint": updates_msg(G_PING, [update(fields=[mp_bin(member_id(0)), mp_str("a:1"), b"\x00", b"\x00",
                                                      b"\x01", b"\x01"])]),
    "good_then_bad": updates_msg(G_ACK, [update(1), update(2), update(3, state=9)]),
    "truncated": updates_msg(G_ACK, [update(1), update(2)])[:-20],
}

# ---- safetensors (fuzz_safetensors) ------------------------------------------------
# An 8-byte little-endian header length, a JSON header, the data. rumor adds a
# BLAKE2b-256 of the whole file under __metadata__["rumor.blake2b"], computed
# with that value's 64 hex digits set to '0'.
ST_DIGEST_KEY = "rumor.blake2b"
ST_ZEROS = "0" * 64
ST_SIZE = {"F32": 4, "I32": 4, "F16": 2, "BF16": 2}

def st_raw(header, data=b"", hlen=None):
    """A file from header text (str or bytes) and data, padded like the writer."""
    h = header.encode() if isinstance(header, str) else header
    if hlen is None:
        h += b" " * (-len(h) % 8)
        hlen = len(h)
    return struct.pack("<Q", hlen) + h + data

def st_seal(raw):
    """Fills in the digest of a file whose header holds ST_ZEROS once."""
    hlen = struct.unpack("<Q", raw[:8])[0]
    digest = hashlib.blake2b(raw, digest_size=32).hexdigest().encode()
    at = raw.index(ST_ZEROS.encode(), 8, 8 + hlen)
    return raw[:at] + digest + raw[at + 64:]

def st_file(tensors, meta=None, digest=True, extra=None):
    """tensors: (name, dtype, shape) with data filled in order; returns the file."""
    hdr, data = {}, b""
    m = dict(meta or {})
    if digest:
        m[ST_DIGEST_KEY] = ST_ZEROS
    if m or meta is not None:
        hdr["__metadata__"] = m
    for name, dtype, shape in tensors:
        n = ST_SIZE[dtype]
        for d in shape:
            n *= d
        hdr[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + n]}
        data += bytes((len(data) + i) * 37 & 0xff for i in range(n))
    hdr.update(extra or {})
    raw = st_raw(json.dumps(hdr, separators=(",", ":")), data)
    return st_seal(raw) if digest else raw

def st_entry(dtype, shape, begin, end):
    return '{"dtype":"%s","shape":%s,"data_offsets":[%d,%d]}' % (dtype, json.dumps(shape).replace(" ", ""),
                                                                 begin, end)

ST_META = {"rumor.format": "1", "rumor.model": "mlp:784-64-10", "rumor.step": "120"}
ST_BASIC = [("layers.0.weight", "F32", (3, 2)), ("layers.0.bias", "F32", (3,))]
st_valid = st_file(ST_BASIC, ST_META)
st_nodigest = st_file(ST_BASIC, ST_META, digest=False)
st_two = '{"a":%s,"b":%s}'
ST_SEEDS = {
    "valid_digest": st_valid,
    "valid_nodigest": st_nodigest,
    "valid_dtypes": st_file([("f32", "F32", (2, 2)), ("i32", "I32", (3,)), ("f16", "F16", (5,)),
                             ("bf16", "BF16", (1, 3)), ("scalar", "F32", ())], ST_META),
    "valid_zero_size": st_file([("empty", "F32", (0,)), ("w", "F32", (2,)), ("empty2", "F16", (3, 0)),
                                ("v", "I32", (1,))], {}),
    "valid_zero_size_same_offset": st_raw(st_two % (st_entry("F32", [2], 0, 8), st_entry("F32", [0], 0, 0)),
                                          bytes(8)),
    "valid_only_zero_size": st_raw(st_two % (st_entry("F32", [0], 0, 0), st_entry("BF16", [0, 7], 0, 0))),
    "valid_no_metadata": st_file(ST_BASIC, digest=False),
    "valid_empty_object": st_raw("{}"),
    "valid_empty_digest_only": st_file([], {}),
    "valid_metadata_escapes": st_file([("t\u00e9\u2603", "F32", (1,))],
                                      {"k": "tab\there \"quoted\" \\ \u20ac \U0001f600", "": "empty key",
                                       "rumor.peer_id": "x" * 300}),
    "valid_extra_fields": st_file(ST_BASIC, ST_META,
                                  extra={"__other__": {"dtype": "F32", "shape": [0], "data_offsets": [24, 24],
                                                       "note": [[[[{"deep": None}]]]], "f": 1.5e300}}),
    "valid_padded_header": st_raw('{"a":%s}' % st_entry("F32", [1], 0, 4) + " " * 13, b"\x00\x00\x80\x3f"),
    # Header length and truncation.
    "empty": b"",
    "short_length": b"\x08\x00\x00\x00",
    "header_len_1": st_raw("{", hlen=1),
    "header_len_0": struct.pack("<Q", 0),
    "header_len_past_end": st_raw('{"a":%s}' % st_entry("F32", [1], 0, 4), b"\x00" * 4, hlen=100),
    "header_len_huge": struct.pack("<Q", 2**64 - 1) + b"{}",
    "header_len_16MiB_plus": struct.pack("<Q", (16 << 20) + 1) + b"{}",
    "truncated_header": st_valid[:40],
    "truncated_data_digest": st_valid[:-4],
    "truncated_data_nodigest": st_nodigest[:-4],
    "trailing_data": st_nodigest + b"\x00" * 4,
    # Byte ranges.
    "ranges_overlap": st_raw(st_two % (st_entry("F32", [2], 0, 8), st_entry("F32", [2], 4, 12)), bytes(12)),
    "ranges_gap": st_raw(st_two % (st_entry("F32", [2], 0, 8), st_entry("F32", [2], 12, 20)), bytes(20)),
    "ranges_same": st_raw(st_two % (st_entry("F32", [2], 0, 8), st_entry("F32", [2], 0, 8)), bytes(8)),
    "ranges_reversed": st_raw('{"a":%s}' % st_entry("F32", [0], 8, 4), bytes(8)),
    "ranges_negative": st_raw('{"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}}', bytes(4)),
    "ranges_float": st_raw('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0.0,4.0]}}', bytes(4)),
    "ranges_three": st_raw('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}', bytes(8)),
    "ranges_huge": st_raw('{"a":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551612,'
                          '18446744073709551616]}}', bytes(4)),
    "ranges_int64_max": st_raw('{"a":{"dtype":"F32","shape":[1],"data_offsets":[9223372036854775803,'
                               '9223372036854775807]}}', bytes(4)),
    "size_mismatch": st_raw('{"a":%s}' % st_entry("F32", [2], 0, 4), bytes(4)),
    # Dtypes and shapes.
    "bad_dtype_f64": st_raw('{"a":%s}' % st_entry("F64", [1], 0, 8), bytes(8)),
    "bad_dtype_lower": st_raw('{"a":%s}' % st_entry("f32", [1], 0, 4), bytes(4)),
    "bad_dtype_number": st_raw('{"a":{"dtype":1,"shape":[1],"data_offsets":[0,4]}}', bytes(4)),
    "bad_dtype_missing": st_raw('{"a":{"shape":[1],"data_offsets":[0,4]}}', bytes(4)),
    "shape_5_dims": st_raw('{"a":%s}' % st_entry("F32", [1, 1, 1, 1, 1], 0, 4), bytes(4)),
    "shape_negative": st_raw('{"a":%s}' % st_entry("F32", [-1], 0, 0)),
    "shape_float": st_raw('{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}', bytes(4)),
    "shape_string": st_raw('{"a":{"dtype":"F32","shape":"1","data_offsets":[0,4]}}', bytes(4)),
    "shape_extent_2_40_plus_1": st_raw('{"a":%s}' % st_entry("F32", [2**40 + 1], 0, 4), bytes(4)),
    "shape_numel_2_41": st_raw('{"a":%s}' % st_entry("F32", [2**20, 2**21], 0, 4), bytes(4)),
    # 2^40 * 2^24 elements wrap a 64-bit count to 0, which 0 bytes would match.
    "shape_numel_wraps_to_0": st_raw('{"a":%s}' % st_entry("F32", [2**40, 2**24], 0, 0)),
    "shape_numel_wraps_to_1": st_raw('{"a":%s}' % st_entry("F32", [2**40, 2**24, 1], 0, 0)),
    "shape_zero_then_huge": st_raw('{"a":%s}' % st_entry("F32", [0, 2**40, 2**40, 2**40], 0, 0)),
    "shape_1e20": st_raw('{"a":{"dtype":"F32","shape":[100000000000000000000],"data_offsets":[0,4]}}', bytes(4)),
    # Header JSON.
    "non_object_array": st_raw("[1,2,3]"),
    "non_object_string": st_raw('"safetensors"'),
    "non_object_null": st_raw("null"),
    "tensor_not_object": st_raw('{"a":[0,4]}', bytes(4)),
    "metadata_not_object": st_raw('{"__metadata__":["x"]}'),
    "metadata_value_number": st_raw('{"__metadata__":{"rumor.step":120}}'),
    "json_invalid": st_raw('{"a":{"dtype":"F32",}}'),
    "json_nul": st_raw(b'{"a\x00":1}'),
    "json_trailing": st_raw('{} {}'),
    "deep_nesting_33": st_raw('{"__x__":' + "[" * 33 + "]" * 33 + "}"),
    "deep_nesting_32": st_raw('{"x":{"dtype":"F32","shape":[0],"data_offsets":[0,0],"n":' + "[" * 30 + "]" * 30 +
                              "}}"),
    "name_127": st_file([("n" * 127, "F32", (1,))], digest=False),
    "name_128": st_file([("n" * 128, "F32", (1,))], digest=False),
    # Duplicates.
    "dup_names": st_raw(st_two.replace('"b"', '"a"') % (st_entry("F32", [1], 0, 4), st_entry("F32", [1], 4, 8)),
                        bytes(8)),
    "dup_names_escaped": st_raw('{"a":%s,"\\u0061":%s}' % (st_entry("F32", [1], 0, 4), st_entry("F32", [1], 4, 8)),
                                bytes(8)),
    "dup_metadata": st_raw('{"__metadata__":{"a":"1"},"__metadata__":{"b":"2"}}'),
    "dup_metadata_keys": st_raw('{"__metadata__":{"a":"1","a":"2"}}'),
    # The digest.
    "digest_mismatch": st_valid[:-1] + bytes([st_valid[-1] ^ 1]),
    "digest_header_flip": st_valid.replace(b'"120"', b'"121"'),
    "digest_not_hex": st_raw('{"__metadata__":{"rumor.blake2b":"%s"}}' % ("g" * 64)),
    "digest_short": st_raw('{"__metadata__":{"rumor.blake2b":"%s"}}' % ("0" * 63)),
    "digest_twice": st_seal(st_raw('{"__metadata__":{"rumor.blake2b":"%s","rumor.blake2b":"%s"}}' %
                                   (ST_ZEROS, "1" * 64))),
    "digest_twice_tensor_key": st_seal(st_raw('{"__metadata__":{"rumor.blake2b":"%s"},"rumor.blake2b":"%s"}' %
                                              (ST_ZEROS, "1" * 64))),
    "digest_escaped_key": st_raw('{"__metadata__":{"rumor\\u002eblake2b":"%s"}}' % ("1" * 64)),
    "digest_spaced": st_raw('{"__metadata__":{"rumor.blake2b" : "%s"}}' % ("1" * 64)),
    "digest_in_tensor_entry": st_seal(st_raw('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],'
                                             '"rumor.blake2b":"%s"}}' % ST_ZEROS, bytes(4))),
    # Counts: SAFETENSORS_MAX_TENSORS is 4096.
    "too_many_tensors": st_raw("{" + ",".join('"%d":%s' % (i, st_entry("F32", [0], 0, 0)) for i in range(4097)) +
                               "}"),
}

# ---- JSON (fuzz_json) --------------------------------------------------------------
JSON_SEEDS = {
    "null": b"null", "true": b"true", "false": b" false \n", "zero": b"0", "minus_zero": b"-0",
    "minus_zero_float": b"-0.0", "int": b"-12345", "float": b"3.25e-2", "exp_upper": b"1E+2",
    "int64_max": b"9223372036854775807", "int64_max_plus_1": b"9223372036854775808",
    "int64_min": b"-9223372036854775808", "int64_min_minus_1": b"-9223372036854775809",
    "overflow_1e309": b"1e309", "overflow_neg_1e309": b"-1e309", "underflow": b"1e-400",
    "denormal": b"4.9e-324", "exp_huge": b"1e99999999999999999999", "exp_huge_neg": b"1e-99999999999999999999",
    "number_63_chars": b"1" * 63, "number_64_chars": b"1" * 64, "number_long_fraction": b"0." + b"3" * 61,
    "leading_zero": b"01", "minus_only": b"-", "dot_only": b"1.", "leading_dot": b".5", "exp_only": b"1e",
    "exp_sign_only": b"1e+", "plus": b"+1", "hex": b"0x10", "nan": b"NaN", "infinity": b"Infinity",
    "string_empty": b'""', "string": b'"hello"',
    "escapes": b'"\\"\\\\\\/\\b\\f\\n\\r\\t"',
    "unicode_escapes": b'"\\u00e9\\u20AC\\u0041"',
    "surrogate_pair": b'"\\ud83d\\ude00"',
    "surrogate_lone_high": b'"\\ud83d"', "surrogate_lone_high_end": b'"x\\ud83d',
    "surrogate_lone_low": b'"\\ude00"', "surrogate_high_high": b'"\\ud83d\\ud83d"',
    "surrogate_high_then_char": b'"\\ud83dx\\ude00"', "surrogate_high_then_bmp": b'"\\ud83d\\u0041"',
    "escape_nul": b'"a\\u0000b"', "escape_bad_hex": b'"\\u12g4"', "escape_truncated": b'"\\u12',
    "escape_short_at_quote": b'"\\u12"34', "escape_unknown": b'"\\x41"', "escape_at_end": b'"\\',
    "string_unterminated": b'"abc', "string_raw_control": b'"a\x01b"', "string_raw_nul": b'"a\x00b"',
    "string_raw_newline": b'"a\nb"',
    "utf8_raw": '"h\u00f4te \u2603 \U0001f600"'.encode(),
    "utf8_invalid": b'"\xff\xfe\xfd"', "utf8_overlong": b'"\xc0\xaf"', "utf8_truncated": b'"\xe2\x82"',
    "utf8_surrogate": b'"\xed\xa0\x80"',
    "string_long": b'"' + b"x" * 20000 + b'"',
    "string_long_escapes": b'"' + b"\\u20ac" * 3000 + b'"',
    "array_empty": b"[]", "array_empty_ws": b"[ \t\r\n]", "object_empty": b"{}",
    "array_mixed": b'[null,true,false,0,-1.5,"s",[],{},[1,[2,[3]]]]',
    "object_nested": b'{"a":{"b":[1,2,{"c":null}]},"d":"e","f":1e3}',
    "object_dup_keys": b'{"a":1,"a":2,"b":{"a":3,"a":[4]}}',
    "object_empty_key": b'{"":0}',
    "object_escaped_keys": b'{"\\u0061":1,"a":2,"\\ud83d\\ude00":3}',
    "array_many": b"[" + b"0," * 3000 + b"0]",
    "object_many": b"{" + b",".join(b'"k%d":%d' % (i, i) for i in range(600)) + b"}",
    # Depth 32 was the old reader's limit; jansson's is JSON_PARSER_MAX_DEPTH
    # (2048) containers.
    "depth_2048": b"[" * 2048 + b"]" * 2048, "depth_2049": b"[" * 2049 + b"]" * 2049,
    "value_at_depth_32": b"[" * 33 + b"]" * 33, "value_at_depth_33": b"[" * 34 + b"]" * 34,
    "value_at_depth_32_objects": b'{"a":' * 32 + b"1" + b"}" * 32,
    "value_at_depth_33_objects": b'{"a":' * 33 + b"1" + b"}" * 33,
    "depth_1000_open": b"[" * 1000,
    "array_trailing_comma": b"[1,]", "array_missing_comma": b"[1 2]", "array_leading_comma": b"[,1]",
    "object_no_colon": b'{"a"}', "object_no_value": b'{"a":}', "object_number_key": b"{1:2}",
    "object_trailing_comma": b'{"a":1,}', "object_single_quotes": b"{'a':1}",
    "trailing_garbage": b"{} x", "two_values": b"[] []", "trailing_nul": b"{}\x00", "leading_nul": b"\x00{}",
    "truncated_object": b'{"a":[1,2', "truncated_word": b"tru", "word_too_long": b"nulll",
    "empty": b"", "whitespace_only": b" \t\r\n", "bom": b"\xef\xbb\xbf{}", "vertical_tab": b"\x0b[]",
    "safetensors_header": b'{"__metadata__":{"rumor.format":"1"},"w":{"dtype":"F32","shape":[2,3],'
                          b'"data_offsets":[0,24]}}',
    "config_gpt2": b'{"architectures":["GPT2LMHeadModel"],"model_type":"gpt2","vocab_size":300,"n_inner":null,'
                   b'"layer_norm_epsilon":1e-5,"resid_pdrop":0.0,"tie_word_embeddings":true}',
}
# The reader takes an object or an array at the top (json_text.h): each scalar
# above again inside an array, so that its number or string path is reached.
JSON_SEEDS.update({"in_array_" + k: b"[" + v + b"]" for k, v in list(JSON_SEEDS.items())
                   if v.strip()[:1] not in (b"[", b"{", b"")})

# ---- llm.c token shards (fuzz_tokens) -----------------------------------------------
# The first byte picks the vocabulary (low 3 bits: 50257, 65536, 256, 1, 50304,
# 2, 65535, 1000) and the context (1 + the high 5 bits); then the file: 256
# little-endian int32 (magic 20240520, version 1, token count) and the uint16
# tokens (peer/data/tokens.c).
TOK_MAGIC = 20240520

def tok_shard(tokens, magic=TOK_MAGIC, version=1, count=None, extra=b""):
    hdr = [0] * 256
    hdr[0], hdr[1], hdr[2] = magic, version, len(tokens) if count is None else count
    return struct.pack("<256i", *hdr) + struct.pack("<%dH" % len(tokens), *tokens) + extra

def tok_seed(vocab_index, context, body):
    return bytes([vocab_index | (context - 1) << 3]) + body

TOK_RAMP = [(i * 97) % 50257 for i in range(300)]
TOKENS_SEEDS = {
    "valid_gpt2_t8": tok_seed(0, 8, tok_shard(TOK_RAMP)),
    "valid_gpt2_t1": tok_seed(0, 1, tok_shard(TOK_RAMP[:40])),
    "valid_gpt2_t32_short": tok_seed(0, 32, tok_shard(TOK_RAMP[:20])),
    "valid_one_token": tok_seed(1, 4, tok_shard([7])),
    "valid_max_token": tok_seed(1, 3, tok_shard([0, 65535, 1, 65535])),
    "valid_vocab_2": tok_seed(5, 2, tok_shard([0, 1, 1, 0, 1, 0, 0])),
    "valid_bytes": tok_seed(2, 16, tok_shard(list(b"In the beginning God created the heaven and the earth."))),
    "token_at_vocab": tok_seed(0, 8, tok_shard(TOK_RAMP[:137] + [50257] + TOK_RAMP[138:])),
    "token_65535_vocab_65535": tok_seed(6, 8, tok_shard([1, 2, 65535])),
    "token_1_vocab_1": tok_seed(3, 1, tok_shard([0, 0, 1])),
    "wrong_magic": tok_seed(0, 8, tok_shard(TOK_RAMP, magic=20240521)),
    "wrong_magic_text": tok_seed(2, 8, b"plain text is not a shard"),
    "version_2": tok_seed(0, 8, tok_shard(TOK_RAMP, version=2)),
    "version_0": tok_seed(0, 8, tok_shard(TOK_RAMP, version=0)),
    "count_zero": tok_seed(0, 8, tok_shard([])),
    "count_negative": tok_seed(0, 8, tok_shard([], count=-1)),
    "count_int_min": tok_seed(0, 8, tok_shard([], count=-2**31)),
    "count_int_max": tok_seed(0, 8, tok_shard(TOK_RAMP, count=2**31 - 1)),
    "count_one_more": tok_seed(0, 8, tok_shard(TOK_RAMP, count=301)),
    "count_one_less": tok_seed(0, 8, tok_shard(TOK_RAMP, count=299)),
    "trailing_byte": tok_seed(0, 8, tok_shard(TOK_RAMP, extra=b"\x00")),
    "truncated_odd": tok_seed(0, 8, tok_shard(TOK_RAMP)[:-1]),
    "header_only": tok_seed(0, 8, tok_shard([], count=10)),
    "header_short": tok_seed(0, 8, tok_shard(TOK_RAMP)[:1023]),
    "magic_only": tok_seed(0, 8, struct.pack("<i", TOK_MAGIC)),
    "three_bytes": tok_seed(0, 8, b"\xf8\xd3\x34"),
    "empty_file": tok_seed(0, 8, b""),
}

# ---- HTTP request heads (fuzz_http) ------------------------------------------------
# What clients of the metrics endpoint and `rumor top --web` send, good and bad
# (net/http_parse.c); NET_HTTP_HEAD_MAX is 8192.
HTTP_HEAD_MAX = 8192
HTTP_SEEDS = {
    "get_metrics": b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:9470\r\nUser-Agent: Prometheus/2.45\r\n"
                   b"Accept: text/plain\r\n\r\n",
    "get_state_query": b"GET /state.json?since=12 HTTP/1.1\r\nHost: localhost:8080\r\n\r\n",
    "get_http10_no_host": b"GET / HTTP/1.0\r\n\r\n",
    "get_bare_lf": b"GET /healthz HTTP/1.0\nHost: [::1]:9470\n\n",
    "head": b"HEAD /state.json HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n",
    "chromium": b"GET / HTTP/1.1\r\nHost: localhost:8080\r\nConnection: keep-alive\r\n"
                b"sec-ch-ua: \"Chromium\";v=\"120\"\r\nUser-Agent: Mozilla/5.0 (X11; Linux x86_64)\r\n"
                b"Accept: text/html,*/*;q=0.8\r\nAccept-Encoding: gzip, deflate\r\n\r\n",
    "bad_method_post": b"POST /state.json HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\n\r\nhello",
    "bad_method_lowercase": b"get / HTTP/1.0\r\n\r\n",
    "bad_method_pri_h2": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "no_crlf": b"GET /metrics HTTP/1.1",
    "no_blank_line": b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n",
    "huge_header": b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Pad: " + b"a" * HTTP_HEAD_MAX + b"\r\n\r\n",
    "head_at_limit": b"GET / HTTP/1.0\r\nX: " + b"b" * (HTTP_HEAD_MAX - 23) + b"\r\n\r\n",
    "flood_no_newline": b"A" * (HTTP_HEAD_MAX + 100),
    "host_foreign": b"GET /state.json HTTP/1.1\r\nHost: attacker.example:80\r\n\r\n",
    "host_rebind_ip": b"GET /state.json HTTP/1.1\r\nHost: 127.evil.example\r\n\r\n",
    "host_twice": b"GET / HTTP/1.1\r\nHost: localhost\r\nHost: attacker.example\r\n\r\n",
    "host_missing_http11": b"GET / HTTP/1.1\r\nAccept: */*\r\n\r\n",
    "host_space_before_colon": b"GET / HTTP/1.1\r\nHost : localhost\r\n\r\n",
    "nul_in_path": b"GET /sta\x00te.json HTTP/1.0\r\n\r\n",
    "nul_in_header": b"GET / HTTP/1.0\r\nX-A: \x00\r\n\r\n",
    "nul_only": b"\x00" * 64,
    "bare_cr": b"GET / HTTP/1.0\r\nX: a\rb\r\n\r\n",
    "folded_header": b"GET / HTTP/1.0\r\nX: a\r\n  b\r\n\r\n",
    "pipelined": b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\nGET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "pipelined_then_garbage": b"GET / HTTP/1.0\r\n\r\n\x00\xff\r\n\r\n",
    "leading_blank_line": b"\r\nGET / HTTP/1.0\r\n\r\n",
    "http_version_9": b"GET /\r\n\r\n",
    "http_version_12": b"GET / HTTP/1.2\r\n\r\n",
    "utf8_target": b"GET /\xc3\xa9t\xc3\xa9 HTTP/1.0\r\n\r\n",
    "del_byte": b"GET / HTTP/1.0\r\nX: \x7f\r\n\r\n",
    "empty": b"",
}

def write(kind, seeds):
    d = os.path.join(HERE, "corpus", kind)
    os.makedirs(d, exist_ok=True)
    for name, data in seeds.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)

if __name__ == "__main__":
    write("msg", MSG_SEEDS)
    write("frame", FRAME_SEEDS)
    write("updates", UPDATE_SEEDS)
    write("safetensors", ST_SEEDS)
    write("json", JSON_SEEDS)
    write("tokens", TOKENS_SEEDS)
    write("http", HTTP_SEEDS)
    print("wrote %d msg, %d frame, %d updates, %d safetensors, %d json, %d tokens and %d http seeds" %
          (len(MSG_SEEDS), len(FRAME_SEEDS), len(UPDATE_SEEDS), len(ST_SEEDS), len(JSON_SEEDS), len(TOKENS_SEEDS),
           len(HTTP_SEEDS)))
