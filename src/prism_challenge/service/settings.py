"""The service's settings (pydantic-settings): environment ``PRISM_*``, or a TOML file.

Precedence, highest first: keyword arguments (``prism serve``'s options), the environment
(``PRISM_PROFILE=prism-v2``, ``PRISM_SLOTS=4``, ...), the TOML file named by
``PRISM_CONFIG`` (or :meth:`ServiceSettings.load`'s ``config``; top-level keys named like the
fields), then the defaults below. Every field is documented where it is declared, once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from prism_challenge.intake.refusal import IntakeLimits

CONFIG_ENV = "PRISM_CONFIG"
_LIMITS = IntakeLimits()
MIN_TOKEN_CHARS = 16
"""The shortest ``internal_token`` accepted."""
WEIGHT_RULES = ("family-split", "winner-takes-all")
"""The rules of ``GET /internal/v1/weights`` (:mod:`prism_challenge.service.weights`)."""


class ServiceSettings(BaseSettings):
    """Everything ``prism serve`` is configured with.

    Raises:
        pydantic.ValidationError: a value breaks its rule (the field is named).
    """

    model_config = SettingsConfigDict(env_prefix="PRISM_", extra="forbid", frozen=True)

    database_url: str | None = Field(None, description="SQLAlchemy URL; None: the SQLite file under the user "
                                     "data directory (prism_challenge.service.store.default_url)")
    blob_root: Path | None = Field(None, description="bundle bytes by sha256; None: <user data dir>/blobs")
    profile: str = Field("prism-v2", description="the challenge profile every submission is evaluated under "
                         "(a shipped name or a TOML file)")
    data_dir: Path | None = Field(None, description="the locked data directory of the profile (the dispatcher's)")
    run_root: Path | None = Field(None, description="where run directories go; None: <user data dir>/runs")
    work_dir: Path | None = Field(None, description="the folder of the attempts' temporary folders on every node "
                                  "(one per attempt, named by its token, removed when it ends; the reconcile "
                                  "removes those of attempts whose process died); None: <user data dir>/work")
    signing_key_file: Path | None = Field(None, description="the operator's ed25519 key that signs every run manifest "
                                          "(PKCS8 PEM, mode 0600: a file its group or others may read is refused); "
                                          "None: <user data dir>/signing-key.pem, created (0600) on first start "
                                          "(prism_challenge.service.settings.signing_key)")
    slots: int = Field(1, ge=1, le=1024, description="evaluations at once on the embedded Ray instance")
    ray_address: str | None = Field(None, description="join this Ray cluster (`ray start`); None: start a local one")
    dispatch: bool = Field(True, description="start the Ray dispatcher (False: intake and reading only)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(1 << 20, ge=1, description="largest request body in bytes (413 past it)")
    body_timeout_s: float = Field(60.0, gt=0, description="seconds a submission's whole body may take to arrive "
                                  "after its headers (408 past it)")
    max_connections: int = Field(64, ge=1, description="a request that finds this many connections open (its "
                                 "own included) is answered 503 (uvicorn's limit_concurrency): the bodies buffered "
                                 "in memory stay under about max_connections * max_body_bytes")
    max_bundle_files: int = Field(_LIMITS.max_files, ge=1, description="most zip members")
    max_bundle_bytes: int = Field(_LIMITS.max_archive_bytes, ge=1, description="most uncompressed zip bytes")
    max_bundle_ratio: float = Field(_LIMITS.max_ratio, gt=1, description="largest compression ratio of a member")
    ss58_prefix: int = Field(42, ge=0, le=16383, description="the SS58 network of hotkeys (42: generic "
                             "Substrate, Bittensor's); an address of another network is refused")
    signature_window_s: int = Field(300, ge=1, description="|now - X-Timestamp| allowed, seconds")
    rate_limit: int = Field(10, ge=1, description="accepted submissions per hotkey per window (counted in the "
                            "database: a restart keeps them; refused requests do not count)")
    rate_window_s: float = Field(3600.0, gt=0, description="the rate limits' sliding window, seconds")
    address_rate_limit: int = Field(10, ge=1, description="accepted submissions per client address per window "
                                    "(an IPv6 address counts by its ipv6_prefix network); the signed route only")
    ipv6_prefix: int = Field(64, ge=32, le=128, description="IPv6 clients are counted per network of this prefix "
                             "length (one host usually holds a whole /64)")
    trusted_proxies: list[str] = Field([], description="addresses or networks (CIDR) of reverse proxies whose "
                                       "X-Forwarded-For names the client (uvicorn's ProxyHeadersMiddleware); empty: "
                                       "the connection's peer is the client, forwarded headers are ignored")
    max_queued: int = Field(100, ge=1, description="pending submissions at most, all hotkeys together (503 "
                            "queue-full past it)")
    max_in_flight: int = Field(2, ge=1, description="submissions of one hotkey pending or running at once at most")
    hotkey_registry: Path | None = Field(None, description="only hotkeys listed here may submit (403 otherwise): "
                                         "a text file of one SS58 hotkey per line (# comments), or a .json snapshot "
                                         "of a metagraph (a list of hotkeys, or an object with a 'hotkeys' list); "
                                         "None: any hotkey")
    hotkey_registry_refresh_s: float = Field(60.0, gt=0, description="how often the registry file's mtime is "
                                             "checked (it is read again when it changed), seconds")
    header_timeout_s: float = Field(10.0, gt=0, description="seconds a connection may take to send a request's "
                                    "headers (from its opening, or from the previous response); then it is closed")
    keep_alive_s: int = Field(5, ge=1, description="an idle keep-alive connection is closed after this many "
                              "seconds (uvicorn's timeout_keep_alive)")
    max_header_bytes: int = Field(16 * 1024, ge=1024, description="largest request head in bytes (uvicorn's "
                                  "h11_max_incomplete_event_size; 400 past it)")
    check_resources: bool = Field(True, description="at start, refuse to dispatch when the profile's device, GPUs "
                                  "or data directory are missing where it evaluates; False: start anyway (a cluster "
                                  "that adds nodes on demand): attempts whose lease is not met fail after "
                                  "lease_timeout_s")
    lease_timeout_s: float = Field(600.0, gt=0, description="an attempt whose Ray actor has not started this many "
                                   "seconds after its launch ends failed (infrastructure), not retried, and /health "
                                   "reports it")
    internal_token: SecretStr | None = Field(None, description="bearer token of the internal routes; None: they "
                                             "answer 401")
    max_attempts: int = Field(3, ge=1, le=100, description="evaluations of one submission at most (retries of "
                              "infrastructure failures included)")
    weights_rule: Literal["family-split", "winner-takes-all"] = "family-split"
    family_share: float = Field(0.6, ge=0, le=1, description="family-split: the family owner's share; the best "
                                "training variant on it gets 1 - family_share")
    suspension_s: float | None = Field(None, gt=0, description="how long a finding (a run the audit caught: "
                                       "prism_challenge.service.findings) suspends its hotkey from the leaderboard, "
                                       "the weights and submitting, seconds; None: until an operator lifts it "
                                       "(prism findings lift)")
    public_architectures: list[Path] = Field([], description="architecture.py files whose families are public "
                                             "(nobody's variant, no author's share), besides prism init's template "
                                             "and the source tree's examples")
    intake_parameter_check: bool = Field(False, description="also run the parameter cap (a sandboxed build_model) "
                                         "at intake; the evaluation runs it anyway")
    intake_timeout_s: float = Field(60.0, gt=0, description="the parameter cap's child limit at intake, seconds")

    @field_validator("public_architectures")
    @classmethod
    def _existing_architectures(cls, value: list[Path]) -> list[Path]:
        missing = [str(p) for p in value if not Path(p).is_file()]
        if missing:
            raise ValueError(f"no such file: {', '.join(missing)}")
        return value

    @field_validator("hotkey_registry")
    @classmethod
    def _existing_registry(cls, value: Path | None) -> Path | None:
        if value is not None and not Path(value).is_file():
            raise ValueError(f"{value}: no such file (the hotkey registry)")
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _proxy_networks(cls, value: list[str]) -> list[str]:
        import ipaddress

        for item in value:
            try:
                ipaddress.ip_network(item)  # strict, as uvicorn reads it
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address or network (CIDR)") from None
        return value

    @field_validator("internal_token")
    @classmethod
    def _long_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_TOKEN_CHARS:
            raise ValueError(f"must be at least {MIN_TOKEN_CHARS} characters (failed tries are not limited, so a "
                             "short token can be guessed online; e.g. python -c 'import secrets; "
                             "print(secrets.token_urlsafe(32))')")
        return value

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, value: str) -> str:
        from prism_challenge.profiles import load_profile

        load_profile(value)  # ProfileError (a ValueError) names the file and rule
        return value

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Keyword arguments, then ``PRISM_*``, then the TOML file of ``PRISM_CONFIG``."""
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config = os.environ.get(CONFIG_ENV)
        if config:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=_existing(Path(config))))
        return tuple(sources)

    @classmethod
    def load(cls, config: Path | None = None, **overrides: object) -> ServiceSettings:
        """Settings from ``config`` (a TOML file; default ``$PRISM_CONFIG``), the environment and
        ``overrides`` (``None`` values are dropped: an option not given).

        Raises:
            FileNotFoundError: ``config`` does not exist.
            pydantic.ValidationError: a bad value.
        """
        given = {k: v for k, v in overrides.items() if v is not None}
        if config is None:
            return cls(**given)
        old = os.environ.get(CONFIG_ENV)
        os.environ[CONFIG_ENV] = str(_existing(Path(config)))
        try:
            return cls(**given)
        finally:
            if old is None:
                os.environ.pop(CONFIG_ENV, None)
            else:
                os.environ[CONFIG_ENV] = old


