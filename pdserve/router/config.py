"""`RouterConfig`: the router's one frozen config and, field by field, its `pdserve router` flags
(pdserve/flags.py; cli/stack.py builds the command from it)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .. import env
from ..choices import Discovery, Policy, values
from ..flags import INTERNAL_TOKEN_HELP, option
from ..serving.auth import check_strength
from .instance_auth import check_entries, instance_url

POLICIES = values(Policy)
ADMIN_TOKEN_ENV = env.ADMIN_TOKEN.name
DISCOVERY = values(Discovery)
HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    prefill: tuple[str, ...] = option(  # instance base URLs, e.g. http://127.0.0.1:8100
        (),
        "Base URL of a prefill instance, e.g. http://127.0.0.1:8100; repeat for several.",
        cli_type=list[str],
        cli_default=[],
    )
    decode: tuple[str, ...] = option(
        (),
        "Base URL of a decode instance, e.g. http://127.0.0.1:8200; repeat for several.",
        cli_type=list[str],
        cli_default=[],
    )
    model: str = option(  # checkpoint directory: the router reads only its tokenizer files
        help="Checkpoint directory whose tokenizer and chat template the router uses. Default: the built-in small model.",
        cli_type=Optional[Path],
        cli_default=None,
    )
    served_model_name: str | None = option(  # the `model` clients must send; default: the directory's name
        None, "The model name clients send and /v1/models lists. Default: the checkpoint directory's name."
    )
    policy: str = option("round_robin", choices=Policy)
    cache_balance_threshold: int = option(
        4,
        "cache_aware: the best-matching instance is passed over for least_load's choice when its load (requests in flight + queued) exceeds the least loaded one's by more than this.",
        min=0,
    )
    host: str = option("127.0.0.1", "Address the OpenAI-compatible API listens on.")
    port: int = option(8000, "Port of the OpenAI-compatible API.")
    admin_token: str | None = option(  # None: the admin API answers 404 (disabled)
        None,
        "Bearer token of the /admin API (default: PDSERVE_ADMIN_TOKEN; at least 24 random characters); without one the admin API is disabled.",
        repr=False,
    )
    api_key: str | None = option(  # clients' bearer key on /v1/*; None: open
        None,
        'API key clients must send as `Authorization: Bearer KEY` on /v1/* and /metrics (default: $PDSERVE_API_KEY); its principal is named "default". Without any key the OpenAI API is open.',
        repr=False,
    )
    api_key_file: str | None = option(  # one `name:key` a line (router/tenants.py)
        None,
        "File of clients' API keys, one `name:key` a line (`#` comments and blank lines ignored; names of letters, digits, . _ -; keys of at least 16 characters, each name and key once). Each name is a principal with its own prefix-cache namespace; combines with --api-key.",
    )
    namespace_header: str | None = option(  # a trusted gateway's tenant; None: no header is read
        None,
        "Name of a request header set by a trusted gateway in front of the router whose value narrows the prefix-cache namespace (e.g. the gateway's tenant id); without this flag no header is read. It narrows the key's namespace, never reaches another key's.",
    )
    report_cached_tokens: bool = option(  # off: usage.prompt_tokens_details.cached_tokens is always 0
        False,
        "Report the prompt tokens the prefix cache served in usage.prompt_tokens_details.cached_tokens (off: always 0; a cache hit tells a client that someone sent that prefix before, within its own cache namespace only: docs/security.md).",
    )
    internal_token: str | None = option(  # sent to the instances (serving/auth.py)
        None, INTERNAL_TOKEN_HELP, repr=False
    )
    allowed_instance_hosts: tuple[str, ...] = option(  # /admin/add may register these hosts too
        (),
        "A host name, IP address or CIDR network (e.g. 10.0.0.0/8) whose instances /admin/add may register, or * for any; repeat for several. The hosts of --prefill / --decode and of discovered pods are always allowed; any other is refused before anything is sent to it.",
        cli_type=list[str],
        cli_default=[],
    )
    health_interval_s: float = option(
        2.0, "Seconds between health checks of every instance.", name="--health-interval"
    )
    max_attempts: int = option(  # tries of one request on different pairs, while no token reached the client
        3, "Tries of one request on different instance pairs while no token reached the client.", min=1
    )
    max_migrations: int = option(  # moves of one streaming request to another pair (migration.py)
        3,
        "Times one request may move to another instance pair when its decode instance fails after tokens reached the client (its stream breaks, its health check fails, or it lost the request): the request continues from the tokens already sent, and the client sees one unbroken stream. 0: such a failure ends the request with an error.",
        min=0,
    )
    migration_wait_s: float = option(  # how long a moving request waits for a usable pair
        30.0,
        "Seconds a request moving to another instance pair (--max-migrations) waits for a usable one when none is (e.g. its only decode instance restarting); its stream stays open meanwhile. After that it ends with an error event.",
        name="--migration-wait",
        min=0.0,
    )
    retry_backoff_s: float = 0.2  # doubled after every failed try
    request_timeout_s: float = option(  # deadline of a whole request (every try and wait included)
        600.0,
        "Deadline of one request, from arrival to its last token (every try and wait for room included); past it the client gets 504, or an error event once streaming began.",
        name="--request-timeout",
    )
    instance_timeout_s: float = option(  # longest silence from an instance before the try fails
        300.0,
        "Seconds an instance may stay silent before a try fails (and is retried elsewhere while no token was sent).",
        name="--instance-timeout",
    )
    connect_timeout_s: float = 5.0
    max_body_bytes: int = option(  # request bodies beyond this are refused (413) before parsing
        16 << 20, "Request bodies larger than this are refused with 413 before they are parsed.", min=1
    )
    max_prompt_bytes: int = option(  # prompt text beyond this is refused before tokenizing (400)
        8 << 20,
        "Prompt text (or chat message contents) larger than this many UTF-8 bytes is refused with 400 before it is tokenized.",
        min=1,
    )
    max_prompt_tokens: int = option(  # and prompts beyond this many tokens after it (400)
        1 << 20,
        "Prompts longer than this many tokens after tokenizing are refused with 400 (decode KV capacity is checked too).",
        min=1,
    )
    max_in_flight: int = option(  # requests of this router running on one instance at once
        64,
        "Requests of this router running on one instance at once; when every instance is full, requests wait for room.",
        min=1,
    )
    max_queue: int = option(  # requests waiting for an instance with room; beyond: 429
        256,
        "Requests that may wait for an instance with room; beyond that the router answers 429 with Retry-After.",
        min=1,
    )
    max_response_budget: int = option(  # n x max_tokens x (1 + top_logprobs) of a non-streamed answer
        1 << 20,
        "A request whose n x max_tokens x (1 + top_logprobs) exceeds this is served only with stream = true (else 400): a non-streamed answer is assembled whole in the router's memory.",
        min=1,
    )
    default_max_tokens: int = 16  # OpenAI's default for /v1/completions; chat uses it too
    discovery: str = option(  # "k8s": also the Ready pods matching `selector` (discovery.py)
        "static",
        "static: only the --prefill / --decode URLs; k8s: also the Ready pods that match --selector, added and removed as they come and go (labels: deploy/README.md).",
        choices=Discovery,
    )
    selector: str | None = option(  # label selector KEY=VALUE[,KEY=VALUE]
        None, "With --discovery k8s: the instances' pod label selector, KEY=VALUE[,KEY=VALUE]."
    )
    namespace: str | None = option(  # None: the pod's own namespace (service account), else "default"
        None, "With --discovery k8s: the pods' namespace (default: the router pod's own)."
    )
    k8s_api: str | None = option(  # None: the in-cluster API server
        None,
        "With --discovery k8s: the Kubernetes API base URL (default: the in-cluster API server with the pod's service account).",
    )

    def __post_init__(self):
        self.api_keys  # noqa: B018 -- read (and checked) now: a bad key file fails the start, not a request
        if self.namespace_header is not None and not HEADER_NAME.match(self.namespace_header):
            raise ValueError(f"--namespace-header must be an HTTP header name, got {self.namespace_header!r}")
        if self.admin_token is not None:
            check_strength(self.admin_token, "the admin token")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for role, urls in (("prefill", self.prefill), ("decode", self.decode)):
            for url in urls:
                try:
                    instance_url(url)
                except ValueError as e:
                    raise ValueError(f"{role}: {e}") from None
        check_entries(self.allowed_instance_hosts)
        urls = [u.rstrip("/") for u in self.prefill + self.decode]
        if len(set(urls)) < len(urls):
            raise ValueError("an instance URL is listed twice (each instance has one role)")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0, got {self.max_migrations}")
        if not self.migration_wait_s >= 0:
            raise ValueError(f"--migration-wait must be >= 0, got {self.migration_wait_s}")
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
        for name in (
            "max_body_bytes",
            "max_prompt_bytes",
            "max_prompt_tokens",
            "max_in_flight",
            "max_queue",
            "max_response_budget",
        ):
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

    def validate_model(self) -> None:
        """The check that needs the checkpoint directory (as the servers' configs: a config can be
        built, and `up` check what it passes on, before the model exists)."""
        if not (Path(self.model) / "tokenizer.json").is_file():
            raise ValueError(f"{self.model} has no tokenizer.json (the router needs the model's tokenizer)")

    @functools.cached_property
    def api_keys(self) -> dict[str, str] | None:
        """{key: principal name} of --api-key and --api-key-file (router/tenants.py); None: open. Not a
        field, so asdict (--check-config's output) never holds a key."""
        from .tenants import load_api_keys

        return load_api_keys(self.api_key, self.api_key_file)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    @staticmethod
    def token_from_env(token: str | None) -> str | None:
        """--admin-token wins over the environment variable; an empty value means no token."""
        return token or env.ADMIN_TOKEN.text()
