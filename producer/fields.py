"""The bounds of a request field, declared beside its type and default in the wire Struct.

`Sampling` (protocol.py) is the one declaration of every sampling field: `max_tokens: Annotated[int, Range(ge=1,
le=...)] = 256`. Everything else reads it through `specs`: the SDK's pydantic model (request.py) builds its fields
from it, the wire check (`problem`) runs on what a worker decodes, the gateway's body map lists its names, and a test
holds the engine's own `SamplingParams` to the same defaults and bounds. msgspec ignores this metadata when decoding,
so a worker's check of untrusted wire data stays its own step with messages that name the field and the value.
`Job` (protocol.py) declares its own submit-level fields (priority, deadline, model, tenant, ...) the same way, and the
SDK's submit arguments for them are built from that declaration too; whether a field counts in an idempotency digest
is a marker on it (NewerThanDigests, NotDigested), not a list kept beside it.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass
from collections.abc import Callable
from typing import Annotated, Any

import msgspec


@dataclass(frozen=True, slots=True)
class NewerThanDigests:
    """Marks a request field added after idempotency digests were first stored: a digest leaves it out while it holds
    its default, so a request that uses none of them digests as it always did (a resubmission across an upgrade is no
    conflict). A field added from now on carries it too."""


NEWER = NewerThanDigests()


@dataclass(frozen=True, slots=True)
class NotDigested:
    """Marks a request field that says how or for whom a request is sent, not what it asks: an idempotency digest
    always leaves it out (the key itself, a deadline, a prefix-affinity key, the tenant). A resubmission with a later
    deadline, or a batch line an upgraded gateway replica resubmits with its tenant, then reattaches to the job stored
    under its key instead of conflicting with it. Moving a field in or out changes stored digests: never do it."""


NOT_DIGESTED = NotDigested()


@dataclass(frozen=True, slots=True)
class Range:
    """A number's bounds. `off`: a value outside them that means "disabled" (top_k=-1); `says`: the rule as
    messages state it, where the interval alone would read worse."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    off: Any = None
    says: str = ""

    def holds(self, value: Any) -> bool:
        if self.off is not None and value == self.off:
            return True
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)  # NaN fails all
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def rule(self) -> str:
        if self.says:
            return self.says
        low = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else "(-inf"
        high = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else "inf)"
        return f"be in {low}, {high}"


@dataclass(frozen=True, slots=True)
class Items:
    """A list's bounds: at most `max_items`, each item within `item` (numbers) or of `chars` characters
    (strings). `too_many` and `bad_item` are the messages, formatted with n, max, item and head."""

    max_items: int
    too_many: str
    bad_item: str
    item: Range | None = None
    chars: tuple[int, int] | None = None

    def item_holds(self, item: Any) -> bool:
        if self.chars is not None:
            return self.chars[0] <= len(item) <= self.chars[1]
        return self.item is None or self.item.holds(item)


@dataclass(frozen=True, slots=True)
class Entries:
    """A mapping's bounds: at most `max_items` entries, each key within `key` and each value within `value`
    (logit_bias: token id -> bias). `too_many` and `bad_item` are the messages, formatted with n, max and item (the
    first bad entry as `key: value`)."""

    max_items: int
    too_many: str
    bad_item: str
    key: Range
    value: Range

    def item_holds(self, key: Any, value: Any) -> bool:
        return self.key.holds(key) and self.value.holds(value)


@dataclass(frozen=True, slots=True)
class Shape:
    """A structured value's bounds (a Struct with a `problem()` method that checks its parts and sizes):
    `max_chars` is its size limit, as messages and documentation state it."""

    max_chars: int


@dataclass(frozen=True, slots=True)
class Checked:
    """A value the wire checks with a function of its own (a model name, a tenant, chat_template_kwargs), which
    returns the value or raises ValueError (protocol's ProtocolError) naming the problem. `names` is how its messages
    begin, naming the field and value ("model name {value!r} "): the SDK drops it, as its errors name them apart."""

    check: Callable[[Any], Any]
    names: str

    def reason(self, message: str, value: Any) -> str:
        return message.removeprefix(self.names.format(value=value))


@dataclass(frozen=True, slots=True)
class Spec:
    """One field as the Struct declares it: its name, type (without the bounds), default and bounds."""

    name: str
    type: Any
    default: Any
    bounds: Range | Items | Entries | Shape | Checked | None
    newer_than_digests: bool = False  # marked NEWER: out of an idempotency digest while at its default
    digested: bool = True  # False: marked NOT_DIGESTED, always out of an idempotency digest

    @property
    def markers(self) -> tuple[Any, ...]:
        """Its digest markers, as the SDK's field for it carries them."""
        return (NEWER,) * self.newer_than_digests + (NOT_DIGESTED,) * (not self.digested)

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.type)

    def problem(self, value: Any) -> str | None:
        """What is wrong with `value` (decoded, so of the declared type), or None."""
        b = self.bounds
        if b is None or (value is None and self.optional):
            return None
        if isinstance(b, Range):
            return None if b.holds(value) else f"{self.name}={value} must {b.rule()}"
        if isinstance(b, Shape):
            return value.problem(b.max_chars)
        if isinstance(b, Checked):
            try:
                b.check(value)
            except ValueError as e:
                return str(e)
            return None
        if isinstance(b, Entries):
            if len(value) > b.max_items:
                return b.too_many.format(n=len(value), max=b.max_items, item=None)
            bad = next((f"{k}: {v}" for k, v in value.items() if not b.item_holds(k, v)), None)
            return None if bad is None else b.bad_item.format(n=len(value), max=b.max_items, item=bad)
        head = value[:8]
        if len(value) > b.max_items:
            return b.too_many.format(n=len(value), max=b.max_items, head=head, item=None)
        bad = next((item for item in value if not b.item_holds(item)), _NONE)
        if bad is not _NONE:
            return b.bad_item.format(n=len(value), max=b.max_items, head=head, item=repr(bad[:40]) if
                                     isinstance(bad, str) else bad)
        return None


_NONE = object()


def specs(struct: type[msgspec.Struct]) -> tuple[Spec, ...]:
    """The fields of a Struct in declaration order, with their bounds read from `Annotated[...]`."""
    hints = typing.get_type_hints(struct, include_extras=True)
    out = []
    for f in msgspec.structs.fields(struct):
        hint, meta = hints[f.name], []
        if typing.get_origin(hint) is Annotated:
            hint, *meta = typing.get_args(hint)
        bounds = next((m for m in meta if isinstance(m, (Range, Items, Entries, Shape, Checked))), None)
        default = f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()  # NODEFAULT: required
        out.append(Spec(f.name, hint, default, bounds, NEWER in meta, NOT_DIGESTED not in meta))
    return tuple(out)
