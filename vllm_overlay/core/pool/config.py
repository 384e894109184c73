"""Pool configuration: validated once, with the offending key named."""

from __future__ import annotations

import dataclasses
import urllib.parse

SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss"}


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    url: str
    cluster: bool = False
    namespace: str = "default"
    connect_timeout_s: float = 1.0
    timeout_s: float = 2.0
    max_inflight_bytes: int = 256 << 20
    ttl_s: int | None = None
    retry_backoff_s: float = 1.0
    max_retry_backoff_s: float = 30.0
    tls_ca_file: str | None = None  # CA bundle for rediss:// / valkeys://

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ValueError("pool url is required, e.g. redis://host:6379")
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme not in SCHEMES:
            raise ValueError(
                f"pool url {self.redacted_url!r}: scheme must be "
                f"one of {', '.join(sorted(SCHEMES))}"
            )
        if not parsed.hostname:
            raise ValueError(f"pool url {self.redacted_url!r} has no host")
        if not isinstance(self.cluster, bool):
            raise ValueError(f"cluster must be true or false, got {self.cluster!r}")
        if (
            not isinstance(self.namespace, str)
            or not self.namespace
            or any(c in self.namespace for c in " :\n")
        ):
            raise ValueError(
                f"namespace {self.namespace!r}: a non-empty name without spaces or ':'"
            )
        for name in (
            "connect_timeout_s",
            "timeout_s",
            "retry_backoff_s",
            "max_retry_backoff_s",
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or value <= 0
            ):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if (
            isinstance(self.max_inflight_bytes, bool)
            or not isinstance(self.max_inflight_bytes, int)
            or self.max_inflight_bytes <= 0
        ):
            raise ValueError(
                f"max_inflight_bytes must be a positive integer, "
                f"got {self.max_inflight_bytes!r}"
            )
        if self.ttl_s is not None and (
            isinstance(self.ttl_s, bool)
            or not isinstance(self.ttl_s, int)
            or self.ttl_s <= 0
        ):
            raise ValueError(
                f"ttl_s must be a positive integer or null, got {self.ttl_s!r}"
            )

        if self.tls_ca_file is not None:
            import os

            if not isinstance(self.tls_ca_file, str) or not os.path.isfile(
                self.tls_ca_file
            ):
                raise ValueError(
                    f"tls_ca_file {self.tls_ca_file!r} is not a readable file"
                )
            if not self.tls:
                raise ValueError("tls_ca_file needs a rediss:// or valkeys:// url")

    @property
    def tls(self) -> bool:
        return urllib.parse.urlsplit(self.url).scheme in ("rediss", "valkeys")

    @classmethod
    def from_dict(cls, values: dict) -> PoolConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(
                f"unknown pool options {sorted(unknown)}; known: {sorted(known)}"
            )
        return cls(**values)

    @property
    def redis_url(self) -> str:
        """The URL redis-py understands (valkey[s]:// -> redis[s]://)."""
        parsed = urllib.parse.urlsplit(self.url)
        return urllib.parse.urlunsplit(parsed._replace(scheme=SCHEMES[parsed.scheme]))

    @property
    def redacted_url(self) -> str:
        parsed = urllib.parse.urlsplit(self.url if isinstance(self.url, str) else "")
        if parsed.password:
            netloc = parsed.netloc.replace(":" + parsed.password + "@", ":***@")
            parsed = parsed._replace(netloc=netloc)
        return urllib.parse.urlunsplit(parsed)
