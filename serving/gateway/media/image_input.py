"""An ``image_url`` content part -> a decoded, checked, preprocessed image.

A part's URL is a data URL (``data:image/png;base64,...``) or, when the operator lists its
host in ``--allowed-media-domains``, an ``http(s)`` URL fetched with a size cap and a total
deadline (httpx; ``fetch_timeout_s`` for resolving, connecting and every byte together, so a
server trickling a byte now and then cannot hold a fetch). The host's name is resolved first
and every address it resolves to must be public (no loopback, private, link-local, shared,
reserved or multicast address, IPv4-mapped ones included): an allowed wildcard cannot reach
an internal host. The fetch then connects to the address that was checked (the URL's name
still goes as ``Host`` and as the TLS server name, which the certificate must match), so a
second resolution cannot hand it another one. Every refusal is an :class:`~serving.gateway.http.errors.OpenAIError` (400) whose
``param`` names the content part (``messages[0].content[1]``), so nothing but that request
is affected:

* a URL that is neither a data URL nor an allowed ``http(s)`` URL (``--allowed-media-domains``
  empty: remote URLs are refused), a host resolving to a non-public address
  (``image_url_not_allowed``), a remote fetch that fails, passes its deadline or exceeds the size;
* a data URL that is not base64, whose media type is not one of :data:`MEDIA_TYPES`, or
  whose bytes are not an image of that type (Pillow decides);
* an image of more than ``max_image_bytes`` bytes or ``max_image_pixels`` pixels (checked
  from the header, before the pixels are decoded);
* more than ``max_images`` images in one request (:func:`check_image_count`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import io
import ipaddress
import re
import socket
import ssl
import urllib.parse
from typing import Awaitable, Callable

import anyio

from PIL import Image, UnidentifiedImageError

from serving.gateway.http.errors import OpenAIError
from serving.gateway.http.limits import MediaLimits

__all__ = ["MEDIA_TYPES", "MediaLimits", "check_image_count", "decode_image", "fetch_tls_context", "image_bytes",
           "image_pixels", "load_image"]

MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
               "image/gif": "GIF", "image/bmp": "BMP"}
"""Media types a data URL may declare -> the Pillow format its bytes must have."""

_DATA_URL = re.compile(r"^data:([^;,]*)((?:;[^;,]*)*),(.*)$", re.DOTALL)


def check_image_count(count: int, limits: MediaLimits, param: str) -> None:
    """Raises OpenAIError 400 when ``count`` images exceed ``limits.max_images``."""
    if count > limits.max_images:
        raise OpenAIError(f"The request has {count} images; at most {limits.max_images} are allowed.",
                          param=param, code="too_many_images")


def _refuse(message: str, param: str, code: str = "invalid_image") -> OpenAIError:
    return OpenAIError(f"{param}: {message}", param=param, code=code)


def decode_image(data: bytes, media_type: str | None, limits: MediaLimits, param: str) -> Image.Image:
    """The image in ``data`` (Pillow, pixels loaded), checked against ``limits`` and, when
    ``media_type`` is given, against the type it declares.

    Raises:
      OpenAIError: 400 naming ``param``.
    """
    image = _open_checked(data, media_type, limits, param)
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise _refuse(f"The image could not be decoded ({type(e).__name__}: {e}).", param) from None
    return image


def _open_checked(data: bytes, media_type: str | None, limits: MediaLimits, param: str) -> Image.Image:
    """The image in ``data`` opened (its header read, no pixels), its bytes, type and size checked."""
    if len(data) > limits.max_image_bytes:
        raise _refuse(f"The image is {len(data)} bytes; at most {limits.max_image_bytes} are allowed.",
                      param, "image_too_large")
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise _refuse(f"The image could not be decoded ({type(e).__name__}).", param) from None
    want = MEDIA_TYPES.get(media_type) if media_type else None
    if want is not None and image.format != want:
        raise _refuse(f"The data URL declares {media_type} but holds {image.format or 'another format'}.", param)
    if image.format not in set(MEDIA_TYPES.values()):
        raise _refuse(f"Unsupported image format {image.format}; send one of "
                      f"{', '.join(sorted(MEDIA_TYPES))}.", param)
    w, h = image.size
    if w * h > limits.max_image_pixels:
        raise _refuse(f"The image is {w}x{h} = {w * h} pixels; at most {limits.max_image_pixels} are allowed.",
                      param, "image_too_large")
    return image


def _host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    for entry in allowed:
        entry = entry.lower().rstrip(".")
        if host == entry or (entry.startswith("*.") and host.endswith(entry[1:])):
            return True
    return False


def image_pixels(data: bytes, media_type: str | None, limits: MediaLimits, param: str) -> int:
    """Width x height of the image in ``data``, read from its header (no pixels decoded), after
    the checks of :func:`decode_image` that need no pixels.

    Raises:
      OpenAIError: 400 naming ``param``.
    """
    image = _open_checked(data, media_type, limits, param)
    w, h = image.size
    image.close()
    return w * h


Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``await resolve(host, port)``: the IP addresses `host` resolves to (strings)."""


