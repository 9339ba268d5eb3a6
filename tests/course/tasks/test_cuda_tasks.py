"""Hidden edge cases of the CUDA tasks, run in the CPU emulator (kernels_cuda/emulator), with
oracles written here (no other task's code): the copy_blocks kernel on odd block sizes, many
caches and one block copied to several places (a parallel-sampling fork)."""
import importlib.util
import pathlib

import torch
from tolerances import assert_equal

_spec = importlib.util.spec_from_file_location(
    "_copy_blocks_emulated", pathlib.Path(__file__).parents[2] / "kernels_cuda" / "test_copy_blocks_emulated.py")
_public = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_public)
run_emulated = _public.run_emulated
emu = _public.emu            # the public tests' fixture: the emulated kernel, or a skip saying why


def test_copy_blocks_fans_one_block_out_across_many_caches_of_an_odd_size(emu):
    """Every pair of the mapping, in every cache: one source block to three destinations, in
    five caches whose block is 105 bytes (no word wider than a byte divides it)."""
    g = torch.Generator().manual_seed(11)
    caches = [torch.randint(0, 255, (5, 3, 5, 7), dtype=torch.uint8, generator=g) for _ in range(5)]
    before = [c.clone() for c in caches]
    mapping = torch.tensor([[1, 0], [1, 2], [1, 4]])
    run_emulated(emu, caches, mapping, 1)
    for got, old in zip(caches, before):
        for dst in (0, 2, 4):
            assert_equal(got[dst], old[1], f"block {dst}")
        assert_equal(got[1], old[1], "block 1 (not a destination)")      # nothing else written
        assert_equal(got[3], old[3], "block 3 (not a destination)")
