"""Who may call what: the cluster identity, clients' bearer tokens, TLS credentials, and the
gRPC server interceptor that enforces them (threat model and flags: docs/security.md).

- ``ClusterIdentity``: a shared cluster secret. Cluster members (the router, the workers)
  prove it on every internal call with a credential derived from it (gRPC metadata
  ``kvmesh-cluster``); a member that wants the *server* to prove it too sends a nonce
  (``kvmesh-cluster-nonce``) and gets back an HMAC of it (``kvmesh-cluster-proof``, initial
  metadata). The data plane authenticates requests and pages with a second key derived
  from the same secret. The secret itself never goes on the wire.
- ``BearerTokens`` / ``check_bearer``: clients' tokens (``authorization: Bearer <token>``),
  from a token file; reusable by any front door (gRPC here, HTTP later).
- ``TLSConfig``: PEM server certificate and key, the CA that client certificates must chain
  to (mutual TLS), and the CA this process trusts when it connects to other members.
- ``AuthInterceptor``: the grpc.aio server interceptor: cluster-only methods need the
  cluster identity, client methods need a token when a token file is configured, health
  and reflection stay open (load balancers' and Kubernetes' probes send no token).

Imports only grpc and the standard library, so the worker, the router and the SDK can all
use it. Every compare of a secret is constant-time (``hmac.compare_digest``); no secret,
token or derived key appears in a ``repr`` or a log line.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import os
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import grpc

CLUSTER_METADATA_KEY = "kvmesh-cluster"  # the member's credential (hex)
NONCE_METADATA_KEY = "kvmesh-cluster-nonce"  # a member asking the server to prove itself
PROOF_METADATA_KEY = "kvmesh-cluster-proof"  # the server's answer, in initial metadata
AUTHORIZATION_KEY = "authorization"  # clients: "Bearer <token>"
MIN_SECRET_BYTES = 16
MIN_TOKEN_CHARS = 16

Metadata = Iterable[tuple[str, str | bytes]]


def _derive(secret: bytes, purpose: str) -> bytes:
    """A key for one purpose: HMAC-SHA256(secret, purpose). Keys of different purposes are
    independent, so one that leaks (e.g. the gRPC credential on a plaintext port) does not
    give away the others or the secret."""
    return hmac.digest(secret, b"kvmesh/v1/" + purpose.encode(), "sha256")


class ClusterIdentity:
    """The shared secret of one cluster, and the keys derived from it.

    ``kvmesh serve`` generates one per cluster and hands it to its actors; a standalone
    worker reads it from ``--cluster-secret-file`` or ``KVMESH_CLUSTER_SECRET``. Picklable
    (a Ray actor receives it), but never printed.
    """

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
            n = len(secret) if isinstance(secret, bytes) else type(secret).__name__
            raise ValueError(f"a cluster secret must be at least {MIN_SECRET_BYTES} bytes, got {n}")
        self._secret = secret
        self.credential = _derive(secret, "grpc-credential").hex()
        self._proof_key = _derive(secret, "grpc-server-proof")
        self.data_plane_key = _derive(secret, "data-plane")
        # names the cluster in logs without revealing anything usable
        self.fingerprint = hashlib.sha256(_derive(secret, "fingerprint")).hexdigest()[:12]

    @classmethod
    def generate(cls) -> ClusterIdentity:
        return cls(secrets.token_bytes(32))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ClusterIdentity:
        """The secret is the file's bytes with surrounding whitespace stripped (a line of
        ``openssl rand -hex 32`` works)."""
        with open(path, "rb") as f:
            data = f.read().strip()
        if len(data) < MIN_SECRET_BYTES:
            raise ValueError(
                f"cluster secret file {os.fspath(path)!r} holds {len(data)} bytes; at least "
                f"{MIN_SECRET_BYTES} are needed (e.g. `openssl rand -hex 32 > {os.fspath(path)}`)"
            )
        return cls(data)

    @classmethod
    def from_text(cls, text: str) -> ClusterIdentity:
        """From an environment variable's value (stripped, UTF-8)."""
        data = text.strip().encode()
        if len(data) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the cluster secret holds {len(data)} bytes; at least {MIN_SECRET_BYTES} are "
                "needed"
            )
        return cls(data)

    def __repr__(self) -> str:
        return f"ClusterIdentity(fingerprint={self.fingerprint})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterIdentity) and hmac.compare_digest(
            self._secret, other._secret
        )

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    # ------------------------------------------------------------ the client side

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata that proves membership (no server proof asked)."""
        return ((CLUSTER_METADATA_KEY, self.credential),)

    def challenge(self) -> tuple[tuple[tuple[str, str], ...], str]:
        """Metadata that proves membership and asks the server to prove it too, and the
        nonce to check its answer with (``verify_server``)."""
        nonce = secrets.token_hex(16)
        return ((CLUSTER_METADATA_KEY, self.credential), (NONCE_METADATA_KEY, nonce)), nonce

    def verify_server(self, nonce: str, initial_metadata: Metadata | None) -> bool:
        """Whether the server's initial metadata proves it holds this cluster's secret."""
        got = _get(initial_metadata, PROOF_METADATA_KEY)
        return got is not None and hmac.compare_digest(got.encode(), self.proof(nonce).encode())

    # ------------------------------------------------------------ the server side

    def authenticates(self, metadata: Metadata | None) -> bool:
        """Whether a call's metadata carries this cluster's credential."""
        got = _get(metadata, CLUSTER_METADATA_KEY)
        return got is not None and hmac.compare_digest(got.encode(), self.credential.encode())

    def proof(self, nonce: str) -> str:
        return hmac.digest(self._proof_key, nonce.encode(), "sha256").hex()


def _get(metadata: Metadata | None, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v.decode(errors="replace") if isinstance(v, bytes) else v
    return None


# ---------------------------------------------------------------- clients' tokens


class BearerTokens:
    """The accepted client tokens. ``check`` compares against every one of them in constant
    time (sha256 digests, so tokens of different lengths compare alike), whether or not an
    earlier one matched."""

    def __init__(self, tokens: Iterable[str]) -> None:
        toks = [t.strip() for t in tokens]
        if not toks:
            raise ValueError("a token list needs at least one token")
        short = [i for i, t in enumerate(toks) if len(t) < MIN_TOKEN_CHARS]
        if short:
            raise ValueError(
                f"tokens must be at least {MIN_TOKEN_CHARS} characters; token(s) number "
                f"{[i + 1 for i in short]} are shorter"
            )
        if any(any(c.isspace() for c in t) for t in toks):
            raise ValueError("a token may not contain whitespace")
        self._digests = [hashlib.sha256(t.encode()).digest() for t in toks]

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> BearerTokens:
        """One token per line; blank lines and lines starting with ``#`` are skipped."""
        with open(path, encoding="utf-8") as f:
            lines = [ln.strip() for ln in f]
        toks = [ln for ln in lines if ln and not ln.startswith("#")]
        if not toks:
            raise ValueError(f"token file {os.fspath(path)!r} holds no token")
        return cls(toks)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"BearerTokens({len(self)} tokens)"

    def check(self, token: str | None) -> bool:
        if not token:
            return False
        d = hashlib.sha256(token.encode()).digest()
        ok = False
        for known in self._digests:
            ok |= hmac.compare_digest(d, known)
        return ok


