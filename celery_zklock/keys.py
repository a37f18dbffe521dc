"""Lock keys: from a task's ``lock_key`` option and call arguments to znode paths.

Why here and checked early: a template naming a parameter the task does not have is a bug
that should stop the worker from starting, not a ``KeyError`` at 3 a.m.; and keys built
from UUIDs, Decimals or user input (``/``, unicode, megabytes) must map to valid,
deterministic znode names so every worker — and a Java service using Curator on the
documented path — agrees on the same lock.
"""

from __future__ import annotations

import hashlib
import inspect
import re
import string
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

from .errors import ConfigurationError

KeySource = Union[str, Callable[..., Any], None]

_SAFE = frozenset(string.ascii_letters + string.digits + "-_.:@=+,")
_MAX_NAME = 200  # bytes of encoded key kept readable before hashing the rest


def encode_key(key: str) -> str:
    """Map any key string to one znode name, deterministically and reversibly for short keys.

    Safe ASCII is kept (so ``sku:42`` stays ``sku:42`` for operators reading the tree);
    everything else, ``/`` included, is percent-encoded from UTF-8.  Names longer than
    200 characters keep a readable head and end with ``~`` and a SHA-256 of the whole key.
    A name that would be ``.``/``..`` or start with ``_c_`` (a lock node) is escaped.
    """
    if not isinstance(key, str):
        raise ConfigurationError(f"lock key must be a str, got {type(key).__name__}: {key!r}")
    if key == "":
        raise ConfigurationError("lock key is empty; give lock_key a template or callable that yields text")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigurationError(
            f"lock key {key!r} is not valid Unicode text (a lone surrogate?); keys must encode as UTF-8"
        ) from None
    out = []
    for ch in key:
        if ch in _SAFE:
            out.append(ch)
        else:
            out.append("".join(f"%{b:02X}" for b in ch.encode("utf-8")))
    name = "".join(out)
    if name in (".", "..") or name.startswith("_c_") or name.startswith("."):
        name = "%" + format(ord(name[0]), "02X") + name[1:]
    if len(name) > _MAX_NAME:
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        name = name[: _MAX_NAME - 66] + "~" + digest
    return name


def key_path(root: str, key: str) -> str:
    return f"{root.rstrip('/')}/{encode_key(key)}"


class _KeyFormatter(string.Formatter):
    """``str.format`` that renders values the way users expect in a key."""

    def format_field(self, value: Any, format_spec: str) -> str:
        if format_spec:
            return super().format_field(value, format_spec)
        return key_text(value, "lock_key template field")


def key_text(value: Any, where: str = "lock key") -> str:
    """Text of one value in a key: UUID canonical form, a number by its value
    (:func:`number_text`), bytes hex.

    Only values whose text is the same in every process are accepted.  ``None``, a
    container, or an object without its own ``__str__`` (its text would be its memory
    address) raise ConfigurationError: silently turning them into ``"None"`` or
    ``"<object at 0x7f..>"`` would serialize unrelated calls on one key, or let the
    same logical key map to different locks in different workers.
    """
    import decimal
    import enum
    import numbers
    import uuid

    if isinstance(value, enum.Enum):  # before str/int: a str- or int-mixin member is both
        return key_text(value.value, where)
    if isinstance(value, str):
        return str.__str__(value)  # a str subclass's own __str__ must not change the key
    if isinstance(value, bool):
        return str(value)  # a flag, not a number: "True", as JSON keeps true apart from 1
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (float, decimal.Decimal, numbers.Real)):
        return number_text(value, where)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    if value is None:
        raise ConfigurationError(f"{where}: got None; a key needs a value (did the call omit an argument?)")
    if isinstance(value, (Iterable, Iterator)):
        shown = repr(value) if isinstance(value, (list, tuple, set, frozenset, dict)) else "..."
        raise ConfigurationError(
            f"{where}: got a {type(value).__name__} ({shown}); key parts must be str, int, UUID, Decimal or bytes"
        )
    text = str(value)
    if (type(value).__str__ is object.__str__ and type(value).__repr__ is object.__repr__) or _ADDRESS.search(text):
        raise ConfigurationError(
            f"{where}: {type(value).__name__} object has no stable text (its text names a memory address); "
            f"return or format a str, int, UUID or Decimal instead"
        )
    return text


