"""The engine port's security flags: the port's side (``xlaserve engine``) and its clients' side
(``xlaserve serve --engines``, and ``engine`` itself when a decode replica pulls KV pages from a
prefill replica).

    # a replica: TLS, client certificates required, a shared token on every call
    xlaserve engine --host 0.0.0.0 --grpc-port 50051 --grpc-tls-cert engine.pem --grpc-tls-key engine.key \\
        --grpc-client-ca ca.pem --grpc-token-file token
    # the gateway
    xlaserve serve --engines grpcs://engine-0:50051 --grpc-ca-file ca.pem \\
        --grpc-client-cert gateway.pem --grpc-client-key gateway.key --grpc-token-file token

A port that authenticates no caller (no token, no client CA) refuses to bind beyond loopback
unless ``--insecure-engine-port`` is given (:func:`check_exposure`).
"""

from __future__ import annotations

import argparse
import logging

from serving.cli.bootstrap import _is_loopback
from serving.replica.port_security import PortSecurity
from serving.rpc.channel_security import ClientSecurity, uses_tls

log = logging.getLogger("xlaserve")


def add_port_flags(p: argparse.ArgumentParser) -> None:
    """The engine port's own flags (``xlaserve engine``)."""
    g = p.add_argument_group("engine port security (docs/operator/replicas.md)")
    g.add_argument("--grpc-tls-cert", metavar="PEM", help="serve the gRPC port over TLS with this certificate "
                   "(chain); clients then use grpcs://host:port")
    g.add_argument("--grpc-tls-key", metavar="PEM", help="the private key of --grpc-tls-cert")
    g.add_argument("--grpc-client-ca", metavar="PEM", help="mutual TLS: every client must present a "
                   "certificate signed by this CA (needs --grpc-tls-cert)")
    g.add_argument("--insecure-engine-port", action="store_true",
                   help="bind a non-loopback --host although callers need neither a token nor a client "
                   "certificate (anyone who reaches the port can generate and read KV pages)")
    _add_client_flags(g, peer=True)


def add_client_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a client of engine ports (``xlaserve serve --engines``)."""
    _add_client_flags(p.add_argument_group("engine port security, with --engines (docs/operator/replicas.md)"),
                      peer=False)


def _add_client_flags(g, peer: bool) -> None:
    whose = "other replicas' (for KV pulls over grpcs://)" if peer else "the replicas' (grpcs:// URLs)"
    g.add_argument("--grpc-ca-file", metavar="PEM",
                   help=f"CA that signed {whose} certificates (default: "
                   + ("--grpc-client-ca, else " if peer else "") + "the system's roots)")
    g.add_argument("--grpc-client-cert", metavar="PEM",
                   help="client certificate for replicas that require one (mutual TLS)"
                   + (" (default: --grpc-tls-cert)" if peer else ""))
    g.add_argument("--grpc-client-key", metavar="PEM", help="the private key of --grpc-client-cert"
                   + (" (default: --grpc-tls-key)" if peer else ""))
    g.add_argument("--grpc-token-file", metavar="FILE",
                   help="a file holding the shared engine token (one line): "
                   + ("every call to this port must carry it, and this replica sends it to the replicas "
                      "it pulls KV pages from" if peer else "sent on every call to the replicas"))


def port_security(args: argparse.Namespace) -> PortSecurity:
    """The engine port's :class:`PortSecurity` from ``engine``'s flags.

    Raises:
      ValueError: an unreadable file, or a combination that cannot work.
    """
    return PortSecurity.from_files(args.grpc_tls_cert, args.grpc_tls_key, args.grpc_client_ca,
                                   args.grpc_token_file)


def client_security(args: argparse.Namespace, peer: bool = False) -> ClientSecurity:
    """How this process calls engine ports (``serve``'s flags; ``engine``'s with ``peer``, where the
    CA defaults to ``--grpc-client-ca`` and the client certificate to the port's own).

    Raises:
      ValueError: an unreadable file, a certificate without its key.
    """
    ca, cert, key = args.grpc_ca_file, args.grpc_client_cert, args.grpc_client_key
    if peer:
        ca = ca or args.grpc_client_ca
        if cert is None and key is None:
            cert, key = args.grpc_tls_cert, args.grpc_tls_key
    return ClientSecurity.from_files(ca, cert, key, args.grpc_token_file)


def check_exposure(host: str, security: PortSecurity, insecure: bool) -> None:
    """Refuses an engine port beyond loopback that lets anyone in; warns about weaker set-ups.

    Raises:
      ValueError: ``host`` is not a loopback address, callers need neither a token nor a client
        certificate, and ``insecure`` (``--insecure-engine-port``) is off.
    """
    if _is_loopback(host):
        return
    if not security.authenticates_clients:
        if not insecure:
            raise ValueError(
                f"refusing to serve the engine port on {host} to anyone who can reach it: give "
                f"--grpc-token-file FILE (a shared token checked on every call) and/or --grpc-tls-cert, "
                f"--grpc-tls-key and --grpc-client-ca (mutual TLS); or pass --insecure-engine-port if only "
                f"the gateways can reach {host}")
        log.warning("--insecure-engine-port: the engine port on %s authenticates no caller: keep it on a "
                    "network only the gateways reach", host)
    elif not security.tls:
        log.warning("the engine port on %s is plain text: its token crosses the network in clear "
                    "(--grpc-tls-cert/--grpc-tls-key encrypt it)", host)


def check_engine_urls(urls: list[str], security: ClientSecurity) -> None:
    """Warns where ``serve``'s flags and its engine URLs disagree (TLS material for plain-text URLs,
    a token sent in clear beyond loopback)."""
    plain = [u for u in urls if not uses_tls(u)]
    if plain and (security.root_certificates or security.certificate_chain):
        log.warning("--grpc-ca-file/--grpc-client-cert apply to grpcs:// URLs only; plain text to %s",
                    ", ".join(plain))
    if security.token:
        clear = [u for u in plain if not _is_loopback(u.removeprefix("grpc://").rpartition(":")[0].strip("[]"))]
        if clear:
            log.warning("the engine token goes in clear to %s (use grpcs://)", ", ".join(clear))
