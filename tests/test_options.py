"""Options, settings and keys: validation and mapping (pure logic, no worker)."""

from __future__ import annotations

import decimal
import enum
import typing
import uuid

import pytest
from celery import Celery

from celery_zklock import ConfigurationError, ZkLockedTask, encode_key, lock_path
from celery_zklock.config import SETTINGS, ZkSettings, load_settings
from celery_zklock.keys import compile_key
from tests.versions import needs


def make_app(**conf):
    app = Celery("opts", broker="memory://", backend="cache+memory://")
    app.conf.update(conf)
    return app


@pytest.mark.parametrize(
    "options, message",
    [
        ({"lok_key": "x"}, "unknown lock option 'lok_key'. Did you mean 'lock_key'"),
        ({"lock_timout": 3}, "Did you mean 'lock_timeout'"),
        ({"lock_key": "sku:{sku}"}, "names {sku}, which is not a parameter"),
        ({"lock_key": "sku:{0}"}, "positional field"),
        ({"lock_key": "sku:{"}, "not a valid format string"),
        ({"lock_key": 42}, "must be a format string, a callable"),
        ({"lock_key": []}, "empty list"),
        ({"lock_max_holders": 0}, "lock_max_holders must be an int >= 1"),
        ({"on_lock_timeout": "wait"}, "on_lock_timeout: 'wait' is invalid: must be one of 'retry', 'skip', 'fail'"),
        ({"on_lock_lost": "ignore"}, "must be one of 'fail', 'interrupt'"),
        ({"lock_timeout": -1}, "lock_timeout: -1 is invalid"),
    ],
)
def test_bad_task_options_fail_at_registration(options, message):
    assert message in _registration_error(options)


def _registration_error(options: dict) -> str:
    """The ConfigurationError a locked task ``buy`` with ``options`` gets at registration."""
    app = make_app()

    @app.task(base=ZkLockedTask, shared=False, **options)
    def buy(sku_id, qty=1):
        return qty

    with pytest.raises(ConfigurationError) as info:
        app.finalize()
    return str(info.value)
    assert "opts.buy" in str(info.value) or "buy" in str(info.value)


@pytest.mark.parametrize(
    "conf, message",
    [
        ({"zklock_hosts": ""}, "zklock_hosts"),
        ({"zklock_hosts": "zk1:99999"}, "out of range"),
        ({"zklock_hosts": "zk 1:2181"}, "is not host[:port]"),
        ({"zklock_root": "locks"}, "absolute"),
        ({"zklock_session_timeout": 0}, "> 0"),
        ({"zklock_on_timeout": "later"}, "must be one of"),
        ({"zklock_host": "zk:2181"}, "unknown setting 'zklock_host'. Did you mean 'zklock_hosts'"),
        ({"zklock_release_on_worker_loss": "yes"}, "True or False"),
        ({"zklock_auth_secret": "user:pw"}, "(scheme, credential) pairs"),
        ({"zklock_auth_secret": [("digest",)]}, "is not a (scheme, credential) pair"),
    ],
)
def test_bad_settings_say_what_to_fix(conf, message):
    with pytest.raises(ConfigurationError, match=None) as info:
        load_settings(make_app(**conf).conf)
    assert message in str(info.value)


def test_good_settings_and_defaults():
    s = load_settings(make_app(zklock_hosts="a:2181,b:2181/chroot", zklock_timeout=None).conf)
    assert s.hosts == "a:2181,b:2181/chroot" and s.timeout is None and s.on_timeout == "retry"
    assert s.root == "/celery-zklock" and s.session_timeout == 10.0


def test_each_setting_is_typed_as_its_checker_returns():
    """A setting is declared once, as a ZkSettings field; its annotation (what a type checker
    reads) must be exactly what its checker returns: mypy holds the annotation only to a
    supertype of it, so a field typed wider than its checker is caught here."""
    fields = typing.get_type_hints(ZkSettings)
    assert list(fields) == [s.field for s in SETTINGS.values()]
    for name, s in SETTINGS.items():
        assert fields[s.field] == typing.get_type_hints(s.check)["return"], name
        assert getattr(ZkSettings(), s.field) == s.check(s.default), name


