// The fuzz harness for comm's rendezvous client (c10d's TCPStore protocol,
// comm/internal/store_protocol.h), shared by the libFuzzer target
// (rendezvous_fuzzer.cc, built and run by tools/fuzz.sh) and
// //comm/fuzz:corpus_replay_test, which replays the committed corpus and
// regressions through it under Bazel. No LibTorch, no sockets: the peer is
// the input.
//
// Input layout:
//   byte 0   the operations: after the handshake and the "init/" add, a
//            run of 1 + (byte0 >> 3) % 8 operations from the cycle set, get,
//            add, check, wait, delete, num_keys, compare_set, starting at
//            byte0 % 8 (keys "k", values "v")
//   byte 1   bit 0: at the end of the input the peer closes the connection
//            (1) or falls silent (0)
//   rest     what the peer sends, as frames: a length byte L, then L bytes,
//            each frame delivered by one or more reads of at most L bytes;
//            L = 0 is a read that times out (a silent peer, for a while).
//
// Oracles, beyond "no crash, no leak, no unbounded allocation":
//   * ParseReply, for every reply kind over the peer's bytes: an error is
//     DataLoss naming the peer; an incomplete parse asks for more than 0 and
//     at most header + limit bytes; a complete parse consumes no more than
//     it was given, its value is within the limit and equal to the bytes
//     after the length; every shorter prefix of a complete reply parses as
//     incomplete, never as an error or a different reply.
//   * The session: every error names the peer; after the first error that
//     breaks it, every operation fails with FailedPrecondition without
//     sending or reading a byte; values returned are within the limit.
//   * Every request the client sent is well formed (a known query byte and
//     its arguments, lengths matching), so a correct server would accept it.
// On a violation the harness prints what it saw and calls abort(), which
// libFuzzer records as a crash.
#pragma once

#include <cstddef>
#include <cstdint>

namespace comm {
namespace fuzz {

void RunRendezvousInput(const uint8_t* data, size_t size);

}  // namespace fuzz
}  // namespace comm
