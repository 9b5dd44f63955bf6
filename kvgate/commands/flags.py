"""Command-line flags derived from a settings model: one flag per field, with its description, default and
KVGATE_* variable in --help. Flags hold strings; the model parses and checks them, so a bad flag and a bad
environment variable get the same one-line message."""
from __future__ import annotations

import argparse
import os
import typing
from typing import Any, TypeVar

from pydantic import BaseModel, ByteSize, ValidationError
from pydantic.fields import FieldInfo

M = TypeVar("M", bound=BaseModel)

ENV_PREFIX = "KVGATE_"


def _extra(field: FieldInfo) -> dict:
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def flags_of(name: str, field: FieldInfo) -> list[str]:
    return list(_extra(field).get("flags") or [f"--{name.replace('_', '-')}"])


def joined(field: FieldInfo) -> bool:
    """A repeatable flag whose values add to its variable's (the gateway's API keys) instead of replacing them."""
    return bool(_extra(field).get("joined"))


def secret(field: FieldInfo) -> bool:
    """A value no message shows (the gateway's API keys)."""
    return bool(_extra(field).get("secret"))


def choices_of(field: FieldInfo) -> tuple[str, ...] | None:
    if typing.get_origin(field.annotation) is typing.Literal:
        return typing.get_args(field.annotation)
    return None


def metavar_of(field: FieldInfo) -> str:
    if _extra(field).get("metavar"):
        return _extra(field)["metavar"]
    choices = choices_of(field)
    if choices:
        return "{" + ",".join(choices) + "}"
    names = {typing.get_origin(a) or a for a in (field.annotation, *typing.get_args(field.annotation))}
    for kind, metavar in ((ByteSize, "SIZE"), (int, "N"), (float, "X")):
        if kind in names:
            return metavar
    return "TEXT"


def _help(name: str, field: FieldInfo) -> str:
    default = "unset" if field.default is None else str(field.default).replace("%", "%%")
    choices = choices_of(field)
    allowed = f"; one of {', '.join(choices)}" if choices else ""
    env = f"env {ENV_PREFIX}{name.upper()}" + (", comma-separated, joined with the flags" if joined(field) else "")
    return f"{field.description or ''}{allowed} ({env}; default {default})"


def add_settings_arguments(parser: argparse.ArgumentParser, model: type[BaseModel], skip: set[str]) -> None:
    group = parser.add_argument_group("settings (flags win over KVGATE_* variables, which win over defaults)")
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        flags, kwargs = flags_of(name, field), dict(dest=name, default=None, help=_help(name, field))
        if field.annotation is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **kwargs)
        elif typing.get_origin(field.annotation) is list:  # repeatable: --model-alias a --model-alias b
            group.add_argument(*flags, action="append", metavar=metavar_of(field), **kwargs)
        else:
            group.add_argument(*flags, metavar=metavar_of(field), **kwargs)


def given_settings(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    given = {name: getattr(args, name) for name in model.model_fields if getattr(args, name, None) is not None}
    for name, field in model.model_fields.items():
        if name in given and joined(field) and f"{ENV_PREFIX}{name.upper()}" in os.environ:
            given[name] = [*given[name], os.environ[f"{ENV_PREFIX}{name.upper()}"]]  # the model splits the commas
    return given


def settings_of(args: argparse.Namespace, model: type[M], error: type[ValueError] = ValueError) -> M:
    """The settings a command runs with: flags over KVGATE_* variables over defaults; a bad value raises `error`
    with one line naming it as the user set it."""
    given = given_settings(args, model)
    try:
        return model(**given)
    except ValidationError as e:
        raise error(explain(e, model, given)) from None


def explain(error: ValidationError, model: type[BaseModel], given: dict[str, Any]) -> str:
    """One line naming each bad setting as the user set it: the flag, the KVGATE_* variable, or the field."""
    problems = []
    for e in error.errors():
        name = str(e["loc"][0]) if e["loc"] else ""
        field = model.model_fields.get(name)
        shown = (lambda value: "***") if field is not None and secret(field) else repr
        if not name:  # a check of several settings together: its message names them
            source = ""
        elif name in given and field is not None:
            source = f"{flags_of(name, field)[0]} {shown(given[name])}"
        elif f"{ENV_PREFIX}{name.upper()}" in os.environ:
            source = f"{ENV_PREFIX}{name.upper()}={shown(os.environ[ENV_PREFIX + name.upper()])}"
        else:
            source = f"{name}={shown(e.get('input'))}"
        message = e["msg"].removeprefix("Value error, ")
        choices = choices_of(field) if field is not None else None
        if choices:
            message = f"not allowed; allowed values: {', '.join(choices)}"
        problems.append(f"{source}: {message[0].lower()}{message[1:]}" if source else message)
    return "; ".join(problems)


def setting_parser(name: str, model: type[BaseModel] | None = None):
    """An argparse `type` that checks one setting as the model does, for commands (the benchmarks) that take a
    few engine settings with workload defaults of their own."""
    if model is None:
        from kvgate.engine.config import EngineConfig as model

    def parse(text: str):
        try:
            return getattr(model(**{name: text}), name)
        except ValidationError as e:
            choices = choices_of(model.model_fields[name])
            message = f"allowed values: {', '.join(choices)}" if choices else e.errors()[0]["msg"]
            raise argparse.ArgumentTypeError(f"{text!r}: {message.removeprefix('Value error, ')}") from None

    parse.__name__ = name
    return parse
