"""TLS, SASL and ACLs: checking the security settings and turning them into kazoo's terms.

Why a module of its own: exclusion is only as strong as the weakest client on the ensemble
(any client may delete a node whose parent's ACL lets it), and a credential must never leak
into a log, an error or a command line.  The checks here run at worker start (files exist
and are readable, option names are kazoo's), the same normal forms travel to the lock agent
and the reaper, and :func:`client_kwargs` is the one place they become kazoo arguments.

ACLs follow Curator's ``ACLProvider``: a default for every node we create, or a callable
``path -> list[ACL]``.  With credentials configured (digest or SASL) and no ``zklock_acl``,
our identity gets every right and anyone else may only READ: monitoring and ``celery zklock
status`` work with read-only credentials, but nobody else can delete or overwrite a lock
node (ZooKeeper checks DELETE on the parent: our containers carry the same ACL).
"""

from __future__ import annotations

import difflib
import importlib
import os
from typing import Any, Callable

from kazoo.security import ACL, ANYONE_ID_UNSAFE, Id, Permissions, make_digest_acl

#: kazoo's TLS options (``KazooClient(use_ssl=True, ...)``) accepted in ``zklock_use_ssl``.
TLS_OPTIONS = ("ca", "certfile", "keyfile", "keyfile_password", "verify_certs", "check_hostname")
_TLS_FILES = ("ca", "certfile", "keyfile")
#: kazoo's ``sasl_options`` keys (puresasl): the mechanism and its credentials.
SASL_OPTIONS = ("mechanism", "username", "password", "service", "host", "principal")
SASL_MECHANISMS = ("DIGEST-MD5", "GSSAPI")
#: Values never shown: in reprs, errors, events or ``celery inspect conf``.
SECRET_KEYS = ("keyfile_password", "password")


#: broker_use_ssl's (ssl.wrap_socket) names for kazoo's: users copy that setting's dict.
_TLS_ALIASES = {"ca_certs": "ca", "cafile": "ca", "cert_reqs": "verify_certs", "password": "keyfile_password"}


def _options(value: dict, known: tuple[str, ...], what: str) -> None:
    for key in value:
        if key not in known:
            close = [_TLS_ALIASES[key]] if key in _TLS_ALIASES and what == "TLS" else \
                difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown {what} option {key!r}.{hint} Known: {', '.join(known)}")


def check_use_ssl(value: Any) -> tuple | None:
    """False/None (plaintext), True (TLS, system CAs) or a dict of kazoo TLS options.

    Normal form: None, or a sorted tuple of (option, value) pairs (hashable, JSON-able)."""
    if value is None or value is False:
        return None
    if value is True:
        return ()
    if isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        value = dict(value)  # the normal form, back from JSON
    if not isinstance(value, dict):
        raise ValueError("must be True, False, or a dict of TLS options like {'ca': '/etc/zk/ca.pem', "
                         "'certfile': '/etc/zk/client.pem', 'keyfile': '/etc/zk/client.key'}")
    _options(value, TLS_OPTIONS, "TLS")
    for key in _TLS_FILES:
        path = value.get(key)
        if path is None:
            continue
        if not isinstance(path, str) or not path:
            raise ValueError(f"{key!r} must be a file path")
        if not os.path.isfile(path):
            raise ValueError(f"{key!r} file {path!r} does not exist")
        if not os.access(path, os.R_OK):
            raise ValueError(f"{key!r} file {path!r} is not readable by this user")
    if ("certfile" in value) != ("keyfile" in value) and "keyfile" in value:
        raise ValueError("'keyfile' needs its 'certfile'")
    for key in ("verify_certs", "check_hostname"):
        if key in value and not isinstance(value[key], bool):
            raise ValueError(f"{key!r} must be True or False")
    if "keyfile_password" in value and not isinstance(value["keyfile_password"], str):
        raise ValueError("'keyfile_password' must be a string")
    return tuple(sorted(value.items()))


