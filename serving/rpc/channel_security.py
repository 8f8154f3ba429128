"""How a client reaches an engine port: the URL's scheme, TLS (and mutual TLS), the shared token.

The engine service (``xlaserve engine``) may serve TLS, ask for client certificates and check a
shared token on every call (``serving.replica.port_security``). Its clients are the gateway's
router (``serving.rpc.remote_engine``) and, for KV transfer, a decode replica pulling pages from a
prefill replica (``serving.replica.kv_transport``); both open their channels here.

- ``grpc://host:port`` (or ``host:port``): plain text.
- ``grpcs://host:port``: TLS; the replica's certificate must be signed by
  :attr:`ClientSecurity.root_certificates` (default: the system's roots) and name ``host``.
- The token goes as ``authorization: Bearer <token>`` metadata on every call
  (:attr:`ClientSecurity.metadata`): callers pass it with each call on asyncio channels;
  :func:`open_channel`'s blocking channels add it themselves (a client interceptor). gRPC's own
  call credentials would refuse to send it over a plain-text channel, and a token is also
  allowed there (a private network), so it is plain metadata.

No JAX: the gateway imports it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import grpc

SCHEMES = ("grpc", "grpcs")


def parse_engine_url(url: str) -> str:
    """``grpc://host:port``, ``grpcs://host:port`` (or ``host:port``) as the gRPC target ``host:port``.

    Raises:
      ValueError: another scheme, or no port.
    """
    scheme, sep, rest = url.partition("://")
    target = rest if sep else url
    if sep and scheme not in SCHEMES:
        raise ValueError(f"engine URL {url!r}: only grpc://host:port and grpcs://host:port (TLS) are supported")
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"engine URL {url!r} must be grpc://host:port or grpcs://host:port")
    return target


def uses_tls(url: str) -> bool:
    """Whether the engine URL asks for TLS (``grpcs://``)."""
    return url.startswith("grpcs://")


def read_token_file(path: str | Path) -> str:
    """The shared engine token in ``path``: its text without surrounding whitespace.

    Raises:
      ValueError: the file cannot be read, is empty, or holds more than one line.
    """
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the engine token file {path}: {e.strerror}") from e
    if not token or "\n" in token or not token.isprintable():
        raise ValueError(f"the engine token file {path} must hold one line of printable text")
    return token


def read_pem(path: str | Path | None, what: str) -> bytes | None:
    """The PEM file at ``path`` (None: None); ``what`` names it in errors.

    Raises:
      ValueError: it cannot be read or holds no PEM block.
    """
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path}: {e.strerror}") from e
    if b"-----BEGIN " not in data:
        raise ValueError(f"the {what} {path} is not PEM")
    return data


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    """What a client of an engine port presents and trusts.

    Attributes:
      root_certificates: PEM of the CAs that sign replicas' certificates (None: the system's roots);
        used for ``grpcs://`` URLs only.
      certificate_chain, private_key: PEM of this client's certificate and key, for a replica that
        asks for client certificates (mutual TLS); both or neither.
      token: the shared engine token (None: none sent).
    """

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs its key and a key its certificate "
                             "(--grpc-client-cert with --grpc-client-key)")

    @classmethod
    def from_files(cls, ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                   token_file: str | None = None) -> "ClientSecurity":
        """Reads the PEM files and the token file (each optional).

        Raises:
          ValueError: a file that cannot be read or is not what it should be; a certificate
            without its key or the other way round.
        """
        return cls(root_certificates=read_pem(ca_file, "CA file"),
                   certificate_chain=read_pem(cert_file, "client certificate"),
                   private_key=read_pem(key_file, "client key"),
                   token=read_token_file(token_file) if token_file else None)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata that carries the token (empty without one)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS channel credentials: the roots to trust and the client certificate, if any."""
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates,
                                            private_key=self.private_key,
                                            certificate_chain=self.certificate_chain)


PLAIN = ClientSecurity()
"""No TLS material, no token: what a client of an unprotected port uses."""


class _TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the token's metadata to every call of a blocking channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details.method, details.timeout, tuple(details.metadata or ()) + self._metadata,
                            details.credentials, getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


@dataclasses.dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


def open_channel(url: str, security: ClientSecurity = PLAIN,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A blocking channel to the engine at ``url`` (TLS for ``grpcs://``), the token on every call.

    Raises:
      ValueError: a malformed URL.
    """
    target = parse_engine_url(url)
    if uses_tls(url):
        channel = grpc.secure_channel(target, security.channel_credentials(), options=list(options))
    else:
        channel = grpc.insecure_channel(target, options=list(options))
    return grpc.intercept_channel(channel, _TokenMetadata(security.metadata)) if security.token else channel


def open_aio_channel(url: str, security: ClientSecurity = PLAIN,
                     options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to the engine at ``url`` (TLS for ``grpcs://``); calls on it must pass
    ``metadata=security.metadata`` themselves.

    Raises:
      ValueError: a malformed URL.
    """
    target = parse_engine_url(url)
    if uses_tls(url):
        return grpc.aio.secure_channel(target, security.channel_credentials(), options=list(options))
    return grpc.aio.insecure_channel(target, options=list(options))
