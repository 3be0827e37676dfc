"""Page identity (hashing), block events, the page codec, storage tiers and the TieredStore."""

from kvmesh.kvstore.codec import PageCodecError, PageSpec, decode, encode
from kvmesh.kvstore.events import BlockEvent, BlockRemoved, BlockStored, EventLog
from kvmesh.kvstore.hashing import PAGE_HASH_BYTES, hash_pages, page_hash, root_hash
from kvmesh.kvstore.host import HostTier
from kvmesh.kvstore.store import TieredStore
from kvmesh.kvstore.tier import Tier

__all__ = [
    "PAGE_HASH_BYTES",
    "BlockEvent",
    "BlockRemoved",
    "BlockStored",
    "EventLog",
    "HostTier",
    "PageCodecError",
    "PageSpec",
    "Tier",
    "TieredStore",
    "decode",
    "encode",
    "hash_pages",
    "page_hash",
    "root_hash",
]