def test_template_binds_defaults_positionals_and_kwargs():
    def buy(sku_id, qty=1, *, region="eu"):
        pass

    spec = compile_key(["sku:{sku_id}:{region}", "qty:{qty}"], buy, "t")
    assert spec.keys((7,), {}) == ["qty:1", "sku:7:eu"]
    assert spec.keys((), {"sku_id": 7, "region": "us", "qty": 3}) == ["qty:3", "sku:7:us"]


def test_a_positional_field_is_refused_without_a_signature_too():
    """A template's ``{0}`` is a ConfigurationError naming the fix, also for a task whose
    function has no signature to suggest a parameter from (it was a TypeError)."""
    with pytest.raises(ConfigurationError, match=r"positional field \{0\}; name the parameter, e.g. \{sku_id\}"):
        compile_key("{0}", None, "t")


def test_keys_from_uuid_decimal_int_and_callables():
    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    spec = compile_key("o:{order}", lambda order: None, "t")
    assert spec.keys((u,), {}) == [f"o:{u}"]
    assert spec.keys((decimal.Decimal("1.500"),), {}) == ["o:1.5"]
    assert spec.keys((10,), {}) == ["o:10"]
    by_callable = compile_key(lambda a, b: [f"x:{a}", f"x:{b}"], lambda a, b: None, "t")
    assert by_callable.keys((2, 1), {}) == ["x:1", "x:2"]  # canonical order


def test_singleton_key_is_task_name():
    assert compile_key(None, lambda: None, "proj.tasks.report").keys((), {}) == ["proj.tasks.report"]


def test_key_to_znode_mapping_is_safe_and_deterministic():
    assert encode_key("sku:42") == "sku:42"
    assert encode_key("a/b") == "a%2Fb"
    assert encode_key("ü") == "%C3%BC"
    assert encode_key("..") == "%2E."
    assert encode_key("_c_x").startswith("%5F")
    long = encode_key("k" * 5000)
    assert len(long) <= 200 and long == encode_key("k" * 5000) and long != encode_key("k" * 4999)
    with pytest.raises(ConfigurationError, match="empty"):
        encode_key("")


def test_lock_path_helper_uses_root():
    app = make_app(zklock_root="/locks")
    assert lock_path("sku/1", app) == "/locks/sku%2F1"


def test_credentials_are_never_echoed():
    with pytest.raises(ConfigurationError) as info:
        load_settings(make_app(zklock_auth_secret=[("digest", "user:hunter2", "x")]).conf)
    assert "hunter2" not in str(info.value)
    s = load_settings(make_app(zklock_auth_secret=[("digest", "user:hunter2")]).conf)
    assert s.auth_secret == (("digest", "user:hunter2"),) and "hunter2" not in repr(s)
    # `celery report` / `inspect conf` print the censored configuration: the setting's name
    # must be one Celery masks.
    app = make_app(zklock_auth_secret=[("digest", "user:hunter2")])
    assert "hunter2" not in app.conf.humanize(censored=True)
    assert "hunter2" not in repr(app.conf.table(censored=True))


class _Opaque:  # no __str__: its text would be a memory address
    pass


class _AddressRepr:  # its own __repr__, still naming a memory address
    def __repr__(self) -> str:
        return f"<AddressRepr at {hex(id(self))}>"


@pytest.mark.parametrize(
    "value, message",
    [
        (None, "got None"),
        ([[1, 2]], "got a list"),  # a callable's flat list is several keys; nested is not
        ({"a": 1}, "got a dict"),
        (_Opaque(), "no stable text"),
        (_AddressRepr(), "no stable text"),
        ("x\udc80", "not valid Unicode"),
    ],
)
@pytest.mark.parametrize("source", ["template", "callable"])
def test_key_values_without_stable_text_are_errors(value, message, source):
    def buy(sku_id):
        pass

    spec = compile_key("sku:{sku_id}" if source == "template" else (lambda sku_id: sku_id), buy, "t.buy")
    with pytest.raises(ConfigurationError, match=message):
        spec.keys((value,), {})


