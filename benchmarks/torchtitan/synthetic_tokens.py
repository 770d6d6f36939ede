"""The trainer's synthetic batches (trainer/data.cc, SampleSyntheticBatch),
reproduced bit for bit so that TorchTitan trains on the same tokens as ours.

Token (row i, column j) of the global batch of step s is
Hash(seed, s, i, j) % vocab, where Hash chains SplitMix64's finaliser over
(seed, step, row, column) with wrap-around uint64 arithmetic. Rows are
seq + 1 tokens: the input is the first seq, the labels the last seq. Rank r
of W takes rows [r*B/W, (r+1)*B/W), as the trainer does.
"""

import numpy as np

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _mix(x):
    """SplitMix64's finaliser on a uint64 array (numpy wraps mod 2^64)."""
    x = x + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_M1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_M2)
    return x ^ (x >> np.uint64(31))


def _u64(value):
    """An int (negative ones as two's complement, as C++'s cast) as uint64."""
    return np.array([value & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)


def synthetic_rows(seed, step, vocab, global_batch, row_length, rank=0, world_size=1):
    """This rank's rows of the global batch of `step`: int64 [B/W, row_length]."""
    if global_batch % world_size != 0:
        raise ValueError(f"global_batch={global_batch}: expected a multiple of the "
                         f"world size {world_size}")
    if vocab < 1 or row_length < 1:
        raise ValueError(f"vocab={vocab}, row_length={row_length}: expected both >= 1")
    per_rank = global_batch // world_size
    rows = np.arange(rank * per_rank, (rank + 1) * per_rank, dtype=np.uint64)[:, None]
    columns = np.arange(row_length, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        h = _mix(_u64(seed))
        h = _mix(h ^ _u64(step))
        h = _mix(h ^ rows)
        h = _mix(h ^ columns)
    return (h % np.uint64(vocab)).astype(np.int64)


# SampleSyntheticBatch's rows for a few (seed, step, vocab, global batch, row
# length); trainer/model_data_test.cc holds the C++ to the same values, so a
# port that drifts fails here, before any GPU time is spent.
_REFERENCE = {
    (0, 1, 32000, 2, 5): [[8503, 25159, 22545, 4616, 9050], [15241, 5872, 15186, 13348, 5303]],
    (7, 3, 128256, 3, 4): [[39161, 29351, 58593, 32362], [44658, 37890, 36703, 117420],
                           [65456, 6413, 53811, 124315]],
    (0, -2, 256, 2, 3): [[76, 19, 103], [6, 215, 34]],
}


def self_check():
    """Raises AssertionError when the port disagrees with the C++ values."""
    for (seed, step, vocab, batch, length), expected in _REFERENCE.items():
        got = synthetic_rows(seed, step, vocab, batch, length).tolist()
        assert got == expected, (f"synthetic_rows(seed={seed}, step={step}, vocab={vocab}): "
                                 f"{got} != trainer/data.cc's {expected}")
