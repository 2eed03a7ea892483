"""The per-job secret that authenticates every rendezvous, control and data connection.

The launcher (or the Spark driver) makes one secret per job and hands it to each worker in the
environment as hex; a process that does not know it cannot join the job or inject data.
"""

import secrets

from spark_hvd.common._bootstrap_contract import SECRET

SECRET_BYTES = 32


def make_secret() -> bytes:
    """Return a fresh random job secret (32 bytes from the OS CSPRNG)."""
    return secrets.token_bytes(SECRET_BYTES)


def secret_to_env(secret: bytes) -> str:
    """Encode a secret for an environment variable (lower-case hex)."""
    return secret.hex()


def secret_from_env(value: str) -> bytes:
    """Decode a secret written by :func:`secret_to_env`.

    Raises ``ValueError`` with a readable message when the value is empty or not hex, so a
    mangled environment fails at start-up instead of as an authentication failure later.
    """
    value = (value or "").strip()
    if not value:
        raise ValueError(f"{SECRET} is empty: the job secret is missing")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{SECRET} is not a hex string: the job secret is malformed") from None