def test_callable_returning_nested_or_no_keys_is_an_error():
    def buy(sku_id):
        pass

    with pytest.raises(ConfigurationError, match="got a list"):
        compile_key(lambda sku_id: [[sku_id]], buy, "t.buy").keys((1,), {})
    with pytest.raises(ConfigurationError, match="returned no key"):
        compile_key(lambda sku_id: [], buy, "t.buy").keys((1,), {})


class _Colour(str, enum.Enum):
    RED = "red"


class _Size(int, enum.Enum):
    BIG = 3


def test_enum_members_key_by_value_and_callable_iterables_are_several_keys():
    def buy(sku_id):
        pass

    template = compile_key("sku:{sku_id}", buy, "t.buy")
    assert template.keys((_Colour.RED,), {}) == ["sku:red"]
    assert template.keys((_Size.BIG,), {}) == ["sku:3"]
    many = compile_key(lambda sku_id: (f"sku:{i}" for i in sku_id), buy, "t.buy")
    assert many.keys(([2, 1],), {}) == ["sku:1", "sku:2"]
    assert compile_key(lambda sku_id: {"a": 1, "b": 2}.keys(), buy, "t.buy").keys((0,), {}) == ["a", "b"]
    with pytest.raises(ConfigurationError, match="got a generator"):
        template.keys(((x for x in "ab"),), {})


# Every option Celery documents for tasks ("Task options", "Automatic retry for known
# exceptions", "Routing"), with a value of the documented type.  Each must register on a
# ZkLockedTask unchanged, in decorator and in class form.
CELERY_TASK_OPTIONS = [
    ("name", "opts.named"),
    ("typing", False),
    ("max_retries", 5),
    ("throws", (KeyError,)),
    ("default_retry_delay", 10),
    ("rate_limit", "10/m"),
    ("time_limit", 30),
    ("soft_time_limit", 20),
    ("ignore_result", True),
    ("store_errors_even_if_ignored", True),
    ("serializer", "json"),
    ("compression", "zlib"),
    ("backend", None),
    ("acks_late", True),
    ("acks_on_failure_or_timeout", False),
    ("reject_on_worker_lost", True),
    ("track_started", True),
    ("trail", False),
    ("send_events", False),
    ("resultrepr_maxsize", 2048),
    ("priority", 5),
    ("expires", 60),
    ("queue", "high"),
    ("routing_key", "high.buy"),
    ("exchange", "orders"),
    ("delivery_mode", 2),
    ("autoretry_for", (ValueError,)),
    ("dont_autoretry_for", (TypeError,)),
    ("retry_kwargs", {"max_retries": 3}),
    ("retry_backoff", True),
    ("retry_backoff_max", 120),
    ("retry_jitter", False),
    ("Request", "celery_zklock.worker.worker_hooks:LockAwareRequest"),
]
DECORATOR_ONLY_OPTIONS = [("bind", True), ("shared", False), ("lazy", False), ("pydantic", False)]


# Celery itself warns that queue/routing_key/exchange/delivery_mode as task attributes are deprecated.
@pytest.mark.filterwarnings("ignore::celery.exceptions.CDeprecationWarning")
@pytest.mark.parametrize("option, value", CELERY_TASK_OPTIONS + DECORATOR_ONLY_OPTIONS)
def test_celery_task_option_registers_in_decorator_form(option, value):
    app = make_app()

    def buy(*args, sku_id=1, **kwargs):
        return sku_id

    decorator_kwargs = {"shared": False, option: value}
    task = app.task(base=ZkLockedTask, lock_key="sku:{sku_id}", lock_timeout=3, **decorator_kwargs)(buy)
    app.finalize()
    task = app.tasks[task.name]
    assert isinstance(task, ZkLockedTask)
    if option not in dict(DECORATOR_ONLY_OPTIONS):
        assert getattr(task, option) == value
    assert task.lock_options().timeout == 3


@pytest.mark.parametrize("option, value", CELERY_TASK_OPTIONS)
def test_celery_task_option_registers_in_class_form(option, value):
    cls = type("Buy", (ZkLockedTask,), {option: value, "lock_key": "sku:{sku_id}", "run": lambda self, sku_id: sku_id})
    assert getattr(cls, option) == value


