"""`RouterConfig`: the router's one frozen config, parsed from the CLI in one place (cli.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.auth import check_strength

POLICIES = ("round_robin", "least_load")
ADMIN_TOKEN_ENV = "PDSERVE_ADMIN_TOKEN"
DISCOVERY = ("static", "k8s")


@dataclass(frozen=True)
class RouterConfig:
    model: str  # checkpoint directory: the router reads only its tokenizer files
    prefill: tuple[str, ...] = ()  # instance base URLs, e.g. http://127.0.0.1:8100
    decode: tuple[str, ...] = ()
    policy: str = "round_robin"
    served_model_name: str | None = None  # the `model` clients must send; default: the directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    admin_token: str | None = field(default=None, repr=False)  # None: the admin API answers 404 (disabled)
    api_key: str | None = field(default=None, repr=False)  # clients' bearer key on /v1/*; None: open
    internal_token: str | None = field(default=None, repr=False)  # sent to the instances (engine/auth.py)
    health_interval_s: float = 2.0
    max_attempts: int = 3  # tries of one request on different pairs, while no token reached the client
    retry_backoff_s: float = 0.2  # doubled after every failed try
    request_timeout_s: float = 600.0  # deadline of a whole request (every try and wait included)
    instance_timeout_s: float = 300.0  # longest silence from an instance before the try fails
    connect_timeout_s: float = 5.0
    max_body_bytes: int = 16 << 20  # request bodies beyond this are refused (413) before parsing
    max_prompt_bytes: int = 8 << 20  # prompt text beyond this is refused before tokenizing (400)
    max_prompt_tokens: int = 1 << 20  # and prompts beyond this many tokens after it (400)
    max_in_flight: int = 64  # requests of this router running on one instance at once
    max_queue: int = 256  # requests waiting for an instance with room; beyond: 429
    default_max_tokens: int = 16  # OpenAI's default for /v1/completions; chat uses it too
    discovery: str = "static"  # "k8s": also the Ready pods matching `selector` (discovery.py)
    selector: str | None = None  # label selector KEY=VALUE[,KEY=VALUE]
    namespace: str | None = None  # None: the pod's own namespace (service account), else "default"
    k8s_api: str | None = None  # None: the in-cluster API server

    def __post_init__(self):
        if self.admin_token is not None:
            check_strength(self.admin_token, "the admin token")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for role, urls in (("prefill", self.prefill), ("decode", self.decode)):
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"{role} instance URL must start with http:// or https://, got {url!r}")
        urls = [u.rstrip("/") for u in self.prefill + self.decode]
        if len(set(urls)) < len(urls):
            raise ValueError("an instance URL is listed twice (each instance has one role)")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if (
            min(
                self.health_interval_s,
                self.request_timeout_s,
                self.instance_timeout_s,
                self.connect_timeout_s,
            )
            <= 0
        ):
            raise ValueError("health interval and timeouts must be > 0")
        for name in ("max_body_bytes", "max_prompt_bytes", "max_prompt_tokens", "max_in_flight", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.discovery not in DISCOVERY:
            raise ValueError(f"discovery must be one of {', '.join(DISCOVERY)}, got {self.discovery!r}")
        if self.discovery == "k8s":
            from .discovery import parse_selector

            if not self.selector:
                raise ValueError("--discovery k8s needs --selector KEY=VALUE (the instances' pod labels)")
            parse_selector(self.selector)
            if self.k8s_api is not None and not self.k8s_api.startswith(("http://", "https://")):
                raise ValueError(f"--k8s-api must start with http:// or https://, got {self.k8s_api!r}")
        elif self.selector or self.namespace or self.k8s_api:
            raise ValueError("--selector, --namespace and --k8s-api need --discovery k8s")
        if not (Path(self.model) / "tokenizer.json").is_file():
            raise ValueError(f"{self.model} has no tokenizer.json (the router needs the model's tokenizer)")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    @staticmethod
    def token_from_env(token: str | None) -> str | None:
        """--admin-token wins over the environment variable; an empty value means no token."""
        return token or os.environ.get(ADMIN_TOKEN_ENV) or None
