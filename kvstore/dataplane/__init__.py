"""The page data plane: encoded page objects over a plain TCP connection.

gRPC stays the control plane (``KVTransfer.DataPlane`` tells a client the port and a token);
page bytes move over TCP without protobuf framing, HTTP/2 flow control or an event loop in
between, the way NVIDIA Dynamo's NIXL or Mooncake's transfer engine split the two (figures:
docs/grpc.md, "Data plane").

- ``protocol``: the wire format, its constants and ``DataPlaneError``;
- ``server``: ``DataPlaneServer``, serving a ``PageSource``;
- ``client``: ``DataPlaneClient``, a pool of connections to one peer;
- ``memory``: the reused receive mappings the client receives objects into;
- ``sockets``: deadlines, scatter sends and receives on blocking sockets.

Requests and pages are authenticated with a key derived from the cluster secret (keyed
BLAKE3, ``protocol``): only a cluster member gets pages, and a client accepts only pages a
member sent for its request. The bytes are not encrypted; that is why a worker whose gRPC
port uses TLS runs no data plane unless told to (docs/security.md).
"""

from kvmesh.kvstore.dataplane.client import DataPlaneClient, DataPlaneFetch, detached
from kvmesh.kvstore.dataplane.memory import ARENA_BYTES, ARENA_KEEP_BYTES
from kvmesh.kvstore.dataplane.protocol import (
    FOUND,
    KEY_BYTES,
    MAC_BYTES,
    MAGIC,
    MAX_OBJECT_BYTES,
    MAX_REQUEST_PAGES,
    MISS,
    NONCE_BYTES,
    PAGE_HEAD,
    REQUEST_HEAD,
    TOKEN_BYTES,
    VERSION,
    DataPlaneError,
)
from kvmesh.kvstore.dataplane.server import DataPlaneServer

__all__ = [
    "ARENA_BYTES",
    "ARENA_KEEP_BYTES",
    "FOUND",
    "KEY_BYTES",
    "MAC_BYTES",
    "MAGIC",
    "MAX_OBJECT_BYTES",
    "MAX_REQUEST_PAGES",
    "MISS",
    "NONCE_BYTES",
    "PAGE_HEAD",
    "REQUEST_HEAD",
    "TOKEN_BYTES",
    "VERSION",
    "DataPlaneClient",
    "DataPlaneError",
    "DataPlaneFetch",
    "DataPlaneServer",
    "detached",
]