def test_celery_options_are_derived_from_celery():
    from celery_zklock.options import celery_task_options

    known = celery_task_options()
    assert {name for name, _ in CELERY_TASK_OPTIONS} <= known
    assert {"bind", "base"} <= known  # what the decorator consumes itself
    assert not {"lock_key", "lok_key", "lock_retry_backof"} & known


@needs("the pydantic task option", celery=(5, 5))
def test_the_pydantic_option_is_derived_from_celery():
    from celery_zklock.options import celery_task_options

    assert "pydantic" in celery_task_options()  # consumed by the decorator itself, like bind


@pytest.mark.parametrize(
    "name, hint",
    [("lock_retry_backof", "lock_retry_backoff"), ("lock_retry_backof_max", "lock_retry_backoff_max"),
     ("on_lock_timout", "on_lock_timeout"), ("lock_max_holder", "lock_max_holders")],
)
def test_near_misses_of_lock_options_still_get_a_suggestion(name, hint):
    with pytest.raises(ConfigurationError, match=f"unknown lock option '{name}'. Did you mean '{hint}'"):
        type("Buy", (ZkLockedTask,), {name: 1, "run": lambda self: None})


def test_subclass_may_override_zklocked_task_methods():
    class Custom(ZkLockedTask):
        def lock_keys(self, args, kwargs):
            return ["custom"]

        def lock_paths(self, args, kwargs, settings=None):
            return super().lock_paths(args, kwargs, settings)

        def lock_options(self):
            return super().lock_options()

    assert Custom.lock_keys(None, (), {}) == ["custom"]


def test_user_attributes_unlike_lock_options_are_kept():
    cls = type("Buy", (ZkLockedTask,), {"my_flag": True, "run": lambda self: None})
    assert cls.my_flag is True


def _shadowable_names() -> list[str]:
    """Every public and private attribute name ZkLockedTask defines
    that celery.Task does not, minus the declared lock options (from dir(), not a list)."""
    from celery import Task

    from celery_zklock.options import LOCK_OPTIONS

    names = sorted(n for n in dir(ZkLockedTask) if n not in dir(Task) and n not in LOCK_OPTIONS and not n.startswith("__"))
    assert {"lock_keys", "lock_paths", "lock_options", "_locked_call", "_lock_spec"} <= set(names)
    return names


@pytest.mark.parametrize("name", _shadowable_names())
def test_a_keyword_shadowing_zklockedtask_is_refused_at_registration(name):
    app = make_app()

    @app.task(base=ZkLockedTask, shared=False, lock_key="order:{order_id}", **{name: "order:{order_id}"})
    def buy(order_id):
        return order_id

    with pytest.raises(ConfigurationError) as info:
        app.finalize()
    assert f"buy: {name} is " in str(info.value) and "of ZkLockedTask, not a lock option" in str(info.value)


@pytest.mark.parametrize("name", ["lock_keys", "lock_paths"])
def test_the_plural_says_what_was_meant(name):
    app = make_app()

    @app.task(base=ZkLockedTask, shared=False, **{name: "order:{order_id}"})
    def buy(order_id):
        return order_id

    with pytest.raises(ConfigurationError) as info:
        app.finalize()
    assert f"{name} is a method of ZkLockedTask, not a lock option" in str(info.value)
    assert "did you mean 'lock_key'?" in str(info.value)


def test_a_subclass_may_still_override_a_method():
    class PerTenant(ZkLockedTask):
        def lock_keys(self, args, kwargs):
            return [f"tenant:{kwargs['tenant']}"]

        @property
        def _retry(self):  # any routine replacing a routine is an override
            return ZkLockedTask._retry

    app = make_app()

    @app.task(base=PerTenant, shared=False)
    def sync(tenant):
        return tenant

    app.finalize()
    assert app.tasks[f"{__name__}.sync"].lock_keys((), {"tenant": "a"}) == ["tenant:a"]


