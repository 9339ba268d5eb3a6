"""Chapter 04 tests run torch single-threaded.

Their tensors are tiny (a toy transformer, 6-token vocabularies, 12 000-row samplers): torch's
intra-op threads cost far more than they save there, 5-10x on a busy 2-core machine. The
setting is restored after each test, so other chapters' tests are unaffected.
"""
import pytest
import torch


@pytest.fixture(autouse=True)
def single_threaded_torch():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
