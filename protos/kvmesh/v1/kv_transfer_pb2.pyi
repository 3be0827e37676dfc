from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PagePiece(_message.Message):
    __slots__ = ("hash", "index", "found", "total_size", "offset", "data", "crc32")
    HASH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    index: int
    found: bool
    total_size: int
    offset: int
    data: bytes
    crc32: int
    def __init__(self, hash: _Optional[bytes] = ..., index: _Optional[int] = ..., found: _Optional[bool] = ..., total_size: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class PageChunk(_message.Message):
    __slots__ = ("pieces",)
    PIECES_FIELD_NUMBER: _ClassVar[int]
    pieces: _containers.RepeatedCompositeFieldContainer[PagePiece]
    def __init__(self, pieces: _Optional[_Iterable[_Union[PagePiece, _Mapping]]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("accepted", "rejected")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    rejected: int
    def __init__(self, accepted: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class DataPlaneRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class DataPlaneInfo(_message.Message):
    __slots__ = ("port", "token", "version", "max_pages")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_PAGES_FIELD_NUMBER: _ClassVar[int]
    port: int
    token: bytes
    version: int
    max_pages: int
    def __init__(self, port: _Optional[int] = ..., token: _Optional[bytes] = ..., version: _Optional[int] = ..., max_pages: _Optional[int] = ...) -> None: ...
