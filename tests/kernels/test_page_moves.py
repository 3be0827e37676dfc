"""read_pages / write_pages: whole pages in and out of the pool, byte for byte, whether or
not the page size allows the wide (int64) view."""

import pytest
import torch

from kvmesh.kernels.page_format import read_pages, write_pages


@pytest.mark.parametrize("page_nbytes", [737_280, 24, 13])  # 13: no wide view possible
def test_pages_round_trip_byte_exact(page_nbytes):
    g = torch.Generator().manual_seed(page_nbytes)
    pool = torch.randint(0, 256, (9, page_nbytes), dtype=torch.uint8, generator=g)
    before = pool.clone()
    ids = torch.tensor([7, 2, 5], dtype=torch.int64)
    rows = read_pages(pool, ids)
    assert rows.dtype == torch.uint8 and rows.shape == (3, page_nbytes)
    assert torch.equal(rows, before[ids])
    new = torch.randint(0, 256, (3, page_nbytes), dtype=torch.uint8, generator=g)
    write_pages(pool, torch.tensor([1, 8, 4]), new)
    assert torch.equal(pool[[1, 8, 4]], new)
    untouched = [0, 2, 3, 5, 6, 7]
    assert torch.equal(pool[untouched], before[untouched])
    rows[0] = 0  # a copy, not a view into the pool
    assert torch.equal(pool[7], before[7])


def test_rows_that_cannot_be_widened_still_land():
    pool = torch.zeros(4, 16, dtype=torch.uint8)
    rows = torch.arange(64, dtype=torch.uint8).view(2, 32)[:, 1:17]  # strided rows
    write_pages(pool, torch.tensor([3, 0]), rows)
    assert torch.equal(pool[3], rows[0]) and torch.equal(pool[0], rows[1])
