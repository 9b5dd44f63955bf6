"""What one gateway process is configured with, each setting declared once: `kvgate serve` derives one flag per
field (kvgate/commands/flags.py), with its description, default and KVGATE_* variable in --help. Flags win over
variables, which win over these defaults; the lists (API keys, admin keys, models) take the flags and the variable
together."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BeforeValidator, ByteSize, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kvgate.producer.protocol import ProtocolError, check_model_name
from kvgate.producer.quotas import Quota, Quotas

if TYPE_CHECKING:
    from .auth import ApiKeys
    from .webhooks.targets import Targets


def _names(value: object) -> object:
    """KVGATE_API_KEYS=k1,k2 (and a flag given as k1,k2) is a list; blanks and repeats are dropped."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)):
        names = [n.strip() for v in value for n in (v.split(",") if isinstance(v, str) else [v])]
        return list(dict.fromkeys(n for n in names if n))
    return value


Names = Annotated[list[str], NoDecode, BeforeValidator(_names)]
ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^/?#\s]+$")


def _s(default, description: str, *flags: str, metavar: str | None = None, joined: bool = False,
       secret: bool = False, **constraints):
    """A field whose description is its --help text; `flags` replace the --field-name derived from its name;
    `joined`: a repeatable flag whose values add to the variable's instead of replacing them; `secret`: a value
    that messages never show (API keys)."""
    extra = {k: v for k, v in (("flags", list(flags)), ("metavar", metavar), ("joined", joined), ("secret", secret))
             if v}
    return Field(default, description=description, json_schema_extra=extra or None, **constraints)


