"""Task options: which names a ``ZkLockedTask`` understands, and checking them at registration.

Why a module: Celery silently keeps any decorator keyword as a class attribute, so a typo
such as ``lok_key=`` would leave a task unlocked without a word.  We reject names that look
like lock options but are not — and must never reject one of Celery's own task options
(``retry_backoff`` is one letter-run away from ``lock_retry_backoff``).  Celery's names are
derived from Celery itself, not listed by hand, so a new Celery option is accepted the day
it ships.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any

from . import config
from .errors import ConfigurationError

#: Lock options that are not settings (no ``zklock_*`` default): the key and the holders.
KEY_OPTIONS: dict[str, Any] = {"lock_key": None, "lock_max_holders": 1}

#: Every lock option a task understands (decorator kwargs / class attributes / annotations).
LOCK_OPTIONS: tuple[str, ...] = (*KEY_OPTIONS, *config.TASK_OPTIONS)

#: The class attributes of ZkLockedTask: None means "the zklock_* setting applies".
OPTION_DEFAULTS: dict[str, Any] = {**KEY_OPTIONS, **dict.fromkeys(config.TASK_OPTIONS)}

_LOCKISH_PREFIXES = ("lock_", "on_lock_", "zklock_")


def _words(name: str) -> str:
    """``name`` without the words ``lock`` and ``zklock``: ``on_lock_timeout`` -> ``on_timeout``,
    ``lock_on_timeout`` -> ``on_timeout``, ``zklock_timeout`` -> ``timeout``."""
    return "_".join(w for w in name.split("_") if w not in ("lock", "zklock"))


#: Each lock option by its words without ``lock`` (``key``, ``timeout``, ``on_timeout``,
#: ``max_holders``...): a name with the same words meant that option, whether the prefix was
#: left out (``key=``), put in the wrong place (``lock_on_timeout=``) or the setting's name
#: written (``zklock_on_timeout=``).
BARE_OPTIONS: dict[str, str] = {_words(o): o for o in LOCK_OPTIONS}

#: Bare names refused only beside lock options: single words a task may well use for an
#: attribute of its own (``timeout`` for the HTTP call its body makes).  ``key`` is one word
#: too, but ``key=`` on a ZkLockedTask is the lock's key left without its prefix, which made
#: the task one lock for every call: it is refused on any locked task, as are the compound
#: names (``on_timeout``, ``max_holders``, ``enqueue_until``...), which only a lock uses.
_OWN_WORDS = frozenset(b for b in BARE_OPTIONS if "_" not in b and b != "key")


def is_locked_task(task) -> bool:
    """A locked task, recognised by what it offers (its lock options and paths), so the
    worker-side modules never import the task class that installs them."""
    return callable(getattr(task, "lock_options", None)) and callable(getattr(task, "lock_paths", None))


class _AttributeRecorder:
    """Stands in for a task and records every attribute Celery reads from it."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        self.names.add(name)
        raise AttributeError(name)  # so Celery falls back to its own default


@functools.lru_cache(maxsize=1)
def celery_task_options() -> frozenset[str]:
    """Every name Celery itself reads as a task option, asked of Celery.

    * the attributes of :class:`celery.Task` (``acks_late``, ``max_retries``, ``Request``...);
    * what the decorator consumes (``bind``, ``base``, ``pydantic``...: the parameters of
      ``Celery._task_from_fun``);
    * what autoretry reads from the task (``autoretry_for``, ``retry_backoff``,
      ``retry_jitter``...): ``add_autoretry_behaviour`` is run on a recorder;
    * the publishing defaults a task may carry (``queue``, ``routing_key``, ``exchange``...):
      ``extract_exec_options`` is run on a recorder.
    """
    from celery import Celery, Task
    from celery.app.autoretry import add_autoretry_behaviour
    from celery.app.task import extract_exec_options

    names = set(dir(Task))
    names.update(p for p in inspect.signature(Celery._task_from_fun).parameters if p not in ("self", "fun", "options"))
    for reader in (add_autoretry_behaviour, extract_exec_options):
        recorder = _AttributeRecorder()
        reader(recorder)
        names.update(recorder.names)
    return frozenset(names)


#: What a keyword that shadows one of ZkLockedTask's methods most likely meant.
_MEANT = {"lock_keys": "lock_key", "lock_paths": "lock_key", "_lock_spec": "lock_key"}


def _is_routine(value: Any) -> bool:
    """A function, or what a class body makes of one (staticmethod, classmethod, property)."""
    return inspect.isroutine(value) or isinstance(value, (staticmethod, classmethod, property))


def own_attributes(base: type) -> dict[str, Any]:
    """The attributes ``base`` (ZkLockedTask) defines that
    :class:`celery.Task` does not, minus the lock options: its methods and internals."""
    from celery import Task

    celery_names = set(dir(Task))
    return {
        name: inspect.getattr_static(base, name)
        for name in dir(base)
        if name not in celery_names and name not in LOCK_OPTIONS and not name.startswith("__")
    }


def suggest_option(name: str, cutoff: float = 0.6) -> str | None:
    """The lock option ``name`` most likely meant, or None.

    The option with the same words without ``lock`` first (``on_timeout`` ->
    ``on_lock_timeout``, not the nearer spelling ``lock_timeout``); then the closest by
    spelling, comparing the names with and without their ``lock`` words (``on_lock_timout``
    -> ``on_lock_timeout``)."""
    if name in _MEANT:
        return _MEANT[name]
    if _words(name) in BARE_OPTIONS:
        return BARE_OPTIONS[_words(name)]
    best, score = None, cutoff
    for option in LOCK_OPTIONS:
        ratio = max(difflib.SequenceMatcher(None, name, option).ratio(),
                    difflib.SequenceMatcher(None, _words(name), _words(option)).ratio())
        if ratio >= score:
            best, score = option, ratio
    return best


