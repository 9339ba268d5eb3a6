"""Small integers packed into int32 words: how int4 (and int8) weights are stored on disk.

A tensor has no 4-bit dtype, so checkpoints pack 32 / b values into each int32 word. Three
layouts matter, all little-end first (value j of a word in bits [b j, b (j + 1))), and all storing
UNSIGNED values (q - qmin: int4's -8..7 as 0..15):

    compressed-tensors  weight_packed [out, in * b / 32]   along the INPUT dim, rows = output
      (pack-quantized)  weight_zero_point packed along the OUTPUT dim: [out * b / 32, groups]
                        (compressed_tensors/compressors/quantized_compressors/pack_quantized.py:
                        pack_to_int32 / unpack_from_int32)
    GPTQ                qweight [in * b / 32, out]  along the input dim, stored transposed;
                        qzeros [groups, out * b / 32] along the output dim (vLLM: gptq.py)
    AWQ                 qweight [in, out * b / 32]  along the OUTPUT dim, the eight nibbles of a
                        word in the order 0 2 4 6 1 3 5 7 (what AWQ's GEMM kernel unpacks fastest);
                        qzeros [groups, out * b / 32] the same way (vLLM: awq.py, AWQ_REVERSE_ORDER)

Every layout holds the same integers; `unpack_*` gives back q int8 [out, in] as reference.py
defines it, so a loader turns any of them into one representation and one set of kernels.
"""
from __future__ import annotations

import torch

__all__ = ["AWQ_ORDER", "pack_awq", "pack_gptq", "pack_int32", "unpack_awq", "unpack_gptq", "unpack_int32"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # nibble j of an AWQ word holds column AWQ_ORDER[j] of its eight


def _per_word(num_bits: int) -> int:
    if num_bits not in (4, 8):
        raise ValueError(f"packing supports 4 and 8 bits, got {num_bits}")
    return 32 // num_bits


def pack_int32(q: torch.Tensor, num_bits: int, dim: int = 1) -> torch.Tensor:
    """q int8 [rows, cols] (signed values of a b-bit grid) -> int32 words along `dim`, little-end
    first, values stored as q + 2^(b-1) (compressed-tensors' pack_to_int32). The packed dim's length
    must be a multiple of 32 / b."""
    n = _per_word(num_bits)
    u = q.to(torch.int32) + (1 << (num_bits - 1))                 # unsigned: 0 .. 2^b - 1
    if dim == 0:
        return pack_int32(q.t(), num_bits, dim=1).t().contiguous()
    rows, cols = u.shape
    if cols % n:
        raise ValueError(f"cannot pack {cols} values into int32 words of {n} (not a multiple)")
    ### BEGIN SOLUTION
    u = u.reshape(rows, cols // n, n)
    shifts = torch.arange(n, dtype=torch.int32, device=q.device) * num_bits   # value j -> bits [b j, b j + b)
    words = (u << shifts).sum(dim=-1, dtype=torch.int64)                     # disjoint bits: a sum is an OR
    ### END SOLUTION
    return (words - ((words >> 31) << 32)).to(torch.int32)       # the top bit set: a negative int32


def unpack_int32(packed: torch.Tensor, num_bits: int, dim: int = 1) -> torch.Tensor:
    """The inverse of pack_int32: int32 words -> q int8, 32 / b values per word along `dim`."""
    n = _per_word(num_bits)
    if dim == 0:
        return unpack_int32(packed.t(), num_bits, dim=1).t().contiguous()
    ### BEGIN SOLUTION
    shifts = torch.arange(n, dtype=torch.int32, device=packed.device) * num_bits
    u = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)   # [rows, words, n]
    ### END SOLUTION
    return (u.reshape(packed.shape[0], -1) - (1 << (num_bits - 1))).to(torch.int8)


def pack_gptq(q: torch.Tensor, num_bits: int = 4) -> torch.Tensor:
    """q int8 [out, in] -> GPTQ's qweight int32 [in * b / 32, out]: packed along the input dim, then
    transposed so that one word holds 32 / b consecutive inputs of one output column."""
    return pack_int32(q, num_bits, dim=1).t().contiguous()


def unpack_gptq(qweight: torch.Tensor, num_bits: int = 4) -> torch.Tensor:
    return unpack_int32(qweight.t(), num_bits, dim=1)


def pack_awq(q: torch.Tensor, num_bits: int = 4) -> torch.Tensor:
    """q int8 [out, in] -> AWQ's qweight int32 [in, out * b / 32]: packed along the output dim with
    each word's values in AWQ_ORDER."""
    if num_bits != 4:
        raise ValueError(f"AWQ checkpoints are 4-bit, got {num_bits}")
    qt = q.t()                                                   # [in, out]
    rows, cols = qt.shape
    if cols % 8:
        raise ValueError(f"AWQ packs 8 outputs per word: out_features {cols} is not a multiple of 8")
    order = torch.tensor(AWQ_ORDER, device=q.device)
    interleaved = qt.reshape(rows, cols // 8, 8)[..., order].reshape(rows, cols)
    return pack_int32(interleaved, 4, dim=1)


def unpack_awq(qweight: torch.Tensor, num_bits: int = 4) -> torch.Tensor:
    if num_bits != 4:
        raise ValueError(f"AWQ checkpoints are 4-bit, got {num_bits}")
    interleaved = unpack_int32(qweight, 4, dim=1)                # [in, out], words in AWQ_ORDER
    rows, cols = interleaved.shape
    inverse = torch.argsort(torch.tensor(AWQ_ORDER, device=qweight.device))
    return interleaved.reshape(rows, cols // 8, 8)[..., inverse].reshape(rows, cols).t().contiguous()