class GatewaySettings(BaseSettings):
    # hide_input_in_errors: a bad setting's message never repeats what was given (API keys are among them)
    model_config = SettingsConfigDict(env_prefix="KVGATE_", extra="forbid", validate_assignment=True,
                                      hide_input_in_errors=True)

    redis_url: str | None = _s(None, "the fleet's Redis; unset: KVGATE_REDIS_URL, else the SDK's default")
    namespace: str = _s("kvgate", "key prefix shared by producers and workers")

    # where this process listens (kvgate serve; the app itself never reads them)
    host: str = _s("127.0.0.1", "address to bind")
    port: int = _s(8000, "port")
    log_level: str = _s("info", "uvicorn's log level")

    api_keys: Names = _s([], "accept `Authorization: Bearer KEY` for the tenant `default`, or with KEY=TENANT for "
                             "that tenant (its own files, batches and jobs); repeatable, comma-separated in the "
                             "variable; no key at all (and no keys file) leaves the gateway open", "--api-key",
                         metavar="KEY[=TENANT]", joined=True, secret=True)
    api_keys_file: str | None = _s(None, "a file of API keys, one KEY=TENANT (or a bare KEY: tenant `default`) a "
                                         "line, `#` comment lines and blank lines skipped; read at start, added to "
                                         "--api-key's", metavar="PATH")
    admin_keys: Names = _s([], "an API key that sees and manages every tenant's files and batches; repeatable",
                           "--admin-key", metavar="KEY", joined=True, secret=True)
    models: Names = _s([], "accept requests for this model even before any worker serves it (scale from zero); "
                           "repeatable. With none, the gateway accepts the models live workers serve and those the "
                           "fleet knows ({ns}:models); with some, only these and live ones", "--model", metavar="NAME",
                       joined=True)
    max_backlog: int | None = _s(None, "answer 429 to a request whose jobs would take the queue's waiting jobs past "
                                       "this many (400 to one of more jobs than that); unset: no limit", ge=1)
    tenant_max_jobs: int | None = _s(None, "per tenant, answer 429 while this many of its jobs are queued or running, "
                                           "counted in Redis across every replica; unset: no ceiling (a "
                                           "--quotas-file entry wins)", ge=1)
    tenant_tokens_per_minute: int | None = _s(None, "per tenant, answer 429 while its prompt plus generated tokens "
                                                    "over the last minute would pass this (estimated at admission, "
                                                    "corrected as jobs finish); unset: no ceiling", ge=1)
    quotas_file: str | None = _s(None, "a TOML file of tenant quotas: [default] and [tenants.NAME] tables of max_jobs "
                                       "and tokens_per_minute (docs/tenants/quotas.md); read at start", metavar="PATH")
    retry_after_s: int = _s(1, "seconds a 429's Retry-After asks clients to wait", "--retry-after")
    request_timeout_s: float = _s(600.0, "seconds before an unanswered job is cancelled (504); on a stream, the "
                                         "longest wait for the first token and between tokens, not the stream's "
                                         "length", "--request-timeout", gt=0)
    default_max_tokens: int = _s(512, "max_tokens when a request gives neither max_tokens nor max_completion_tokens",
                                 ge=1)
    max_n: int = _s(16, "most choices (n times prompts) in one request")
    models_cache_s: float = _s(2.0, "seconds the fleet snapshot (live workers' models, backlogs) is reused; one "
                                    "task reads the next while requests go on with the last")
    max_body_bytes: ByteSize = _s(8 * 1024 * 1024, "largest request body other than an upload (8MiB, 512KB or bytes): "
                                                   "a larger one is a 413, from its Content-Length or as it streams",
                                  "--max-body-size", ge=1024)
    max_prompt_token_ids: int = _s(131_072, "most prompt token ids in one request (n choices counted n times, "
                                            "embedding inputs summed): each is checked and encoded on the event "
                                            "loop (20 ms per 131,072 on a loaded machine)", ge=1)
    cors_origins: Names = _s([], "let browser pages from this origin (https://app.example, or * for any) call the "
                                 "API (CORS); repeatable; none: no CORS headers", "--cors-origin", metavar="ORIGIN",
                             joined=True)
    redis_pool_size: int = _s(100, "Redis connections this process holds for requests (the reply readers have their "
                                   "own); a request that finds them all in use waits for one, up to "
                                   "--request-timeout, instead of failing. On a Redis Cluster it is each node's "
                                   "bound, which redis.asyncio cannot wait on", ge=1)
    durability: Literal["primary", "replicated"] = _s(
        "primary", "replicated: a request is enqueued only once a replica holds it, resent across a failover "
                   "(RELIABILITY.md, Failover)")
    otel_endpoint: str | None = _s(None, "send a span per request over OTLP/HTTP to this OpenTelemetry collector "
                                         "(http://collector:4318), the jobs' traceparent under it; unset: the standard "
                                         "OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else no tracing (needs kvgate[tracing])")

    responses_ttl_s: int = _s(86_400, "seconds a stored response (/v1/responses, store=true: OpenAI's default) stays "
                                      "readable by its id, cancellable and continuable with previous_response_id",
                              "--responses-ttl", ge=1)

    # files and managed batches
    files_dir: str | None = _s(None, "where /v1/files and batch outputs are stored, in a folder per namespace "
                                     "(<dir>/<namespace>/); replicas must share it; unset: $XDG_DATA_HOME/kvgate/files "
                                     "or ~/.local/share/kvgate/files")
    max_file_bytes: int = _s(200 * 1024 * 1024, "largest upload to /v1/files, in bytes (OpenAI's batch limit)",
                             "--max-file-size", ge=1)
    batch_window: int = _s(256, "jobs of one batch queued or running at a time, per model: batches never flood the "
                                "fleet", ge=1)
    batch_priority: Literal["high", "normal", "low"] = _s("low", "queue for batch jobs, so interactive requests go "
                                                                 "first")
    batch_lease_s: float = _s(30.0, "seconds after which another replica resumes the batches of a replica that died",
                              "--batch-lease", gt=0)
    batch_poll_s: float = _s(1.0, "how often a replica looks for batches nobody drives, seconds", gt=0)
    batch_min_window_s: int = _s(3600, "for tests only: the shortest completion_window taken, seconds (1 hour, as "
                                       "real batches need; a test shortens it to watch a batch expire)", ge=1)
    file_min_expiry_s: int = _s(3600, "for tests only: the shortest expires_after / output_expires_after taken, "
                                      "seconds (1 hour, as OpenAI's)", ge=1)

    # webhooks (docs/webhooks.md)
    webhook_url: str | None = _s(None, "send batch.* and background response.* events here, signed with "
                                       "--webhook-secret (docs/webhooks.md); a tenant's own entry wins",
                                 metavar="URL")
    webhook_secret: str | None = _s(None, "the signing secret of --webhook-url: whsec_ and base64 of 16 to 64 random "
                                          "bytes", metavar="WHSEC", secret=True)
    webhooks_file: str | None = _s(None, "a TOML file of [tenants.NAME] tables, each a url and secret: that tenant's "
                                         "events go there instead; read and checked at start", metavar="PATH")
    webhook_allow_private: bool = _s(False, "let webhook URLs resolve to private, loopback or link-local addresses "
                                            "(receivers on premises, tests)")
    webhook_retry_s: float = _s(259_200.0, "seconds an undelivered event is retried (backing off) before it is "
                                           "counted failed (kvgate stats); 72 h, as OpenAI's", gt=0)
    webhook_backoff_s: float = _s(5.0, "seconds before the first retry, doubled each time up to an hour", gt=0)
    webhook_timeout_s: float = _s(10.0, "seconds a receiver has to answer one delivery (2xx) before it is retried",
                                  gt=0)
    webhook_poll_s: float = _s(1.0, "how often a gateway looks for due webhook events and ended background "
                                    "responses, seconds", gt=0)

    @model_validator(mode="after")
    def _keys(self) -> "GatewaySettings":
        self.api_key_table()  # a bad entry, a missing keys file or a key given twice fails the start
        self.quota_table()  # so does a bad quotas file
        self.webhook_targets()  # and a webhook URL refused, a bad secret or a bad webhooks file
        return self

    def webhook_targets(self) -> "Targets":
        """Each tenant's webhook receiver, every URL checked (resolved) now."""
        from .webhooks.targets import Listen, Target, Targets, check_secret, check_url, read_targets

        listen, private = Listen(self.host, self.port), self.webhook_allow_private
        default = None
        if (self.webhook_url is None) != (self.webhook_secret is None):
            raise ValueError("--webhook-url and --webhook-secret go together: give both (KVGATE_WEBHOOK_URL, "
                             "KVGATE_WEBHOOK_SECRET) or neither")
        if self.webhook_url is not None:
            default = Target(check_url(self.webhook_url, "--webhook-url", private, listen),
                             check_secret(self.webhook_secret, "--webhook-secret"))
        if self.webhooks_file is None:
            return Targets(default)
        return read_targets(self.webhooks_file, default, private, listen)

    def quota_table(self) -> Quotas | None:
        """Every tenant's quota: the file's, its [default] filled in from --tenant-max-jobs and
        --tenant-tokens-per-minute; None when no tenant has a ceiling."""
        default = Quota(max_jobs=self.tenant_max_jobs, tokens_per_minute=self.tenant_tokens_per_minute)
        quotas = Quotas(default=default) if self.quotas_file is None else Quotas.read(self.quotas_file, default)
        return None if quotas.unlimited else quotas

    def api_key_table(self) -> "ApiKeys":
        """Every API key's tenant and the admin keys, read afresh (the keys file too)."""
        from .auth import ApiKeys  # here: every `kvgate` command builds flags from this module, without a web stack

        return ApiKeys.of(self.api_keys, self.api_keys_file, self.admin_keys)

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        for origin in origins:
            if origin != "*" and not ORIGIN.match(origin):
                raise ValueError(f"CORS origin {origin!r} must be scheme://host[:port] with no path or trailing "
                                 "slash (as a browser sends it in Origin), or *")
        return origins

    @field_validator("models")
    @classmethod
    def _model_names(cls, names: list[str]) -> list[str]:
        try:
            return [check_model_name(n) for n in names]
        except ProtocolError as e:
            raise ValueError(str(e)) from None
