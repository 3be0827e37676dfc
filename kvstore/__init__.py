"""Page identity (hashing), block events, and (later) the page codec and storage tiers."""

from kvmesh.kvstore.events import BlockEvent, BlockRemoved, BlockStored, EventLog
from kvmesh.kvstore.hashing import PAGE_HASH_BYTES, hash_pages, page_hash, root_hash

__all__ = [
    "PAGE_HASH_BYTES",
    "BlockEvent",
    "BlockRemoved",
    "BlockStored",
    "EventLog",
    "hash_pages",
    "page_hash",
    "root_hash",
]