def check_bearer(authorization: str | None, tokens: BearerTokens) -> bool:
    """Whether an ``Authorization`` header value (``Bearer <token>``, the scheme
    case-insensitive) carries one of ``tokens``. For any front door: gRPC metadata here,
    an HTTP header elsewhere."""
    if not authorization:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and tokens.check(token.strip())


# ---------------------------------------------------------------- TLS


def read_pem(value: bytes | str | os.PathLike | None) -> bytes | None:
    """PEM bytes as given, or read from a path."""
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


@dataclass(frozen=True)
class TLSConfig:
    """PEM material of one process. ``cert``/``key``: what its servers present (and, when
    the cluster uses mutual TLS, what it presents when it connects to another member);
    ``client_ca``: set, its servers require client certificates chaining to it; ``ca``: the
    roots it trusts when it connects to other members (None: the system's roots)."""

    cert: bytes | None = None
    key: bytes | None = field(default=None, repr=False)
    client_ca: bytes | None = None
    ca: bytes | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a TLS certificate needs its key and a key its certificate")
        if self.client_ca is not None and self.cert is None:
            raise ValueError("client certificates (client_ca) can be required only with a cert")

    @classmethod
    def from_files(
        cls,
        cert: str | os.PathLike | None = None,
        key: str | os.PathLike | None = None,
        client_ca: str | os.PathLike | None = None,
        ca: str | os.PathLike | None = None,
    ) -> TLSConfig | None:
        """None when no file is given (plaintext)."""
        if not any((cert, key, client_ca, ca)):
            return None
        return cls(read_pem(cert), read_pem(key), read_pem(client_ca), read_pem(ca))

    @property
    def serves(self) -> bool:
        return self.cert is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ValueError("serving TLS needs a certificate and its key")
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials to reach another member: trust ``ca``, present our own certificate
        when the cluster requires client certificates."""
        mutual = self.client_ca is not None
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca,
            private_key=self.key if mutual else None,
            certificate_chain=self.cert if mutual else None,
        )


# ---------------------------------------------------------------- the interceptor

OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.")  # probes carry no token


@dataclass(frozen=True)
class AccessPolicy:
    """Which methods need what. ``cluster_only``: full method names (``/pkg.Svc/Method``)
    or service prefixes (``/pkg.Svc/``) that need the cluster identity; every other
    method but health and reflection needs a client token when ``tokens`` is set (or the
    cluster identity: members may call client methods too)."""

    identity: ClusterIdentity | None = None
    tokens: BearerTokens | None = None
    cluster_only: tuple[str, ...] = ()

    def is_cluster_only(self, method: str) -> bool:
        return any(
            method == m or (m.endswith("/") and method.startswith(m)) for m in self.cluster_only
        )

    def is_member(self, metadata: Metadata | None) -> bool:
        return self.identity is not None and self.identity.authenticates(metadata)

    def verdict(self, method: str, metadata: Metadata | None) -> str | None:
        """None: allowed; else why not (the UNAUTHENTICATED details)."""
        if self.is_cluster_only(method):
            if self.identity is None:
                return (
                    f"{method} is for cluster members, and this server has no cluster secret "
                    "(--cluster-secret-file or KVMESH_CLUSTER_SECRET)"
                )
            if not self.is_member(metadata):
                return f"{method} is for cluster members: missing or wrong cluster credential"
            return None
        if self.tokens is None or method.lstrip("/").startswith(OPEN_SERVICES):
            return None
        if self.is_member(metadata) or check_bearer(_get(metadata, AUTHORIZATION_KEY), self.tokens):
            return None
        return "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls the ``AccessPolicy`` does not allow with UNAUTHENTICATED, before the
    servicer sees them; for an allowed call from a member that sent a nonce, sends the
    server's proof as initial metadata first."""

    def __init__(self, policy: AccessPolicy) -> None:
        self.policy = policy

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        md = details.invocation_metadata
        why = self.policy.verdict(details.method, md)
        if why is not None:
            return _replace(handler, _refuse(why, handler))
        nonce = _get(md, NONCE_METADATA_KEY)
        if nonce and self.policy.is_member(md):
            proof = ((PROOF_METADATA_KEY, self.policy.identity.proof(nonce[:128])),)
            return _replace(handler, _with_initial_metadata(proof, handler))
        return handler


def _behavior(handler: grpc.RpcMethodHandler):
    return (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )


def _replace(handler: grpc.RpcMethodHandler, behavior) -> grpc.RpcMethodHandler:
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _refuse(why: str, handler: grpc.RpcMethodHandler):
    if handler.response_streaming:

        async def refuse_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
            yield  # pragma: no cover  (an async generator, as grpc.aio expects here)

        return refuse_stream

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    return refuse


def _with_initial_metadata(md: Sequence[tuple[str, str]], handler: grpc.RpcMethodHandler):
    inner = _behavior(handler)
    if handler.response_streaming and inspect.isasyncgenfunction(inner):

        async def stream(request, context):
            await context.send_initial_metadata(md)
            async for item in inner(request, context):
                yield item

        return stream

    async def call(request, context):
        await context.send_initial_metadata(md)
        result = inner(request, context)
        return await result if inspect.isawaitable(result) else result

    return call
