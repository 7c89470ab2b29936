"""Greedy decoding's argmax in C (kernels/cpu/first_max.py) against torch's argmax: the same
index on every row, ties (the first maximum), +-inf and NaN (the first NaN, as torch), rows
of -inf only, widths that are not whole vectors; the same on one thread as on two; in the
CPU's own code and the AVX2 code; declined where it does not apply (torch runs there)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu.first_max import first_max_index

from .threads import same_on_one_thread

built = pytest.mark.skipif(first_max_index(torch.zeros(1, 16)) is None,
                           reason="the C argmax needs a C compiler and AVX2 or AVX-512")


@built
@pytest.mark.parametrize("rows, width", [(64, 49152), (3, 100), (5, 17), (7, 1), (2, 15), (1, 16)])
def test_first_maximum_as_argmax(rows, width, instruction_set):
    generator = torch.Generator().manual_seed(rows * width)
    ties = torch.randint(0, 4, (rows, width), generator=generator).float()  # many tied maxima
    spread = torch.randn(rows, width, generator=generator)
    spread[:, ::3] = float("-inf")
    for logits in (ties, spread):
        assert torch.equal(first_max_index(logits), logits.argmax(dim=-1))


@built
def test_infinities_and_nan_as_argmax(instruction_set):
    odd = torch.zeros(5, 100)
    odd[0, 5], odd[0, 9] = float("nan"), 1.0  # NaN counts as the largest
    odd[1, 7], odd[1, 9] = float("inf"), float("inf")
    odd[2, 99] = float("nan")  # in the last vector
    odd[3, 50], odd[3, 60], odd[3, 70] = float("inf"), float("nan"), float("nan")
    odd[4].fill_(float("-inf"))  # nothing above -inf: the first index
    assert first_max_index(odd).tolist() == odd.argmax(dim=-1).tolist() == [5, 7, 99, 60, 0]


@built
def test_same_on_one_thread():
    logits = torch.randn(48, 4000, generator=torch.Generator().manual_seed(1))
    assert same_on_one_thread(lambda: first_max_index(logits))


def test_declines_what_it_does_not_take():
    assert first_max_index(torch.zeros(4, 16, dtype=torch.bfloat16)) is None
    assert first_max_index(torch.zeros(16)) is None
    assert first_max_index(torch.zeros(16, 4).t()) is None  # not contiguous
    assert first_max_index(torch.zeros(4, 0)) is None