def test_a_bad_key_field_names_the_parameters_at_registration():
    app = make_app()

    @app.task(base=ZkLockedTask, shared=False, lock_key="order:{order}")
    def place(order_id):
        return order_id

    with pytest.raises(ConfigurationError) as info:
        app.finalize()
    assert "names {order}, which is not a parameter" in str(info.value) and "order_id" in str(info.value)


# ------------------------------------------------------------------ issue 61, item 6
# A lock option written without its ``lock_`` prefix (``key=``, ``timeout=``), with the prefix
# misplaced (``lock_on_timeout=``) or under its setting's name (``zklock_timeout=``): Celery
# keeps it as a plain task attribute and the lock ignores it, so ``key="sku:{sku_id}"`` made
# one lock for every SKU.  Refused at registration, naming the option meant.
@pytest.mark.parametrize(
    "options, meant",
    [
        # the key, the holders and the policies: refused on any ZkLockedTask
        ({"key": "sku:{sku_id}"}, {"key": "lock_key"}),
        ({"key": lambda sku_id, qty=1: f"sku:{sku_id}"}, {"key": "lock_key"}),
        ({"max_holders": 2}, {"max_holders": "lock_max_holders"}),
        ({"on_timeout": "skip"}, {"on_timeout": "on_lock_timeout"}),
        ({"on_lost": "interrupt"}, {"on_lost": "on_lock_lost"}),
        ({"on_unavailable": "fail"}, {"on_unavailable": "on_lock_unavailable"}),
        ({"retry_countdown": 2}, {"retry_countdown": "lock_retry_countdown"}),
        ({"enqueue_until": "finish"}, {"enqueue_until": "lock_enqueue_until"}),
        # one-word names (a task may use ``timeout`` for itself): refused beside lock options (a task may use ``timeout`` for itself): refused beside lock options
        ({"lock_key": "sku:{sku_id}", "timeout": 5}, {"timeout": "lock_timeout"}),
        ({"lock_timeout": 5, "enqueue": "dedupe"}, {"enqueue": "lock_enqueue"}),
        ({"lock_key": "sku:{sku_id}", "enqueue_until": "finish"}, {"enqueue_until": "lock_enqueue_until"}),
        ({"lock_key": "sku:{sku_id}", "enqueue_unrun": "report"}, {"enqueue_unrun": "lock_enqueue_unrun"}),
        ({"lock_key": "sku:{sku_id}", "reentrant": False}, {"reentrant": "lock_reentrant"}),
        ({"lock_key": "sku:{sku_id}", "retry_countdown": 2}, {"retry_countdown": "lock_retry_countdown"}),
        ({"on_lock_timeout": "skip", "timeout": 0}, {"timeout": "lock_timeout"}),
        # both mistakes at once are both named
        ({"key": "sku:{sku_id}", "timeout": 5}, {"key": "lock_key", "timeout": "lock_timeout"}),
        # the prefix misplaced, or the setting's name used as the option's
        ({"lock_on_timeout": "skip"}, {"lock_on_timeout": "on_lock_timeout"}),
        ({"lock_on_lost": "interrupt"}, {"lock_on_lost": "on_lock_lost"}),
        ({"zklock_timeout": 5}, {"zklock_timeout": "lock_timeout"}),
        ({"zklock_on_timeout": "skip"}, {"zklock_on_timeout": "on_lock_timeout"}),
        ({"zklock_on_unavailable": "fail"}, {"zklock_on_unavailable": "on_lock_unavailable"}),
    ],
)
def test_an_option_without_its_lock_prefix_is_refused_with_the_option_meant(options, meant):
    message = _registration_error(options)
    assert "buy" in message
    for name, option in meant.items():
        assert f"{name!r}" in message and f"did you mean {option!r}" in message.lower(), message
        assert f"{option}=" in message, message  # what to write instead


