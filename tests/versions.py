"""What the installed Celery, kombu and kazoo can do, for tests that need more than the
oldest versions pyproject.toml claims (``celery>=5.3``, ``kazoo>=2.9``; ``make matrix`` runs
the suite's subset on each, support/matrix.py).

A test that relies on a newer version's API is skipped on older ones with the reason,
never deleted::

    from tests.versions import needs

    @needs(kombu=(5, 6), what="QoS(max_prefetch=...)")
    def test_...(): ...

    pytest.param(..., marks=needs(celery=(5, 5), what="the pydantic task option"))

Every version predicate of the suite lives here, so that raising a floor later is a matter
of deleting the ones it makes always true.
"""

from __future__ import annotations

import re
from importlib.metadata import version as _dist_version

import pytest

__all__ = ["CELERY", "KAZOO", "KOMBU", "at_least", "installed", "needs"]

_NAMES = {"celery": "Celery", "kombu": "kombu", "kazoo": "kazoo"}


def installed(dist: str) -> tuple[int, ...]:
    """The installed version of ``dist`` as a tuple of ints (``5.6.0rc1`` -> ``(5, 6, 0)``)."""
    return tuple(int(n) for n in re.findall(r"\d+", _dist_version(dist).split("+")[0].split("rc")[0])[:3])


CELERY = installed("celery")
KOMBU = installed("kombu")
KAZOO = installed("kazoo")
_INSTALLED = {"celery": CELERY, "kombu": KOMBU, "kazoo": KAZOO}


def at_least(**minimums: tuple[int, ...]) -> bool:
    """True when every named distribution is at least its version: ``at_least(kombu=(5, 6))``."""
    return all(_INSTALLED[dist] >= tuple(v) for dist, v in minimums.items())


def needs(what: str, **minimums: tuple[int, ...]) -> pytest.MarkDecorator:
    """A ``skipif`` marker: skip unless every named distribution is at least its version.

    ``what`` names the feature the test needs, so that the skip reason says which version
    brought it: ``needs("QoS(max_prefetch=...)", kombu=(5, 6))`` skips on kombu 5.5 with
    "needs kombu >= 5.6 (installed 5.5.4): QoS(max_prefetch=...)".
    """
    unknown = set(minimums) - set(_INSTALLED)
    if unknown or not minimums:
        raise TypeError(f"needs(): name one or more of {sorted(_INSTALLED)}, not {sorted(unknown) or 'none'}")
    short = [(d, tuple(v)) for d, v in minimums.items() if _INSTALLED[d] < tuple(v)]
    reason = "; ".join(f"needs {_NAMES[d]} >= {'.'.join(map(str, v))} (installed {'.'.join(map(str, _INSTALLED[d]))})"
                       for d, v in short)
    return pytest.mark.skipif(bool(short), reason=f"{reason}: {what}" if short else what)
