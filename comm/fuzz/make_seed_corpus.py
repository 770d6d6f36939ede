#!/usr/bin/env python3
"""Writes the rendezvous fuzz seeds into comm/fuzz/corpus/rendezvous/.

Each seed is an input for harness.h's RunRendezvousInput: byte 0 picks the
operations, byte 1 how the peer ends (bit 0: close), then the peer's bytes
as frames (a length byte, then that many bytes; length 0: a read that times
out). The seeds are a healthy server's conversations (whole, and one byte
per frame) and the hostile ones the client must refuse by name.

Usage: comm/fuzz/make_seed_corpus.py   (from the repository root)
"""
import os
import random
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "rendezvous")
NONCE = 0x01020304  # harness.cc's kNonce


def frame(data=b""):
    assert len(data) < 256
    return bytes([len(data)]) + data


def timeout():
    return b"\x00"


def u64(v):
    return struct.pack("<Q", v)


def i64(v):
    return struct.pack("<q", v)


HANDSHAKE = frame(struct.pack("<I", NONCE)) + frame(i64(1))  # ping echo, "init/" add
# A healthy server's replies, by operation (harness.cc's cycle).
HEALTHY = [
    b"",                                 # set: no reply
    frame(b"\x00") + frame(u64(1) + b"v"),  # get: the wait, then the value
    frame(i64(5)),                       # add
    frame(b"\x00"),                      # check: ready
    frame(b"\x00"),                      # wait: STOP_WAITING
    frame(i64(1)),                       # delete
    frame(i64(3)),                       # num_keys
    frame(u64(1) + b"v"),                # compare_set
]


def ops(start, count):
    return bytes([start % 8 + ((count - 1) % 8 << 3)])


def healthy(start, count):
    return b"".join(HEALTHY[(start + i) % 8] for i in range(count))


def bytewise(frames):
    """The same bytes, one per frame (timeouts kept)."""
    out = b""
    while frames:
        n = frames[0]
        if n == 0:
            out += timeout()
        for b in frames[1:1 + n]:
            out += frame(bytes([b]))
        frames = frames[1 + n:]
    return out


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = random.Random(27)
    seeds = {
        "healthy_all_ops": ops(0, 8) + b"\x00" + HANDSHAKE + healthy(0, 8),
        "healthy_from_check": ops(3, 8) + b"\x01" + HANDSHAKE + healthy(3, 8),
        "healthy_bytewise": ops(1, 8) + b"\x00" + bytewise(HANDSHAKE + healthy(1, 8)),
        "wait_timeout_cancel_ack": ops(4, 2) + b"\x00" + HANDSHAKE + timeout() +
            frame(b"\x01") + HEALTHY[5],
        "wait_timeout_late_stop_then_ack": ops(4, 2) + b"\x00" + HANDSHAKE + timeout() +
            frame(b"\x00") + frame(b"\x01") + HEALTHY[5],
        "wait_timeout_no_ack": ops(4, 2) + b"\x00" + HANDSHAKE + timeout(),
        "get_huge_length": ops(1, 1) + b"\x00" + HANDSHAKE + frame(b"\x00") +
            frame(b"\xff" * 8),
        "get_one_over_limit": ops(1, 1) + b"\x00" + HANDSHAKE + frame(b"\x00") +
            frame(u64(65) + b"x" * 65),
        "get_at_limit": ops(1, 2) + b"\x00" + HANDSHAKE + frame(b"\x00") +
            frame(u64(64) + b"x" * 64) + HEALTHY[2],
        "get_close_mid_value": ops(1, 1) + b"\x01" + HANDSHAKE + frame(b"\x00") +
            frame(u64(10) + b"abc"),
        "add_silent_mid_reply": ops(2, 3) + b"\x00" + HANDSHAKE + frame(b"\x01\x02\x03"),
        "check_bad_byte": ops(3, 1) + b"\x00" + HANDSHAKE + frame(b"\x07"),
        "wait_bad_byte": ops(4, 1) + b"\x00" + HANDSHAKE + frame(b"\x09"),
        "num_keys_negative": ops(6, 1) + b"\x00" + HANDSHAKE + frame(i64(-1)),
        "delete_two": ops(5, 1) + b"\x00" + HANDSHAKE + frame(i64(2)),
        "ping_wrong_echo": ops(0, 1) + b"\x00" + frame(struct.pack("<I", NONCE ^ 1)),
        "handshake_garbage": ops(0, 8) + b"\x00" +
            frame(bytes(rng.randrange(256) for _ in range(200))),
        "handshake_http": ops(0, 1) + b"\x01" + frame(b"HTTP/1.1 400 Bad Request\r\n\r\n"),
        "silent": ops(0, 1) + b"\x00",
        "closed_at_once": ops(0, 1) + b"\x01",
    }
    for name, data in sorted(seeds.items()):
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    print(f"wrote {len(seeds)} seeds to {OUT}")


if __name__ == "__main__":
    main()