def number_text(value: Any, where: str = "lock key") -> str:
    """One text per number, whatever its type, so that equal numbers lock one key.

    ``3``, ``3.0``, ``Decimal("3.00")`` and ``numpy.int64(3)`` are all ``3`` (``buy(3)`` and
    ``buy(3.0)`` must not run side by side); ``1.5`` and ``Decimal("1.50")`` are ``1.5``: a
    float as its shortest text, a Decimal normalised, never in exponent form (``1e-07`` is
    ``0.0000001``), ``-0.0`` is ``0``.  A whole float keys by its exact value (``1e23`` as
    ``int(1e23)``, which equals it).  Another real type (numpy's floats, ``Fraction``) keys as
    the float it converts to.  Ints keep their text, and a Decimal's does not depend on the
    thread's decimal context.  NaN and infinities raise ConfigurationError: NaN equals
    nothing, not even itself.  ``bool`` is no number here (:func:`key_text`).
    """
    import decimal
    import numbers

    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return str(int(value))  # int and numpy's ints
    if isinstance(value, numbers.Rational) and value.denominator == 1:
        return str(int(value.numerator))  # a whole Fraction, exactly
    if isinstance(value, decimal.Decimal):
        d = value
    else:
        try:
            f = value if isinstance(value, float) else float(value)  # numpy's floats, Fraction
        except OverflowError:
            f = float("inf")
        d = decimal.Decimal(f) if f.is_integer() else decimal.Decimal(float.__repr__(f))
    if not d.is_finite():
        raise ConfigurationError(f"{where}: got {value!r}; a number in a key must be a finite number "
                                 f"(NaN equals nothing, not even itself)")
    if d.is_zero():
        return "0"
    exact = decimal.Context(prec=len(d.as_tuple().digits), Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
    return format(d.normalize(exact), "f")


#: ``<Foo object at 0x7f...>``: text that differs in every process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _as_key_values(value: Any) -> list[Any]:
    """What a lock_key callable returned, as a list of key values.

    Any iterable other than text/bytes/mapping is several keys (a list, a set, a
    generator, ``dict.keys()``); anything else is one key.
    """
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, (Iterable, Iterator)):
        return [value]
    return list(value)


_FORMATTER = _KeyFormatter()