async def resolve_host(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to, through the event loop's resolver (a worker thread)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


@functools.cache
def fetch_tls_context() -> ssl.SSLContext:
    """The TLS context of every remote image fetch (httpx's default: certifi's CA bundle, or
    ``SSL_CERT_FILE``/``SSL_CERT_DIR``), built once per process.

    Building one loads and parses the whole CA bundle: tens of milliseconds of CPU. Built per
    fetch (what a fresh ``httpx.AsyncClient`` does), it ran on the event loop for every remote
    image, so a tenant sending fetches stalled every other tenant's streams that long each time.
    The gateway builds it at start (``OpenAIServing``) when remote images are allowed.
    """
    import httpx

    return httpx.create_ssl_context()


def is_public_address(address: str) -> bool:
    """Whether ``address`` is a global unicast address (IPv4-mapped IPv6 judged as its IPv4)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def load_image(url: str, limits: MediaLimits, param: str, client=None, run=None,
                     resolve: Resolver | None = None) -> Image.Image:
    """The image an ``image_url`` part names.

    Args:
      url: a data URL, or an ``http(s)`` URL on an allowed host.
      param: the content part, for error messages (``messages[0].content[1]``).
      client: an ``httpx.AsyncClient`` for remote fetches (tests pass one with a mock
        transport); None: a fresh one per fetch.
      run: runs a blocking call off the event loop (``await run(fn, *args)``; the gateway's
        worker threads); None: on the event loop.
      resolve: the resolver of remote hosts (tests pass their own); None: :func:`resolve_host`.

    Raises:
      OpenAIError: 400 naming ``param`` (see the module docstring).
    """
    data, media_type = await image_bytes(url, limits, param, client, run, resolve)
    if run is None:
        return decode_image(data, media_type, limits, param)
    return await run(decode_image, data, media_type, limits, param)


async def image_bytes(url: str, limits: MediaLimits, param: str, client=None, run=None,
                      resolve: Resolver | None = None) -> tuple[bytes, str | None]:
    """The encoded bytes and declared media type of an ``image_url`` part (a data URL's
    payload, base64-decoded through ``run`` when given, or a remote fetch); nothing decoded.

    Raises:
      OpenAIError: 400 naming ``param`` (see the module docstring).
    """
    if not isinstance(url, str) or not url:
        raise _refuse("An image_url part needs a non-empty 'url'.", param)
    if url.startswith("data:"):
        m = _DATA_URL.match(url)
        if m is None:
            raise _refuse("The data URL is malformed (want data:image/<type>;base64,<data>).", param)
        media_type, params, payload = m.group(1).lower(), m.group(2).lower(), m.group(3)
        if media_type not in MEDIA_TYPES:
            raise _refuse(f"The data URL's media type {media_type or '(none)'!r} is not an image type this "
                          f"server takes ({', '.join(sorted(MEDIA_TYPES))}).", param, "invalid_image_type")
        if ";base64" not in params:
            raise _refuse("The data URL must be base64-encoded (data:<type>;base64,...).", param)
        if len(payload) > (limits.max_image_bytes * 4) // 3 + 8:
            raise _refuse(f"The image is over {limits.max_image_bytes} bytes.", param, "image_too_large")
        try:
            data = (base64.b64decode(payload, validate=True) if run is None
                    else await run(base64.b64decode, payload, validate=True))
        except (binascii.Error, ValueError):
            raise _refuse("The data URL's payload is not valid base64.", param) from None
        return data, media_type
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise _refuse("An image URL must be a data URL (data:image/...;base64,...) or an http(s) URL.", param,
                      "invalid_image_url")
    if not _host_allowed(parsed.hostname, limits.allowed_media_domains):
        raise _refuse(f"Images from {parsed.hostname!r} are not allowed; send the image as a data URL "
                      "(the operator lists the hosts it fetches from with --allowed-media-domains).",
                      param, "image_url_not_allowed")
    try:
        with anyio.fail_after(limits.fetch_timeout_s):  # one deadline for all of it
            return await _fetch(url, parsed, limits, param, client, resolve or resolve_host)
    except TimeoutError:
        raise _refuse(f"Fetching the image took over {limits.fetch_timeout_s} s.", param,
                      "image_fetch_failed") from None


async def _fetch(url: str, parsed: urllib.parse.SplitResult, limits: MediaLimits, param: str, client,
                 resolve: Resolver) -> tuple[bytes, str | None]:
    """The body (at most ``max_image_bytes``) and media type of a GET of ``url``, from a
    public address its host resolves to, without following redirects (a redirect could leave
    the allowed hosts)."""
    import httpx

    host = parsed.hostname
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        addresses = await resolve(host, port)
    except OSError as e:
        raise _refuse(f"The image's host could not be resolved ({type(e).__name__}).", param,
                      "image_fetch_failed") from None
    if not addresses:
        raise _refuse("The image's host resolves to no address.", param, "image_fetch_failed")
    if not all(is_public_address(a) for a in addresses):
        raise _refuse(f"The image's host {host!r} resolves to a non-public address; images are fetched "
                      "only from public ones.", param, "image_url_not_allowed")
    address = addresses[0]
    netloc = (f"[{address}]" if ":" in address else address) + (f":{parsed.port}" if parsed.port else "")
    pinned = urllib.parse.urlunsplit((parsed.scheme, netloc, parsed.path or "/", parsed.query, ""))
    host_header = host + (f":{parsed.port}" if parsed.port else "")
    own = client is None
    client = client or httpx.AsyncClient(timeout=limits.fetch_timeout_s, follow_redirects=False,
                                         verify=fetch_tls_context())
    try:
        async with client.stream("GET", pinned, headers={"Host": host_header}, timeout=limits.fetch_timeout_s,
                                 extensions={"sni_hostname": host}) as resp:
            if resp.status_code != 200:
                raise _refuse(f"Fetching the image gave HTTP {resp.status_code}.", param, "image_fetch_failed")
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > limits.max_image_bytes:
                    raise _refuse(f"The image is over {limits.max_image_bytes} bytes.", param, "image_too_large")
            media_type = (resp.headers.get("content-type") or "").split(";")[0].strip().lower() or None
            return bytes(body), media_type if media_type in MEDIA_TYPES else None
    except httpx.TimeoutException:
        raise _refuse(f"Fetching the image took over {limits.fetch_timeout_s} s.", param, "image_fetch_failed") from None
    except httpx.HTTPError as e:
        raise _refuse(f"Fetching the image failed ({type(e).__name__}).", param, "image_fetch_failed") from None
    finally:
        if own:
            await client.aclose()
