"""Pages between workers: both sides of the KVTransfer service.

- ``source``: ``PageSource``, what a worker serves from; ``TierPageSource`` over tiers;
  ``valid_pushes``, the check every pushed page passes;
- ``framing``: page objects as ``PageChunk``s of at most 1 MiB, and back (``PageAssembler``);
- ``servicer``: ``KVTransferServicer``, the gRPC server side over a ``PageSource``;
- ``tier``: ``PeerTier``, the client side: the tier that reads other workers' pages, over
  their data plane (``kvstore.dataplane``) or ``Fetch``.
"""

from kvmesh.kvstore.peer.framing import (
    MAX_CHUNK_BYTES,
    MAX_PAGE_BYTES,
    PageAssembler,
    check_hashes,
    crc32,
    page_chunks,
)
from kvmesh.kvstore.peer.source import PageSource, TierPageSource, valid_pushes
from kvmesh.kvstore.peer.tier import DATA_PLANE_RECHECK_S, PeerTier

__all__ = [
    "DATA_PLANE_RECHECK_S",
    "MAX_CHUNK_BYTES",
    "MAX_PAGE_BYTES",
    "PageAssembler",
    "PageSource",
    "PeerTier",
    "TierPageSource",
    "check_hashes",
    "crc32",
    "page_chunks",
    "valid_pushes",
]