def check_sasl_options(value: Any) -> tuple | None:
    """None, or kazoo's ``sasl_options`` dict, e.g. {'mechanism': 'DIGEST-MD5',
    'username': 'worker', 'password': '...'}; normal form like :func:`check_use_ssl`."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        value = dict(value)
    if not isinstance(value, dict):
        raise ValueError("must be None or a dict like {'mechanism': 'DIGEST-MD5', 'username': 'u', 'password': 'p'}")
    _options(value, SASL_OPTIONS, "SASL")
    try:
        import puresasl  # noqa: F401  (kazoo's SASL needs it)
    except ImportError:
        raise ValueError("SASL needs the pure-sasl package: pip install 'celery-zklock[sasl]'") from None
    mechanism = value.get("mechanism")
    if mechanism not in SASL_MECHANISMS:
        raise ValueError(f"'mechanism' must be one of {', '.join(SASL_MECHANISMS)}")
    if mechanism == "DIGEST-MD5" and not (value.get("username") and value.get("password")):
        raise ValueError("DIGEST-MD5 needs 'username' and 'password'")
    if not all(isinstance(v, str) for v in value.values()):
        raise ValueError("every SASL option is a string")
    return tuple(sorted(value.items()))


def check_acl(value: Any) -> tuple | str | None:
    """None (the default policy), a list of kazoo ACLs or (perms, scheme, id) triples, or a
    callable ``path -> list[ACL]`` (also as its ``"module:function"`` name: the worker's
    agent and reaper import it)."""
    if value is None:
        return None
    if callable(value):
        value = f"{value.__module__}:{value.__qualname__}"
    if isinstance(value, str):
        _import_provider(value)
        return value
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError("must be None, a non-empty list of kazoo ACLs, or a callable path -> list of ACLs")
    out = []
    for item in value:
        if isinstance(item, ACL):
            out.append((int(item.perms), item.id.scheme, item.id.id))
        elif (isinstance(item, (list, tuple)) and len(item) == 3 and isinstance(item[0], int)
              and not isinstance(item[0], bool) and 0 < item[0] <= Permissions.ALL
              and all(isinstance(x, str) for x in item[1:])):
            out.append((item[0], item[1], item[2]))
        else:
            raise ValueError(f"{item!r} is not an ACL: use kazoo.security.make_acl / make_digest_acl, "
                             "or (perms, scheme, id)")
    return tuple(out)


def _import_provider(name: str) -> Callable[[str], list]:
    module, _, attr = name.partition(":")
    try:
        fn = importlib.import_module(module)
        for part in attr.split("."):
            fn = getattr(fn, part)
    except Exception as exc:
        raise ValueError(f"cannot import the ACL provider {name!r} ({type(exc).__name__}: {exc}); it must be "
                         "an importable module-level function") from None
    if not callable(fn):
        raise ValueError(f"the ACL provider {name!r} is not callable")
    return fn


def default_acl(settings) -> list[ACL] | None:
    """The ACL of every node we create when ``zklock_acl`` is not a provider: the fixed list,
    or our identity with every right and anyone READ when we have credentials; None (kazoo's
    OPEN_ACL_UNSAFE) without credentials."""
    if isinstance(settings.acl, tuple):
        return [ACL(perms, Id(scheme, ident)) for perms, scheme, ident in settings.acl]
    if isinstance(settings.acl, str):
        return None
    ours = owner_acls(settings)
    if not ours:
        return None
    return ours + [ACL(Permissions.READ, ANYONE_ID_UNSAFE)]


def owner_acls(settings) -> list[ACL]:
    """Every right for the identities our credentials authenticate as."""
    out = []
    for scheme, credential in settings.auth_secret or ():
        if scheme == "digest" and ":" in credential:
            user, password = credential.split(":", 1)
            out.append(make_digest_acl(user, password, all=True))
    sasl = dict(settings.sasl_options or ())
    if sasl.get("username"):
        out.append(ACL(Permissions.ALL, Id("sasl", sasl["username"])))
    return out


def acl_provider(settings) -> Callable[[str], list] | None:
    """``zklock_acl``'s callable (Curator's ``ACLProvider.getAclForPath``), or None when a
    fixed default ACL applies."""
    return _import_provider(settings.acl) if isinstance(settings.acl, str) else None


def client_kwargs(settings) -> dict:
    """kazoo ``KazooClient`` arguments for TLS, SASL and the default ACL."""
    kwargs: dict = {"default_acl": default_acl(settings)}
    if settings.use_ssl is not None:
        kwargs["use_ssl"] = True
        tls = dict(settings.use_ssl)
        for key in TLS_OPTIONS:
            if key in tls:
                kwargs[key] = tls[key]
    if settings.sasl_options is not None:
        kwargs["sasl_options"] = dict(settings.sasl_options)
    return kwargs


def censored(value: Any) -> Any:
    """``value`` (a normal form of these settings) with every secret replaced by ``***``."""
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        return tuple((k, "***" if k in SECRET_KEYS else v) for k, v in value)
    return value


def tls_diagnosis(settings, timeout: float = 2.0) -> str | None:
    """Why a connection to the first ZooKeeper server fails at the TLS layer, naming the
    setting and the file to fix; None when TLS is not the problem (or cannot be told).

    Why: kazoo reports every TLS failure as a connection that never came up; an operator
    needs to know whether the CA, the client certificate or the key password is wrong, or
    whether one side speaks TLS and the other does not."""
    import socket
    import ssl

    first = settings.hosts.split("/", 1)[0].split(",")[0].strip()
    if first.startswith("["):  # [v6]:port
        host, _, rest = first[1:].partition("]")
        port = int(rest.lstrip(":") or 2181)
    else:
        host, _, port_s = first.partition(":")
        port = int(port_s or 2181)
    tls = dict(settings.use_ssl) if settings.use_ssl is not None else None
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None  # not reachable at all: the generic message says so
    with raw:
        if tls is None:
            # A plaintext client: does the server expect TLS?  (Speaking first in TLS is
            # harmless to a plaintext server: it drops a malformed request.)
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            speaks_tls = (f"the server at {host}:{port} speaks TLS: set zklock_use_ssl (with the ensemble's CA "
                          "and, if it requires one, a client certificate)")
            try:
                with context.wrap_socket(raw, server_hostname=host):
                    return speaks_tls
            except ssl.SSLError as exc:  # a TLS alert (e.g. "certificate required") is TLS too
                reason = (exc.reason or str(exc)).upper()
                return speaks_tls if any(w in reason for w in ("ALERT", "CERTIFICATE", "HANDSHAKE")) else None
            except OSError:
                return None
        context = ssl.create_default_context(cafile=tls.get("ca"))
        context.check_hostname = bool(tls.get("check_hostname", False))
        if not tls.get("verify_certs", True):
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        if tls.get("certfile"):
            try:
                context.load_cert_chain(tls["certfile"], tls.get("keyfile"), tls.get("keyfile_password"))
            except ssl.SSLError as exc:
                return (f"cannot load the client certificate zklock_use_ssl['certfile']={tls['certfile']!r} / "
                        f"['keyfile']={tls.get('keyfile')!r} ({exc.reason or exc}): wrong keyfile_password, or a "
                        "key that does not match the certificate")
        try:
            with context.wrap_socket(raw, server_hostname=host) as conn:
                conn.settimeout(0.5)
                try:
                    conn.recv(1)  # TLS 1.3: a rejected client certificate shows up on the first read
                except (socket.timeout, TimeoutError):
                    return None  # the handshake holds: TLS is not the problem
        except ssl.SSLCertVerificationError as exc:
            return (f"the server's certificate does not verify against zklock_use_ssl['ca']={tls.get('ca')!r} "
                    f"({exc.verify_message}): give the CA that signed the ensemble's certificates")
        except ssl.SSLError as exc:
            reason = (exc.reason or str(exc)).upper()
            if "CERTIFICATE_REQUIRED" in reason or (not tls.get("certfile") and (
                    "CERTIFICATE" in reason or "HANDSHAKE_FAILURE" in reason)):
                return ("the server requires a client certificate: set zklock_use_ssl['certfile'] and "
                        "zklock_use_ssl['keyfile']")
            if "UNKNOWN_CA" in reason or "BAD_CERTIFICATE" in reason or "CERTIFICATE_UNKNOWN" in reason:
                return (f"the server rejected the client certificate zklock_use_ssl['certfile']="
                        f"{tls.get('certfile')!r} ({exc.reason}): it is not signed by a CA the ensemble trusts")
            if any(w in reason for w in ("WRONG_VERSION_NUMBER", "RECORD_LAYER", "PACKET_LENGTH", "EOF")):
                return (f"the server at {host}:{port} does not speak TLS: point zklock_hosts at its "
                        "secureClientPort, or unset zklock_use_ssl")
            return f"TLS handshake with {host}:{port} failed ({exc.reason or exc}); check zklock_use_ssl"
        except OSError:
            return None
    return None


def auth_problem(client, settings) -> str | None:
    """After connecting: does the server refuse our session for want of (the right) SASL
    authentication?  A message naming ``zklock_sasl_options``, or None.

    Why a probe: ZooKeeper accepts the connection and only then closes a session that
    failed or lacks SASL, and kazoo keeps reconnecting; without this a worker would start,
    and every task would fail with a bare ConnectionLoss."""
    sasl = dict(settings.sasl_options or ())
    failed = False
    # With SASL, twice a moment apart (the server may close the session late); without,
    # once: every connect pays it, the reaper's on the critical path of a handoff.
    for attempt in range(2 if sasl else 1):
        try:
            client.exists_async("/").get(timeout=settings.connect_timeout)
        except Exception as exc:  # the session closed (AuthFailed, ConnectionLoss/Closed), or no reply
            if _SASL_REQUIRED is not None and isinstance(exc, _SASL_REQUIRED):
                return "the server requires SASL authentication: set zklock_sasl_options"
            failed = True
        if attempt == 0 and sasl:
            import time

            time.sleep(0.2)
    if sasl and (failed or not client.connected):
        return (f"it closed our session right after SASL {sasl.get('mechanism')} authentication as "
                f"{sasl.get('username')!r}: check zklock_sasl_options' username and password")
    if failed and _SASL_REQUIRED is None:
        return ("it closed our session at once; if the server requires SASL authentication, set "
                f"zklock_sasl_options (kazoo {_kazoo_version()} cannot tell that reply from others: "
                "kazoo >= 2.11 names it)")
    return None


def _sasl_required_error() -> type | None:
    """kazoo's exception for ZooKeeper's "session closed: SASL required" reply (-124), or None
    before kazoo 2.11, which has no name for that code: its reader then fails on the unknown
    code and the session just drops, so :func:`auth_problem` can only suggest SASL."""
    import kazoo.exceptions

    return getattr(kazoo.exceptions, "SessionClosedRequireSaslError", None)


def _kazoo_version() -> str:
    from importlib.metadata import version

    return version("kazoo")


_SASL_REQUIRED = _sasl_required_error()