def _existing(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such settings file ({CONFIG_ENV})")
    return path


__all__ = ["CONFIG_ENV", "MIN_TOKEN_CHARS", "ServiceSettings", "WEIGHT_RULES"]


SIGNING_KEY_ENV = "PRISM_SIGNING_KEY_FILE"
"""The environment variable of :attr:`ServiceSettings.signing_key_file`, which the workers read too."""


def default_signing_key_file() -> Path:
    """The service's key when none is named: ``$PRISM_SIGNING_KEY_FILE``, else
    ``<platformdirs user_data_dir('prism-challenge')>/signing-key.pem`` (the state directory of
    the SQLite database and the blobs)."""
    from platformdirs import user_data_dir

    from prism_challenge.manifest.certificate import KEY_FILE_NAME

    named = os.environ.get(SIGNING_KEY_ENV)
    return Path(named) if named else Path(user_data_dir("prism-challenge")) / KEY_FILE_NAME


def signing_key(settings: ServiceSettings) -> tuple[object, Path]:
    """The operator's signing key and its file: ``settings.signing_key_file`` (it must exist),
    else :func:`default_signing_key_file`, created (mode 0600, folder 0700) when absent.

    Raises:
        prism_challenge.manifest.certificate.CertificateError: the file is missing (when named), readable
            by its group or others, or not an ed25519 key.
    """
    from prism_challenge.manifest.certificate import create_key_file, load_private_key

    if settings.signing_key_file is not None:
        return load_private_key(settings.signing_key_file), Path(settings.signing_key_file)
    path = default_signing_key_file()
    return (load_private_key(path) if path.exists() else create_key_file(path)), path


def publish_key(settings: ServiceSettings) -> dict[str, str]:
    """Load (or create) the operator's key at start (:func:`signing_key`), name a file the
    settings name in ``$PRISM_SIGNING_KEY_FILE`` for the workers this process starts (the
    default one they find by themselves), and return what the
    service publishes: ``{"signing_public_key": base64 raw key, "signing_key_id": 16 hex}``.

    Raises:
        prism_challenge.manifest.certificate.CertificateError: see :func:`signing_key`.
    """
    from prism_challenge.manifest.certificate import key_id, public_key_text

    import base64

    key, path = signing_key(settings)
    if settings.signing_key_file is not None:  # named in a file or an argument: the workers see it too
        os.environ[SIGNING_KEY_ENV] = str(path.resolve())
    public = public_key_text(key)

    return {"signing_public_key": public, "signing_key_id": key_id(base64.b64decode(public))}