def _own_method(cls: type, attr: str, value: Any) -> bool:
    """A method the class body defines (options are values; a method is the task's own)."""
    if isinstance(value, (staticmethod, classmethod, property)):
        return True
    return inspect.isfunction(value) and value.__qualname__ == f"{cls.__qualname__}.{attr}"


def _declares_lock_options(cls: type, base: type) -> bool:
    """Does ``cls``, or a class between it and ``base``, set a lock option?"""
    return any(o in vars(k) for k in cls.__mro__ if k is not base and issubclass(k, base) for o in LOCK_OPTIONS)


def check_option_names(cls: type, base: type, where: str) -> None:
    """Reject a class attribute that looks like a lock option but is none, or that would
    shadow one of ``base``'s (ZkLockedTask's) own methods or internals.

    Known: the lock options, Celery's own options, and the user's own attributes, as
    Celery allows — unless the name starts like a lock option, is a near miss of one, or is
    one without its ``lock_`` prefix (``key``, ``on_timeout``, ``max_holders``: see
    :data:`BARE_OPTIONS`): a typo that would silently change locking.  A one-word bare
    name (``timeout``, ``enqueue``, ``reentrant``) is refused only beside lock options (or
    another bare one): alone it may be the task's own attribute.  A method the class body
    defines is never taken for an option.

    The rule for a name ZkLockedTask defines and Celery's Task does not
    (``lock_keys``, ``lock_paths``, ``lock_options``, ``_locked_call``...): a function
    (or staticmethod, classmethod, property) replacing one of its methods is an override
    (``class MyTask(ZkLockedTask): def lock_keys(self, args, kwargs): ...``) and is kept;
    anything else is an error, since a decorator keyword such as ``lock_keys="x"`` would
    replace the method and fail every run (``'str' object is not callable``).  The
    internal data attributes (``_lock_spec``...) may not be set by a subclass at all.
    """
    known = celery_task_options()
    internals = own_attributes(base)
    unknown: list[str] = []  # refused whatever else the class sets
    own_words: list[str] = []  # refused beside lock options
    for attr, value in vars(cls).items():
        if attr in LOCK_OPTIONS or attr.startswith("__"):
            continue
        if attr in internals:
            mine = internals[attr]
            if _is_routine(mine) and _is_routine(value):
                continue  # an override of a method
            kind = "a method" if _is_routine(mine) else "an internal attribute"
            close = [_MEANT[attr]] if attr in _MEANT else difflib.get_close_matches(attr, LOCK_OPTIONS, n=1, cutoff=0.8)
            hint = f" did you mean {close[0]!r}?" if close else f" the lock options are: {', '.join(LOCK_OPTIONS)}."
            raise ConfigurationError(
                f"{where}: {attr} is {kind} of ZkLockedTask, not a lock option (a decorator keyword or class "
                f"attribute {attr}={value!r} would replace it);{hint}")
        if attr in known or hasattr(base, attr):
            continue
        if attr.startswith(_LOCKISH_PREFIXES):
            unknown.append(attr)
        elif _own_method(cls, attr, value):
            continue
        elif attr in _OWN_WORDS:
            own_words.append(attr)
        elif attr in BARE_OPTIONS or difflib.get_close_matches(attr, LOCK_OPTIONS, n=1, cutoff=0.8):
            unknown.append(attr)
    if own_words and (unknown or _declares_lock_options(cls, base)):
        unknown += own_words
    if unknown:
        raise ConfigurationError(_unknown_options(unknown, own_words, where))


def _unknown_options(names: list[str], own_words: list[str], where: str) -> str:
    """The error for lock options that are none: each with the option meant and what to write."""
    meant = {name: suggest_option(name, cutoff=0.8) for name in names}
    if len(names) == 1:
        name, option = names[0], meant[names[0]]
        said = f"unknown lock option {name!r}." + (f" Did you mean {option!r}?" if option else "")
    else:
        said = "unknown lock options " + ", ".join(
            f"{n!r}" + (f" (did you mean {meant[n]!r}?)" if meant[n] else "") for n in names) + "."
    fixes = [n for n in names if meant[n]]
    if fixes:
        said += (f" Write {', '.join(f'{meant[n]}=...' for n in fixes)} instead: Celery keeps "
                 f"{', '.join(f'{n}=' for n in fixes)} as {'a plain task attribute' if len(fixes) == 1 else 'plain task attributes'}, "
                 "which the lock ignores.")
    mine = [n for n in names if n in own_words]
    if mine:
        said += (f" (If {', '.join(mine)} {'is' if len(mine) == 1 else 'are'} the task's own attribute, rename "
                 f"{'it' if len(mine) == 1 else 'them'}: beside lock options, a lock option's name without its "
                 "lock_ prefix reads as a mistake.)")
    return f"{where}: {said} Known options: {', '.join(LOCK_OPTIONS)}"


def check_option_values(values: dict[str, Any], where: str) -> None:
    """Validate the lock options present in ``values`` with the settings' own checkers."""
    if "lock_max_holders" in values:
        v = values["lock_max_holders"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigurationError(f"{where}: lock_max_holders must be an int >= 1, got {v!r}")
    for option, setting in config.TASK_OPTIONS.items():
        v = values.get(option)
        if v is None:  # the setting applies
            continue
        config.check_setting(setting, v, f"{where}: option {option}")
