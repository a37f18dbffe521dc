"""Options, settings and keys: validation and mapping (pure logic, no worker)."""

from __future__ import annotations

import decimal
import uuid

import enum

import pytest
from celery import Celery

from celery_zklock import ConfigurationError, ZkLockedTask, encode_key, lock_path
from celery_zklock.config import load_settings
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
    app = make_app()

    @app.task(base=ZkLockedTask, shared=False, **options)
    def buy(sku_id, qty=1):
        return qty

    with pytest.raises(ConfigurationError) as info:
        app.finalize()
    assert message in str(info.value)
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


def test_template_binds_defaults_positionals_and_kwargs():
    def buy(sku_id, qty=1, *, region="eu"):
        pass

    spec = compile_key(["sku:{sku_id}:{region}", "qty:{qty}"], buy, "t")
    assert spec.keys((7,), {}) == ["qty:1", "sku:7:eu"]
    assert spec.keys((), {"sku_id": 7, "region": "us", "qty": 3}) == ["qty:3", "sku:7:us"]


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
    ("Request", "celery_zklock.worker.worker_loss:LockAwareRequest"),
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
