"""The API key check (--api-key), shared by the server's routes and the Ray Serve ingress's own
routes (scaleout/ray_serve.py). Light on imports: the ingress does not load the server."""

from __future__ import annotations

import hashlib
import hmac


def key_digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def bearer_matches(authorization: str | None, digest: bytes) -> bool:
    """Whether an Authorization header carries the key whose SHA-256 is `digest`.

    The comparison takes the same time whatever the token (vLLM's way): both sides are hashed
    to 32 bytes, so neither the key's content nor its length leaks through response times, and
    hmac.compare_digest does not stop at the first differing byte. Starlette decodes headers as
    latin-1, so encoding back to latin-1 recovers the bytes the client sent.
    """
    if authorization is None:
        return False
    scheme, _, token = authorization.partition(" ")
    presented = key_digest(token.encode("latin-1"))
    return hmac.compare_digest(presented, digest) and scheme.lower() == "bearer"


def header_key_matches(value: str | None, digest: bytes) -> bool:
    """Whether a header that carries the key alone (Anthropic's `x-api-key`) is the key whose
    SHA-256 is `digest`, compared as bearer_matches compares."""
    if value is None:
        return False
    return hmac.compare_digest(key_digest(value.encode("latin-1")), digest)
