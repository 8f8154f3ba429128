"""Certificates and a token for the engine port's tests (``trustme``): one CA that signs the
replica's and the gateway's certificates, and a stranger CA with a client certificate of its own."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import trustme


@dataclasses.dataclass(frozen=True)
class PortFiles:
    """PEM and token files on disk, as the flags take them.

    Attributes:
      ca: the CA that signed ``server_cert`` and ``client_cert``.
      server_cert, server_key: the replica's (names 127.0.0.1 and localhost).
      client_cert, client_key: the gateway's, signed by ``ca``.
      stranger_cert, stranger_key: a client certificate signed by another CA.
      token, wrong_token: token files.
    """

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    stranger_key: Path
    token: Path
    wrong_token: Path


def make_port_files(folder: Path) -> PortFiles:
    """Writes fresh certificates and tokens under ``folder``."""
    ca, stranger_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("gateway.xlaserve.test")
    stranger = stranger_ca.issue_cert("gateway.xlaserve.test")
    files = PortFiles(*(folder / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key",
                                              "stranger.pem", "stranger.key", "token", "wrong-token")))
    ca.cert_pem.write_to_path(str(files.ca))
    for cert, cert_path, key_path in ((server, files.server_cert, files.server_key),
                                      (client, files.client_cert, files.client_key),
                                      (stranger, files.stranger_cert, files.stranger_key)):
        cert.private_key_pem.write_to_path(str(key_path))
        cert_path.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    files.token.write_text("s3cret-engine-token\n")
    files.wrong_token.write_text("not-the-token\n")
    return files
