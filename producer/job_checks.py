"""The checks of a job's fields that a function states (a model or tenant name, a chat template's variables, metadata's
encoded size), and the error every wire check raises. The wire's Job declares them on its fields
(`fields.Checked`); the SDK runs the same functions, so both sides give one reason."""
from __future__ import annotations

import math
import re

import msgspec

from .limits import (MAX_METADATA_BYTES, MAX_MODEL_NAME_CHARS, MAX_TEMPLATE_KWARGS, MAX_TEMPLATE_VALUE_CHARS, RESERVED_TEMPLATE_KWARGS, TEMPLATE_KWARG_NAME, TENANT_NAME)

TemplateValue = str | int | float | bool | None
_encoder = msgspec.msgpack.Encoder()
TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


class ProtocolError(ValueError):
    """A payload that is not a valid message of this protocol."""


def check_model_name(name: object) -> str:
    """A model name as it appears in stream keys: `random:qwen2.5-0.5b` and `org/name` are fine; whitespace and
    braces and commas are not (braces would become Redis Cluster hash tags; heartbeats and
    KVGATE_MODEL_ALIASES list names with commas)."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_MODEL_NAME_CHARS:
        raise ProtocolError(f"model name {name!r} must be a string of 1 to {MAX_MODEL_NAME_CHARS} characters")
    if any(c.isspace() or c in "{}," for c in name) or not name.isprintable():
        raise ProtocolError(f"model name {name!r} must have no whitespace, braces, commas or control characters "
                            "(for example 'HuggingFaceTB/SmolLM2-135M-Instruct' or 'random:qwen2.5-0.5b')")
    return name


def check_tenant_name(name: object) -> str:
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        shown = repr(name) if not isinstance(name, str) or len(name) <= 80 else repr(name[:77] + "...")
        raise ProtocolError(f"tenant {shown} must be 1 to 64 letters, digits, '.', '_' or '-', starting with a "
                            "letter or digit (for example 'team-a')")
    return name


def check_template_kwargs(kwargs: dict[str, TemplateValue]) -> dict[str, TemplateValue]:
    """chat_template_kwargs a worker may render a template with: a few named scalars, none of apply_chat_template's
    own parameters; a template that still fails on them is an error result (engine.encode_chat)."""
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ProtocolError(f"chat_template_kwargs has {len(kwargs)} entries; at most {MAX_TEMPLATE_KWARGS} are "
                            "allowed")
    for name, value in kwargs.items():
        if not isinstance(name, str) or not TEMPLATE_KWARG_NAME.fullmatch(name) or name in RESERVED_TEMPLATE_KWARGS:
            raise ProtocolError(f"chat_template_kwargs key {str(name)[:80]!r} must be a template variable name (a "
                                "letter or '_', then up to 63 letters, digits or '_') other than apply_chat_template's "
                                f"own parameters ({', '.join(sorted(RESERVED_TEMPLATE_KWARGS))})")
        if isinstance(value, str) and len(value) > MAX_TEMPLATE_VALUE_CHARS:
            raise ProtocolError(f"chat_template_kwargs[{name!r}] has {len(value)} characters, over the limit of "
                                f"{MAX_TEMPLATE_VALUE_CHARS}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ProtocolError(f"chat_template_kwargs[{name!r}]={value} must be a finite number")
    return kwargs


def check_traceparent(value: object) -> str:
    """A W3C trace context `traceparent` (https://www.w3.org/TR/trace-context/): version 00 as
    `00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags>`, lowercase, neither id all zeros. A later version is
    taken by its first four parts as the recommendation says (version ff is invalid)."""
    if not isinstance(value, str) or not TRACEPARENT.fullmatch(value[:55]) or (value[:2] == "00" and len(value) != 55):
        shown = repr(value) if not isinstance(value, str) or len(value) <= 80 else repr(value[:77] + "...")
        raise ProtocolError(f"traceparent {shown} must be a W3C trace context: '00-' then 32 and 16 lowercase hex "
                            "digits and 2 of flags, joined by '-' (for example "
                            "'00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01')")
    if value[:2] == "ff" or value[3:35] == "0" * 32 or value[36:52] == "0" * 16 or value[55:56] not in ("", "-"):
        raise ProtocolError(f"traceparent {value[:80]!r} is not valid: version ff, an all-zero trace or span id, or "
                            "parts past the fourth not joined by '-'")
    return value


def check_metadata(metadata: dict[str, str]) -> dict[str, str]:
    if (size := len(_encoder.encode(metadata))) > MAX_METADATA_BYTES:
        raise ProtocolError(f"metadata is {size} bytes encoded, over the limit of {MAX_METADATA_BYTES}")
    return metadata
