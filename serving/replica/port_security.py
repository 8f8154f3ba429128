"""Who may call an engine port: TLS, client certificates (mutual TLS), and the shared token.

``xlaserve engine`` serves its gRPC port (``serving.replica.engine_service``) with what a
:class:`PortSecurity` holds:

- TLS with its certificate and key (``--grpc-tls-cert``, ``--grpc-tls-key``); clients then
  connect to ``grpcs://host:port``.
- Mutual TLS (``--grpc-client-ca``): every client must present a certificate signed by that CA,
  or the TLS handshake fails (gRPC reports it to the client as UNAVAILABLE; no call is made).
- A shared token (``--grpc-token-file``): every call must carry ``authorization: Bearer
  <token>`` metadata (compared in constant time), or it ends with UNAUTHENTICATED before its
  handler runs. Every method is checked, ``Health`` included.

The clients' side is ``serving.rpc.channel_security``.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging

import grpc

from serving.rpc.channel_security import read_pem, read_token_file

log = logging.getLogger("xlaserve.engine_service")

REFUSED = "this engine port needs its token: send 'authorization: Bearer <token>' (the gateway: --grpc-token-file)"
"""The UNAUTHENTICATED message a call without the right token gets (it never says which it was)."""


@dataclasses.dataclass(frozen=True)
class PortSecurity:
    """How an engine port authenticates itself and its callers.

    Attributes:
      certificate_chain, private_key: PEM of the port's certificate and key (None: plain text).
      client_ca: PEM of the CA that must have signed every client's certificate (None: clients
        present none); needs TLS.
      token: the shared token every call must carry (None: none checked).

    Raises:
      ValueError: a certificate without its key (or the other way round); a client CA without TLS.
    """

    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    client_ca: bytes | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("TLS needs both --grpc-tls-cert and --grpc-tls-key")
        if self.client_ca is not None and self.certificate_chain is None:
            raise ValueError("--grpc-client-ca (mutual TLS) needs TLS: give --grpc-tls-cert and --grpc-tls-key")

    @classmethod
    def from_files(cls, tls_cert: str | None = None, tls_key: str | None = None, client_ca: str | None = None,
                   token_file: str | None = None) -> "PortSecurity":
        """Reads the PEM files and the token file (each optional).

        Raises:
          ValueError: a file that cannot be read or is not what it should be, or a combination
            :class:`PortSecurity` refuses.
        """
        return cls(certificate_chain=read_pem(tls_cert, "TLS certificate"),
                   private_key=read_pem(tls_key, "TLS key"),
                   client_ca=read_pem(client_ca, "client CA file"),
                   token=read_token_file(token_file) if token_file else None)

    @property
    def tls(self) -> bool:
        return self.certificate_chain is not None

    @property
    def authenticates_clients(self) -> bool:
        """Whether a caller must prove something (a token or a client certificate)."""
        return self.token is not None or self.client_ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        """The port's TLS credentials (client certificates required and verified with a client CA)."""
        return grpc.ssl_server_credentials([(self.private_key, self.certificate_chain)],
                                           root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The server interceptors that check every call (the token's)."""
        return [TokenCheck(self.token)] if self.token is not None else []

    def describe(self) -> str:
        """A short account for the start-up log (no secrets)."""
        parts = ["TLS" if self.tls else "plain text"]
        if self.client_ca is not None:
            parts.append("client certificates required")
        if self.token is not None:
            parts.append("token required")
        return ", ".join(parts)


class TokenCheck(grpc.aio.ServerInterceptor):
    """Ends every call that lacks ``authorization: Bearer <token>`` with UNAUTHENTICATED.

    Args:
      token: the shared token.
    """

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def authorized(self, metadata) -> bool:
        """Whether call ``metadata`` (key, value) pairs carry the token (constant-time compare)."""
        sent = next((v for k, v in metadata or () if k == "authorization"), None)
        if sent is None:
            return False
        sent = sent.encode() if isinstance(sent, str) else bytes(sent)
        return hmac.compare_digest(sent, self._expected)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or self.authorized(handler_call_details.invocation_metadata):
            return handler
        log.warning("refused %s: no or wrong engine token", handler_call_details.method)
        return _refusing(handler)


async def _refuse(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that refuses the call (the engine service's methods take one
    request: unary or server-streaming)."""
    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse, **kw)
    return grpc.unary_unary_rpc_method_handler(_refuse, **kw)