def test_an_option_without_its_prefix_is_refused_in_class_form_and_beside_inherited_options():
    with pytest.raises(ConfigurationError, match="Did you mean 'lock_key'"):
        type("Buy", (ZkLockedTask,), {"key": "sku:{sku_id}", "run": lambda self, sku_id: sku_id})

    class PerSku(ZkLockedTask):  # an app's own base: the lock options live there
        lock_key = "sku:{sku_id}"

    app = make_app()

    @app.task(base=PerSku, shared=False, timeout=5)
    def buy(sku_id):
        return sku_id

    with pytest.raises(ConfigurationError, match="Did you mean 'lock_timeout'"):
        app.finalize()


@pytest.mark.parametrize(
    "attributes",
    [
        {"timeout": 30},  # a task's own attribute (an HTTP timeout its body reads): no lock option beside it
        {"enqueue": True},
        {"reentrant": "yes"},
        # Celery's own options, never a lock option's bare name
        {"lock_key": "sku:{sku_id}", "max_retries": 3, "retry_backoff": True, "retry_backoff_max": 60},
    ],
)
def test_a_tasks_own_attributes_are_kept(attributes):
    app = make_app()

    @app.task(base=ZkLockedTask, shared=False, **attributes)
    def buy(sku_id):
        return sku_id

    app.finalize()
    task = app.tasks[buy.name]
    for name, value in attributes.items():
        assert getattr(task, name) == value


def test_methods_named_like_bare_options_are_the_tasks_own():
    class Fetch(ZkLockedTask):
        lock_key = "url:{url}"
        lock_timeout = 5

        def run(self, url):
            return url

        def key(self):  # a method is never an option: options are values
            return "k"

        def on_timeout(self, soft, timeout):
            return None

        @property
        def timeout(self):
            return 30

    assert Fetch().key() == "k" and Fetch().timeout == 30


def test_a_plain_celery_task_may_use_any_name():
    app = make_app()

    @app.task(shared=False, key="sku", timeout=5, on_timeout="skip")
    def buy(sku_id):
        return sku_id

    app.finalize()
    assert app.tasks[buy.name].key == "sku"


def test_each_option_has_its_own_bare_name_and_four_are_words_a_task_may_use():
    from celery_zklock.options import _OWN_WORDS, BARE_OPTIONS, LOCK_OPTIONS

    assert sorted(BARE_OPTIONS.values()) == sorted(LOCK_OPTIONS)  # no two differ only by "lock"
    assert _OWN_WORDS == {"timeout", "enqueue", "reentrant", "mode"}


@pytest.mark.parametrize(
    "name, hint",
    [("on_timeout", "on_lock_timeout"), ("on_lost", "on_lock_lost"), ("lock_on_timeout", "on_lock_timeout"),
     ("zklock_on_timeout", "on_lock_timeout"), ("key", "lock_key"), ("zklock_timeout", "lock_timeout")],
)
def test_the_suggestion_is_the_option_meant_not_the_nearest_spelling(name, hint):
    from celery_zklock.options import suggest_option

    assert suggest_option(name) == hint


# ------------------------------------------------------------------ numbers in keys
class _Fraction:
    pass


@pytest.mark.parametrize(
    "value, text",
    [
        # equal numbers of different types lock one key
        (3, "3"),
        (3.0, "3"),
        (decimal.Decimal("3"), "3"),
        (decimal.Decimal("3.00"), "3"),
        (decimal.Decimal("3E+0"), "3"),
        (_Size.BIG, "3"),
        (0, "0"),
        (0.0, "0"),
        (-0.0, "0"),
        (decimal.Decimal("-0.00"), "0"),
        (-7, "-7"),
        (-7.0, "-7"),
        (1.5, "1.5"),
        (decimal.Decimal("1.50"), "1.5"),
        (2.0 ** 53, "9007199254740992"),
        (1e22, "10000000000000000000000"),
        (1e23, str(int(1e23))),  # the float's exact value, as int(1e23) == 1e23
        (1e-07, "0.0000001"),
        (decimal.Decimal("1E-7"), "0.0000001"),
        (decimal.Decimal("12345678901234567890.123456789"), "12345678901234567890.123456789"),  # > 28 digits: exact
        # ints and Decimals as before: their keys do not move
        (10, "10"),
        (10 ** 30 + 1, "1000000000000000000000000000001"),
        (decimal.Decimal("100"), "100"),
        (decimal.Decimal("1.500"), "1.5"),
        # bool is a flag, not a number: True stays "True" (JSON keeps true apart from 1)
        (True, "True"),
        (False, "False"),
    ],
)
def test_a_number_keys_by_its_value_whatever_its_type(value, text):
    def buy(sku_id):
        pass

    assert compile_key("sku:{sku_id}", buy, "t.buy").keys((value,), {}) == [f"sku:{text}"]
    assert compile_key(lambda sku_id: sku_id, buy, "t.buy").keys((value,), {}) == [text]


