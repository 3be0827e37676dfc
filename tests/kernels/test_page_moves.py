"""read_pages / write_pages: whole pages in and out of the pool, byte for byte, whether or
not the page size allows the wide (int64) view."""

import pytest
import torch

from kvmesh.kernels.page_format import read_pages, write_page_buffers, write_pages


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


def test_read_pages_into_a_reused_buffer():
    g = torch.Generator().manual_seed(1)
    pool = torch.randint(0, 256, (6, 48), dtype=torch.uint8, generator=g)
    out = torch.full((4, 48), 7, dtype=torch.uint8)
    got = read_pages(pool, torch.tensor([5, 0]), out=out[:2])
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out[:2], pool[[5, 0]]) and bool((out[2:] == 7).all())
    with pytest.raises(ValueError, match="out must be uint8 of shape"):
        read_pages(pool, torch.tensor([1]), out=out[:2])


def test_write_page_buffers_copies_each_payload_once_into_its_page():
    pool = torch.zeros(5, 24, dtype=torch.uint8)
    a, b = bytes(range(24)), bytearray(range(100, 124))
    obj = b"header" + bytes(range(50, 74))
    write_page_buffers(pool, [4, 1, 2], [a, memoryview(b), memoryview(obj)[6:]])
    assert pool[4].tolist() == list(a) and pool[1].tolist() == list(b)
    assert pool[2].tolist() == list(range(50, 74))
    assert not bool(pool[[0, 3]].any())
    b[0] = 0  # the pool holds a copy
    assert pool[1, 0].item() == 100
    with pytest.raises(ValueError, match="is 23 bytes, pages are 24"):
        write_page_buffers(pool, [0], [bytes(23)])
    with pytest.raises(ValueError, match="2 page ids for 1 payloads"):
        write_page_buffers(pool, [0, 1], [a])
