"""The Triton kernel behind :mod:`privkit.mechanisms.chacha_triton` (importing this module needs Triton).

One program computes ``BLOCK`` ChaCha20 blocks (RFC 8439's block function, nonce 0, 64-bit counter
in state words 12-13) in 32-bit registers and writes each block's eight 53-bit integers
``(w[2j] << 21) | (w[2j + 1] >> 11)``, the form :meth:`ChaChaStream.bits53
<privkit.mechanisms.device_random.ChaChaStream.bits53>` takes from the torch path's words.
"""

import triton
import triton.language as tl


@triton.jit
def rotl(x, n: tl.constexpr):
    return (x << n) | (x >> (32 - n))


@triton.jit
def quarter(a, b, c, d):
    a = a + b
    d = rotl(d ^ a, 16)
    c = c + d
    b = rotl(b ^ c, 12)
    a = a + b
    d = rotl(d ^ a, 8)
    c = c + d
    b = rotl(b ^ c, 7)
    return a, b, c, d


@triton.jit
def word53(hi, lo):
    return (hi.to(tl.int64) << 21) | (lo >> 11).to(tl.int64)


@triton.jit
def chacha20_bits53(out_ptr, key_ptr, start_ptr, n_out, BLOCK: tl.constexpr):
    blocks = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    counter = tl.load(start_ptr) + blocks
    zero = tl.zeros([BLOCK], dtype=tl.uint32)
    # state words 0-3: "expand 32-byte k"; 4-11: the key; 12-13: the 64-bit counter; 14-15: 0
    i0 = zero + 0x61707865
    i1 = zero + 0x3320646E
    i2 = zero + 0x79622D32
    i3 = zero + 0x6B206574
    i4 = zero + tl.load(key_ptr + 0).to(tl.uint32)
    i5 = zero + tl.load(key_ptr + 1).to(tl.uint32)
    i6 = zero + tl.load(key_ptr + 2).to(tl.uint32)
    i7 = zero + tl.load(key_ptr + 3).to(tl.uint32)
    i8 = zero + tl.load(key_ptr + 4).to(tl.uint32)
    i9 = zero + tl.load(key_ptr + 5).to(tl.uint32)
    i10 = zero + tl.load(key_ptr + 6).to(tl.uint32)
    i11 = zero + tl.load(key_ptr + 7).to(tl.uint32)
    i12 = (counter & 0xFFFFFFFF).to(tl.uint32)
    i13 = (counter >> 32).to(tl.uint32)
    x0, x1, x2, x3, x4, x5, x6, x7 = i0, i1, i2, i3, i4, i5, i6, i7
    x8, x9, x10, x11, x12, x13, x14, x15 = i8, i9, i10, i11, i12, i13, zero, zero
    for _ in range(10):
        x0, x4, x8, x12 = quarter(x0, x4, x8, x12)
        x1, x5, x9, x13 = quarter(x1, x5, x9, x13)
        x2, x6, x10, x14 = quarter(x2, x6, x10, x14)
        x3, x7, x11, x15 = quarter(x3, x7, x11, x15)
        x0, x5, x10, x15 = quarter(x0, x5, x10, x15)
        x1, x6, x11, x12 = quarter(x1, x6, x11, x12)
        x2, x7, x8, x13 = quarter(x2, x7, x8, x13)
        x3, x4, x9, x14 = quarter(x3, x4, x9, x14)
    base = blocks * 8
    tl.store(out_ptr + base + 0, word53(x0 + i0, x1 + i1), mask=base + 0 < n_out)
    tl.store(out_ptr + base + 1, word53(x2 + i2, x3 + i3), mask=base + 1 < n_out)
    tl.store(out_ptr + base + 2, word53(x4 + i4, x5 + i5), mask=base + 2 < n_out)
    tl.store(out_ptr + base + 3, word53(x6 + i6, x7 + i7), mask=base + 3 < n_out)
    tl.store(out_ptr + base + 4, word53(x8 + i8, x9 + i9), mask=base + 4 < n_out)
    tl.store(out_ptr + base + 5, word53(x10 + i10, x11 + i11), mask=base + 5 < n_out)
    tl.store(out_ptr + base + 6, word53(x12 + i12, x13 + i13), mask=base + 6 < n_out)
    tl.store(out_ptr + base + 7, word53(x14, x15), mask=base + 7 < n_out)
