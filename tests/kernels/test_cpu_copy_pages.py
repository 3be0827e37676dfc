"""The C copy of restored page payloads into the pool (``kvmesh_copy_pages``, streaming
stores where the build has them) against its twin, numpy's ``pool[i] = payload``: the same
bytes, on every build this host runs, for payloads at any alignment (views of stored objects
past their header), page sizes that are not a multiple of the 256-byte step or of a vector,
pages shorter than one step, 1 and 2 threads. And the pool path the engine takes
(``KVMemory.write``) uses it."""

import numpy as np
import pytest
import torch
from builds import host_builds

from kvmesh.kernels.cpu_ops import copy_pages_cpu
from kvmesh.kernels.page_format import write_page_buffers

BUILDS = list(host_builds())


def _payloads(n: int, nbytes: int, seed: int) -> list[memoryview]:
    """n payloads, each a view at an odd offset into its own bytes object (as a stored
    object's payload follows its header)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        head = 1 + 7 * i % 61
        obj = rng.integers(0, 256, head + nbytes + 5, dtype=np.uint8).tobytes()
        out.append(memoryview(obj)[head : head + nbytes])
    return out


def _twin(pool: torch.Tensor, ids, payloads) -> torch.Tensor:
    want = pool.clone()
    arr = want.numpy()
    for i, p in zip(ids, payloads):
        arr[i] = np.frombuffer(p, dtype=np.uint8)
    return want


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("nbytes", [737_280, 4096 + 64 + 3, 255, 1])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_numpy(libraries, build, nbytes, threads):
    n_pages = 9
    pool = torch.randint(0, 256, (n_pages + 1, nbytes), dtype=torch.uint8)
    # pool rows of an odd length start off any alignment, as the payloads do
    ids = [7, 2, 9, 0, 5]
    payloads = _payloads(len(ids), nbytes, seed=nbytes)
    want = _twin(pool, ids, payloads)
    copy_pages_cpu(pool, ids, payloads, library=libraries[build], num_threads=threads)
    assert torch.equal(pool, want)


def test_misaligned_pool_rows(libraries):
    """A pool whose rows start 1 byte past a 64-byte line: the head before the first line
    and the tail after the last whole step are copied too."""
    nbytes = 2 * 4096
    base = torch.zeros(3 * nbytes + 64, dtype=torch.uint8)
    off = (64 - base.data_ptr() % 64) % 64 + 1
    pool = base[off : off + 3 * nbytes].view(3, nbytes)
    payloads = _payloads(2, nbytes, seed=5)
    want = _twin(pool, [2, 0], payloads)
    copy_pages_cpu(pool, [2, 0], payloads, library=libraries["native"])
    assert torch.equal(pool, want)


def test_bad_arguments_are_named(libraries):
    pool = torch.zeros(4, 64, dtype=torch.uint8)
    lib = libraries["native"]
    with pytest.raises(ValueError, match=r"page ids must lie in \[0, 4\)"):
        copy_pages_cpu(pool, [4], _payloads(1, 64, 0), library=lib)
    with pytest.raises(ValueError, match=r"page ids must lie in \[0, 4\)"):
        copy_pages_cpu(pool, [-1], _payloads(1, 64, 0), library=lib)
    with pytest.raises(ValueError, match="a payload is 63 bytes, pages are 64"):
        copy_pages_cpu(pool, [1], _payloads(1, 63, 0), library=lib)
    with pytest.raises(ValueError, match="2 page ids for 1 payloads"):
        copy_pages_cpu(pool, [1, 2], _payloads(1, 64, 0), library=lib)
    with pytest.raises(ValueError, match="2-d uint8 CPU tensor"):
        copy_pages_cpu(pool.view(torch.int32), [1], _payloads(1, 16, 0), library=lib)
    assert not pool.any()  # nothing written by a refused call
    copy_pages_cpu(pool, [], [], library=lib)  # nothing to do


@pytest.fixture
def c_copies(monkeypatch) -> list[int]:
    """The page counts of the C copies made while a test runs (``copy_page_views`` calls)."""
    import kvmesh.kernels.cpu_ops as cpu_ops

    calls: list[int] = []
    real = cpu_ops.copy_page_views

    def spy(*a, **k):
        calls.append(len(a[2]))
        return real(*a, **k)

    monkeypatch.setattr(cpu_ops, "copy_page_views", spy)
    return calls


def test_write_page_buffers_copies_in_c_with_a_library(libraries, c_copies):
    """``write_page_buffers`` with a library copies through it, without one through numpy,
    with the same bytes."""
    calls = c_copies
    pool = torch.randint(0, 256, (6, 1000), dtype=torch.uint8)
    plain = pool.clone()
    ids, payloads = [3, 1, 4], _payloads(3, 1000, seed=1)
    write_page_buffers(pool, ids, payloads, library=libraries["native"])
    assert calls == [3]
    write_page_buffers(plain, ids, payloads)
    assert calls == [3]
    assert torch.equal(pool, plain)


@pytest.mark.parametrize("library", [True, False])
def test_write_page_buffers_refuses_bad_ids_on_either_path(libraries, library):
    """A page id outside the pool is refused before anything is written, with the C copy
    and with numpy's (which would take -1 as the last page)."""
    pool = torch.zeros(4, 64, dtype=torch.uint8)
    lib = libraries["native"] if library else None
    for bad in ([-1], [1, 4]):
        with pytest.raises(ValueError, match=r"page ids must lie in \[0, 4\)"):
            write_page_buffers(pool, bad, _payloads(len(bad), 64, 0), library=lib)
    assert not pool.any()


def test_a_split_copy_needs_distinct_ids_and_a_dense_pool(libraries):
    lib = libraries["native"]
    pool = torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="distinct"):
        copy_pages_cpu(pool, [1, 1], _payloads(2, 64, 0), library=lib, num_threads=2)
    wide = torch.zeros(4, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="contiguous"):
        copy_pages_cpu(wide[:, ::2], [1], _payloads(1, 64, 0), library=lib)
    assert not pool.any() and not wide.any()


def test_kv_memory_write_copies_in_c(c_copies):
    """The pool's write (a restore's copy into the pool) goes through the C copy when the
    kernels are built, and gives the same bytes."""
    from kvmesh.kernels.page_format import PageLayout
    from kvmesh.worker.kv_memory import KVMemory

    layout = PageLayout("fp32", num_layers=2, num_kv_heads=1, head_size=8, block_size=4)
    mem = KVMemory(layout, "fp", 5, dtype=torch.float32, device=torch.device("cpu"))
    nbytes = mem.buffer.shape[1]
    payloads = _payloads(2, nbytes, seed=3)
    mem.write([4, 2], payloads)
    assert c_copies == [2]
    for i, p in zip([4, 2], payloads):
        assert mem.buffer[i].numpy().tobytes() == bytes(p)


def test_write_page_buffers_into_a_strided_pool_takes_numpy(libraries, c_copies):
    """A pool view that is not contiguous (a column slice of a wider buffer) is written row
    by row by numpy even with a library: the C copy assumes dense rows."""
    wide = torch.zeros(4, 128, dtype=torch.uint8)
    pool = wide[:, :64]
    payloads = _payloads(2, 64, seed=4)
    write_page_buffers(pool, [3, 0], payloads, library=libraries["native"])
    assert c_copies == []
    assert bytes(pool[3].numpy()) == bytes(payloads[0]) and bytes(pool[0].numpy()) == bytes(
        payloads[1]
    )
    assert not wide[:, 64:].any()