def test_buy_3_and_buy_3_point_0_lock_one_znode():
    app = make_app()

    @app.task(base=ZkLockedTask, shared=False, lock_key="sku:{sku_id}")
    def buy(sku_id):
        return sku_id

    app.finalize()
    task = app.tasks[buy.name]
    paths = {tuple(task.lock_paths(args, {})) for args in [(3,), (3.0,), (decimal.Decimal("3.0"),)]}
    assert paths == {("/celery-zklock/sku:3",)}


def test_other_number_types_key_like_the_builtin_ones():
    import fractions

    numpy = pytest.importorskip("numpy")

    def buy(sku_id):
        pass

    spec = compile_key("sku:{sku_id}", buy, "t.buy")
    for value, text in [(numpy.int64(3), "3"), (numpy.float64(3.0), "3"), (numpy.float32(3.0), "3"),
                        (numpy.float64(1.5), "1.5"), (numpy.float32(1.5), "1.5"), (fractions.Fraction(6, 2), "3"),
                        (fractions.Fraction(3, 2), "1.5"), (numpy.bool_(True), "True")]:
        assert spec.keys((value,), {}) == [f"sku:{text}"], (type(value), value)


def test_a_key_number_does_not_depend_on_the_decimal_context():
    def buy(sku_id):
        pass

    spec = compile_key("sku:{sku_id}", buy, "t.buy")
    with decimal.localcontext() as ctx:
        ctx.prec = 3
        assert spec.keys((decimal.Decimal("1.23456"),), {}) == ["sku:1.23456"]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), decimal.Decimal("NaN"),
                                   decimal.Decimal("sNaN"), decimal.Decimal("-Infinity")])
@pytest.mark.parametrize("source", ["template", "callable"])
def test_a_number_that_is_not_finite_is_no_key(value, source):
    def buy(sku_id):
        pass

    spec = compile_key("sku:{sku_id}" if source == "template" else (lambda sku_id: sku_id), buy, "t.buy")
    with pytest.raises(ConfigurationError, match="finite number"):
        spec.keys((value,), {})


# ------------------------------------------------------------------ "no limit", one spelling
@pytest.mark.parametrize(
    "make_error",
    [
        lambda: load_settings(make_app(zklock_timeout=-1).conf),
        lambda: type("Buy", (ZkLockedTask,), {"lock_timeout": -1, "run": lambda self: None}),
        lambda: type("Buy", (ZkLockedTask,), {"lock_timeout": "forever", "run": lambda self: None}),
    ],
    ids=["setting", "option", "option-str"],
)
def test_an_invalid_timeout_names_math_inf_for_no_limit(make_error):
    with pytest.raises(ConfigurationError) as info:
        make_error()
    message = str(info.value)
    assert "math.inf" in message and "None" not in message, message


def test_math_inf_is_no_limit_for_the_setting_and_the_option_and_none_still_works_for_the_setting():
    import math

    assert load_settings(make_app(zklock_timeout=math.inf).conf).timeout is None
    assert load_settings(make_app(zklock_timeout=None).conf).timeout is None  # accepted, not documented
    app = make_app(zklock_timeout=5)

    @app.task(base=ZkLockedTask, shared=False, lock_timeout=math.inf)
    def buy():
        return 1

    @app.task(base=ZkLockedTask, shared=False, lock_timeout=None)  # None: the setting applies
    def sell():
        return 1

    app.finalize()
    assert app.tasks[buy.name].lock_options().timeout is None
    assert app.tasks[sell.name].lock_options().timeout == 5
