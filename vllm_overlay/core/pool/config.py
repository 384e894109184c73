"""Pool configuration: validated once, with the offending key named.

The URL is parsed once, here, into ``PoolConfig.parsed``; clients are built
from that object (never by re-parsing the URL).  A shared secret is read
from ``secret_file`` or the environment variable named by ``secret_env``,
never from the configuration itself; two independent keys derive from it
(keyed BLAKE2b, each with its own personalisation): ``mac_key`` signs the
values, ``name_key`` derives the key names (so names reveal nothing to a
reader without the secret).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import re
import urllib.parse

logger = logging.getLogger("vllm.overlay")

SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss"}
# Redis refuses SET EX when seconds * 1000 + now (ms) overflows a signed
# 64-bit integer; keep a margin of ~1000 years for "now".
MAX_TTL_S = (2**63 - 1 - 2**45) // 1000
# Query options the pool understands; anything else is an error.
QUERY_OPTIONS = (
    "client_name",
    "db",
    "health_check_interval",
    "password",
    "ssl_cert_reqs",
    "ssl_check_hostname",
    "username",
)
_HOST = re.compile(r"[A-Za-z0-9._-]+|\[?[0-9A-Fa-f:.]+\]?")
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
_warned_insecure: set[str] = set()


@dataclasses.dataclass(frozen=True)
class ParsedURL:
    """The pool URL, parsed and checked once."""

    scheme: str  # redis or rediss (valkey[s] mapped)
    host: str
    port: int
    db: int
    username: str | None
    password: str | None
    options: tuple[tuple[str, str], ...]  # validated query options

    @property
    def tls(self) -> bool:
        return self.scheme == "rediss"

    def option(self, name: str, default=None):
        return dict(self.options).get(name, default)


def _redact(url: str) -> str:
    parsed = urllib.parse.urlsplit(url)
    try:
        password = parsed.password
    except ValueError:
        password = None
    if password:
        netloc = parsed.netloc.replace(":" + password + "@", ":***@")
        parsed = parsed._replace(netloc=netloc)
    if parsed.query:
        parts = []
        for part in parsed.query.split("&"):
            name, sep, _ = part.partition("=")
            parts.append(f"{name}=***" if sep and name == "password" else part)
        parsed = parsed._replace(query="&".join(parts))
    return urllib.parse.urlunsplit(parsed)


def parse_url(url: str) -> ParsedURL:
    """Parse and check a pool URL; ValueError names ``url`` and the part."""
    shown = _redact(url)
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in SCHEMES:
        raise ValueError(
            f"url {shown!r}: scheme must be one of {', '.join(sorted(SCHEMES))}"
        )
    if not parsed.hostname:
        raise ValueError(f"url {shown!r} has no host")
    host = parsed.hostname
    if not _HOST.fullmatch(host):
        raise ValueError(f"url {shown!r}: host {host!r} is not a valid host name")
    try:
        port = parsed.port
    except ValueError as exc:
        raise ValueError(f"url {shown!r}: bad port ({exc})") from None
    if port is None:
        port = 6379
    if not 1 <= port <= 65535:
        raise ValueError(f"url {shown!r}: port {port} is out of range 1-65535")
    if parsed.fragment:
        raise ValueError(f"url {shown!r}: a fragment ('#...') is not allowed")
    path = urllib.parse.unquote(parsed.path)
    db = 0
    if path not in ("", "/"):
        if not re.fullmatch(r"/[0-9]+", path):
            raise ValueError(
                f"url {shown!r}: path {path!r} must be /<db number>, e.g. /0"
            )
        db = int(path[1:])
    try:
        pairs = urllib.parse.parse_qsl(
            parsed.query, keep_blank_values=True, strict_parsing=True
        )
    except ValueError as exc:
        raise ValueError(f"url {shown!r}: malformed query options ({exc})") from None
    options: dict[str, str] = {}
    for name, value in pairs:
        if name in options:
            raise ValueError(f"url {shown!r}: query option {name!r} given twice")
        if name == "decode_responses":
            raise ValueError(
                f"url {shown!r}: query option 'decode_responses' is not "
                "allowed: KV values are binary"
            )
        if name not in QUERY_OPTIONS:
            raise ValueError(
                f"url {shown!r}: unknown query option {name!r}; known: "
                f"{', '.join(QUERY_OPTIONS)}"
            )
        if value == "":
            raise ValueError(f"url {shown!r}: query option {name!r} has no value")
        options[name] = value
    if "db" in options:
        if not options["db"].isdigit():
            raise ValueError(f"url {shown!r}: query option 'db' must be an integer")
        if path not in ("", "/") and int(options["db"]) != db:
            raise ValueError(f"url {shown!r}: db given both in the path and 'db'")
        db = int(options.pop("db"))
    if "health_check_interval" in options and not (
        options["health_check_interval"].isdigit()
    ):
        raise ValueError(
            f"url {shown!r}: query option 'health_check_interval' must "
            "be a whole number of seconds"
        )
    for name in ("ssl_check_hostname",):
        if name in options and options[name].lower() not in _BOOLS:
            raise ValueError(f"url {shown!r}: query option {name!r} must be true/false")
    scheme = SCHEMES[parsed.scheme]
    if "ssl_cert_reqs" in options and (
        options["ssl_cert_reqs"] not in ("none", "optional", "required")
    ):
        raise ValueError(
            f"url {shown!r}: query option 'ssl_cert_reqs' must be "
            "none, optional or required"
        )
    for name in ("ssl_cert_reqs", "ssl_check_hostname"):
        if name in options and scheme != "rediss":
            raise ValueError(
                f"url {shown!r}: query option {name!r} needs rediss:// or valkeys://"
            )
    username = urllib.parse.unquote(parsed.username) if parsed.username else None
    password = urllib.parse.unquote(parsed.password) if parsed.password else None
    if "username" in options:
        username = options.pop("username")
    if "password" in options:
        password = options.pop("password")
    return ParsedURL(
        scheme=scheme,
        host=host,
        port=port,
        db=db,
        username=username,
        password=password,
        options=tuple(sorted(options.items())),
    )


# A pool tier's entry in vLLM 0.32's ``secondary_tiers`` reaches the tier
# less ``type``, ``module_path`` and ``backpressure`` (upstream's factory
# takes those out): the pool's options, and ``locality``, which is the
# tier's (upstream also picks back-pressure watermarks by it).
LOCALITIES = ("LOCAL", "REMOTE")


def tier_options(options: dict) -> tuple[dict, str]:
    """A pool tier's options split into the pool's (for
    ``PoolConfig.from_dict``) and its locality (``REMOTE`` unless given;
    case-insensitive); ValueError names a bad one."""
    pool = dict(options)
    locality = pool.pop("locality", None)
    if locality is None:
        return pool, "REMOTE"
    if not isinstance(locality, str) or locality.upper() not in LOCALITIES:
        raise ValueError(f"locality {locality!r} is not one of {', '.join(LOCALITIES)}")
    return pool, locality.upper()


def _read_secret(secret_file: str | None, secret_env: str | None) -> bytes | None:
    """The shared secret (at least 16 bytes), or None."""
    if secret_file is not None and secret_env is not None:
        raise ValueError("secret_file and secret_env: give one, not both")
    if secret_file is not None:
        if not isinstance(secret_file, str) or not os.path.isfile(secret_file):
            raise ValueError(f"secret_file {secret_file!r} is not a readable file")
        with open(secret_file, "rb") as f:
            secret = f.read().strip()
        where = f"secret_file {secret_file!r}"
    elif secret_env is not None:
        if not isinstance(secret_env, str) or not secret_env:
            raise ValueError(f"secret_env {secret_env!r}: name an environment variable")
        secret = os.environ.get(secret_env, "").strip().encode()
        where = f"secret_env {secret_env!r}"
    else:
        return None
    if len(secret) < 16:
        raise ValueError(
            f"{where}: the shared secret must be at least 16 bytes "
            f"(got {len(secret)}); e.g. `openssl rand -hex 32`"
        )
    return secret


def _derive(secret: bytes | None, person: bytes, size: int) -> bytes | None:
    """A key derived from the shared secret, one per use (``person``)."""
    if secret is None:
        return None
    return hashlib.blake2b(secret, digest_size=size, person=person).digest()


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    url: str
    cluster: bool = False
    namespace: str = "default"
    connect_timeout_s: float = 1.0
    timeout_s: float = 2.0
    # How long a request waits for a lookup before it computes without the
    # pool; a pool slower than this is paused (a background PING resumes it).
    lookup_wait_s: float = 0.25
    # The longest one load or one store may take as a whole: a load past it
    # fails (its blocks recompute), a thread busy past it pauses the pool.
    io_timeout_s: float = 10.0
    max_inflight_bytes: int = 256 << 20
    # Bytes of values being loaded at once; None: max_inflight_bytes.
    max_inflight_load_bytes: int | None = None
    ttl_s: int | None = None
    retry_backoff_s: float = 1.0
    max_retry_backoff_s: float = 30.0
    tls_ca_file: str | None = None  # CA bundle (PEM) for rediss:// / valkeys://
    secret_file: str | None = None  # file holding the shared secret
    secret_env: str | None = None  # environment variable holding it
    parsed: ParsedURL = dataclasses.field(init=False, repr=False, compare=False)
    # Derived from the secret (None without one): the values' MAC key, and
    # the key that derives key names (see core.pool.keys.pool_key).
    mac_key: bytes | None = dataclasses.field(init=False, repr=False, compare=False)
    name_key: bytes | None = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ValueError("url is required, e.g. redis://host:6379")
        object.__setattr__(self, "parsed", parse_url(self.url))
        if not isinstance(self.cluster, bool):
            raise ValueError(f"cluster must be true or false, got {self.cluster!r}")
        if self.cluster and self.parsed.db != 0:
            raise ValueError(
                f"url {self.redacted_url!r}: cluster=true supports db 0 only"
            )
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
            "lookup_wait_s",
            "io_timeout_s",
            "retry_backoff_s",
            "max_retry_backoff_s",
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(
                    f"{name} must be a positive finite number, got {value!r}"
                )
        if self.max_retry_backoff_s < self.retry_backoff_s:
            raise ValueError(
                f"max_retry_backoff_s ({self.max_retry_backoff_s}) must be >= "
                f"retry_backoff_s ({self.retry_backoff_s})"
            )
        for name in ("max_inflight_bytes", "max_inflight_load_bytes"):
            value = getattr(self, name)
            if name == "max_inflight_load_bytes" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.ttl_s is not None and (
            isinstance(self.ttl_s, bool)
            or not isinstance(self.ttl_s, int)
            or not 0 < self.ttl_s <= MAX_TTL_S
        ):
            raise ValueError(
                f"ttl_s must be a positive integer up to {MAX_TTL_S} or null, "
                f"got {self.ttl_s!r}"
            )
        if self.tls_ca_file is not None:
            if not isinstance(self.tls_ca_file, str) or not os.path.isfile(
                self.tls_ca_file
            ):
                raise ValueError(
                    f"tls_ca_file {self.tls_ca_file!r} is not a readable file"
                )
            if not self.tls:
                raise ValueError("tls_ca_file needs a rediss:// or valkeys:// url")
            import ssl

            try:
                ssl.create_default_context(cafile=self.tls_ca_file)
            except (ssl.SSLError, OSError, ValueError) as exc:
                raise ValueError(
                    f"tls_ca_file {self.tls_ca_file!r} is not a PEM CA bundle ({exc})"
                ) from None
        secret = _read_secret(self.secret_file, self.secret_env)
        object.__setattr__(self, "mac_key", _derive(secret, b"vkv-pool-secret", 64))
        object.__setattr__(self, "name_key", _derive(secret, b"vkv-pool-names", 32))
        if (
            self.parsed.option("ssl_cert_reqs") == "none"
            and self.url not in _warned_insecure
        ):
            _warned_insecure.add(self.url)
            logger.warning(
                "vllm-overlay KV pool %s: ssl_cert_reqs=none - the server's "
                "certificate is NOT verified; anyone on the network path can "
                "impersonate the pool and read or inject KV values",
                self.redacted_url,
            )

    @property
    def tls(self) -> bool:
        return self.parsed.tls

    @property
    def load_limit_bytes(self) -> int:
        return self.max_inflight_load_bytes or self.max_inflight_bytes

    def check_value_size(self, value_bytes: int) -> None:
        """Startup check (a worker knows its value size once its KV cache
        is registered): every limit must hold at least one value, or
        nothing would ever be stored or loaded."""
        for name, limit in (
            ("max_inflight_bytes", self.max_inflight_bytes),
            ("max_inflight_load_bytes", self.load_limit_bytes),
        ):
            if limit < value_bytes:
                raise ValueError(
                    f"KV pool: {name} ({limit} B) is smaller than one value "
                    f"({value_bytes} B: one block of every layer of this "
                    f"worker, with its header); nothing could ever be "
                    f"{'stored' if name == 'max_inflight_bytes' else 'loaded'}. "
                    f"Set it to at least {value_bytes} (it is host memory "
                    "allocated at startup)"
                )

    @classmethod
    def from_dict(cls, values: dict) -> PoolConfig:
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = set(values) - known
        if unknown:
            raise ValueError(
                f"unknown pool options {sorted(unknown)}; known: {sorted(known)}"
            )
        return cls(**values)

    def client_kwargs(self) -> dict:
        """Keyword arguments for redis-py's clients, from the parsed URL."""
        p = self.parsed
        kwargs = dict(
            host=p.host.strip("[]"),
            port=p.port,
            username=p.username,
            password=p.password,
            socket_connect_timeout=self.connect_timeout_s,
            socket_timeout=self.timeout_s,
        )
        if not self.cluster:
            kwargs["db"] = p.db
        if p.option("client_name"):
            kwargs["client_name"] = p.option("client_name")
        if p.option("health_check_interval"):
            kwargs["health_check_interval"] = int(p.option("health_check_interval"))
        if p.tls:
            kwargs["ssl"] = True
            kwargs["ssl_cert_reqs"] = p.option("ssl_cert_reqs", "required")
            # Explicit: redis-py before 6.0 skips the host name check unless
            # told to (6.0 turned it on by default).
            check = p.option("ssl_check_hostname")
            kwargs["ssl_check_hostname"] = (
                _BOOLS[check.lower()]
                if check is not None
                else kwargs["ssl_cert_reqs"] != "none"
            )
            if self.tls_ca_file:
                kwargs["ssl_ca_certs"] = self.tls_ca_file
        return kwargs

    @property
    def redis_url(self) -> str:
        """The URL redis-py understands (valkey[s]:// -> redis[s]://)."""
        parsed = urllib.parse.urlsplit(self.url)
        return urllib.parse.urlunsplit(parsed._replace(scheme=SCHEMES[parsed.scheme]))

    @property
    def redacted_url(self) -> str:
        return _redact(self.url if isinstance(self.url, str) else "")

    def redact(self, text: str) -> str:
        """``text`` (an error message) with the password masked."""
        password = getattr(self, "parsed", None) and self.parsed.password
        return text.replace(password, "***") if password else text