@dataclass(frozen=True)
class KeySpec:
    """A compiled ``lock_key``: call :meth:`keys` with a task's args to get its lock keys."""

    parts: tuple[Any, ...]  # each a template str or a callable
    signature: inspect.Signature | None
    task_name: str

    def keys(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[str]:
        return sorted({key for _, key in self._rendered(args, kwargs)})

    def read_keys(self, args: Sequence[Any], kwargs: dict[str, Any], mode: Any) -> frozenset[str]:
        """The keys of this call taken for reading, by ``lock_mode`` (checked:
        ``config.check_lock_mode``): all or none for a mode, or the keys of the templates
        a ``{template: mode}`` names "read".  A key two templates render is read only if
        both read it: a write anywhere makes it a write."""
        if not isinstance(mode, Mapping):
            return frozenset(self.keys(args, kwargs)) if mode == "read" else frozenset()
        rendered = self._rendered(args, kwargs)
        written = {key for part, key in rendered if mode.get(part, "write") != "read"}
        return frozenset(key for _, key in rendered if key not in written)

    def _rendered(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[Any, str]]:
        """Each key with the ``lock_key`` part (template or callable) that rendered it."""
        if not self.parts:
            return [(None, self.task_name)]
        bound = None
        out = []
        for part in self.parts:
            if callable(part):
                value = part(*args, **kwargs)
                values = _as_key_values(value)
                if not values:
                    raise ConfigurationError(f"task {self.task_name}: lock_key callable {part!r} returned no key")
                for v in values:
                    out.append((part, key_text(v, f"task {self.task_name}: lock_key callable "
                                                   f"{getattr(part, '__name__', part)!r}")))
                continue
            if bound is None:
                bound = self._bind(args, kwargs)
            try:
                out.append((part, _FORMATTER.vformat(part, (), bound)))
            except ConfigurationError as exc:
                raise ConfigurationError(f"task {self.task_name}: lock_key {part!r}: {exc}") from None
            except (KeyError, AttributeError, IndexError, TypeError, ValueError) as exc:
                raise ConfigurationError(
                    f"task {self.task_name}: lock_key {part!r} could not be rendered from the call's "
                    f"arguments ({type(exc).__name__}: {exc})"
                ) from None
        for _, k in out:
            encode_key(k)  # raises on empty/non-text keys with a clear message
        return out

    def check_modes(self, mode: Any, max_holders: int, where: str) -> None:
        """Refuse at registration a ``lock_mode`` that cannot apply: a ``{template: mode}``
        naming a part ``lock_key`` does not have, or readers on a semaphore
        (``lock_max_holders`` > 1: a reader shares with every reader, not with N holders)."""
        named = list(mode) if isinstance(mode, Mapping) else []
        unknown = [t for t in named if t not in self.parts]
        if unknown:
            raise ConfigurationError(
                f"{where}: lock_mode names {', '.join(map(repr, unknown))}, which lock_key does not have "
                f"(its parts: {', '.join(map(repr, self.parts)) or 'none: the task name is the key'})")
        reads = mode == "read" or (isinstance(mode, Mapping) and "read" in mode.values())
        if reads and max_holders > 1:
            raise ConfigurationError(
                f"{where}: lock_mode reads, and lock_max_holders is {max_holders}: a reader shares the key with every "
                f"reader, so a semaphore of readers means nothing; use one or the other")

    def _bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.signature is None:
            return dict(kwargs)
        try:
            ba = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ConfigurationError(f"task {self.task_name}: arguments do not match its signature: {exc}") from None
        ba.apply_defaults()
        values = dict(ba.arguments)
        for p in self.signature.parameters.values():  # flatten **kwargs so templates may name them
            if p.kind is inspect.Parameter.VAR_KEYWORD and p.name in values:
                values.update(values.pop(p.name))
        return values


def compile_key(source: KeySource | Sequence[KeySource], fun: Callable | None, task_name: str) -> KeySpec:
    """Validate ``lock_key`` against the task function's signature; raise ConfigurationError."""
    signature = _signature(fun)
    if source is None:
        return KeySpec((), signature, task_name)
    sources = list(source) if isinstance(source, (list, tuple)) else [source]
    if not sources:
        raise ConfigurationError(f"task {task_name}: lock_key is an empty list; use None for a per-task singleton")
    params = _param_names(signature)
    for s in sources:
        if callable(s):
            continue
        if not isinstance(s, str):
            raise ConfigurationError(
                f"task {task_name}: lock_key must be a format string, a callable, a list of those, or None; "
                f"got {type(s).__name__}: {s!r}"
            )
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(s) if f is not None]
        except ValueError as exc:
            raise ConfigurationError(f"task {task_name}: lock_key {s!r} is not a valid format string: {exc}") from None
        for field in fields:
            root = field.split(".", 1)[0].split("[", 1)[0]
            if root == "" or root.isdigit():
                raise ConfigurationError(
                    f"task {task_name}: lock_key {s!r} uses a positional field {{{field}}}; name the parameter, "
                    f"e.g. {{{next(iter(params or ()), 'sku_id')}}}"
                )
            if params is not None and root not in params:
                raise ConfigurationError(
                    f"task {task_name}: lock_key {s!r} names {{{root}}}, which is not a parameter of the task "
                    f"(parameters: {', '.join(params) or 'none'})"
                )
    return KeySpec(tuple(sources), signature, task_name)


def _signature(fun: Callable | None) -> inspect.Signature | None:
    if fun is None:
        return None
    try:
        return inspect.signature(fun)
    except (TypeError, ValueError):
        return None


def _param_names(signature: inspect.Signature | None) -> list[str] | None:
    if signature is None:
        return None
    names = []
    for p in signature.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return None  # **kwargs: any name may arrive; checked at call time
        if p.kind is not inspect.Parameter.VAR_POSITIONAL:
            names.append(p.name)
    return names
