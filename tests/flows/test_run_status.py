"""How the flow names the end of a run in MLflow (flows.grpo.cancelled): a stop -- Prefect's cancel, SIGTERM, Ctrl-C --
is KILLED, an error is FAILED. The e2e cancel test (tests/ops/test_cancel.py) checks it through a real deployment run;
this checks the cases that e2e run meets only by timing: the stop signal arriving as the context of an ordinary error
(a task's ``ray.get`` ended by it), a cancelled subflow's CancelledRun, and the runner's announced cancel intent."""
import pytest
from prefect.exceptions import CancelledRun, TerminationSignal

from flows.grpo import cancelled


def _raised(make):
    try:
        make()
    except BaseException as e:  # noqa: BLE001 - the test inspects what was raised
        return e
    raise AssertionError("nothing raised")


def test_stop_signals_are_cancels_and_errors_are_not():
    assert cancelled(TerminationSignal(15))
    assert cancelled(SystemExit(143))
    assert cancelled(KeyboardInterrupt())
    assert cancelled(CancelledRun("subflow cancelled"))
    assert not cancelled(RuntimeError("boom"))
    assert not cancelled(ValueError("bad batch"))


def test_an_error_raised_while_a_stop_signal_was_handled_is_a_cancel():
    def inner():
        try:
            raise TerminationSignal(15)
        except TerminationSignal:
            raise RuntimeError("ray.get interrupted")  # noqa: B904 - the implicit __context__ is what is tested

    def explicit():
        try:
            raise TerminationSignal(15)
        except TerminationSignal as e:
            raise RuntimeError("wrapped") from e

    assert cancelled(_raised(inner))
    assert cancelled(_raised(explicit))
    # an error chained to another error is still an error
    assert not cancelled(_raised(lambda: (_ for _ in ()).throw(ValueError("x"))))


def test_a_cycle_in_the_chain_ends(monkeypatch):
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert not cancelled(a)


def test_the_runners_cancel_intent_makes_any_error_a_cancel(monkeypatch):
    import prefect._internal.control_listener as cl

    monkeypatch.setattr(cl, "get_intent", lambda: "cancel")
    assert cancelled(RuntimeError("the wait ended while the runner cancels"))
    monkeypatch.setattr(cl, "get_intent", lambda: None)
    assert not cancelled(RuntimeError("a real error"))


@pytest.mark.parametrize("exc", [TerminationSignal(15), RuntimeError("x")])
def test_no_intent_api_falls_back_to_the_chain(monkeypatch, exc):
    import builtins

    real = builtins.__import__

    def no_listener(name, *a, **k):
        if name == "prefect._internal.control_listener":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_listener)
    assert cancelled(exc) is isinstance(exc, TerminationSignal)
