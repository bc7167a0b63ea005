"""runners/interfaces.py: the decode round is written against TeacherRunnerLike / DrafterRunnerLike; the real runners
(and the numpy stand-ins tests/serving/test_round.py advances) must offer every member with the same parameters,
so a signature changed on one side fails here instead of at the first call of a rare path."""
from __future__ import annotations

import inspect
import typing

import pytest

from mindspore_eagle.runners import interfaces


def _members(proto) -> dict:
    """{name: inspect.Signature | "attribute"} of what a Protocol declares."""
    out = {n: "attribute" for n in typing.get_type_hints(proto)}
    for n, v in vars(proto).items():
        if inspect.isfunction(v) and not n.startswith("_"):
            out[n] = inspect.signature(v)
    return out


def _params(sig: inspect.Signature) -> list:
    return [(p.name, p.default) for p in sig.parameters.values()]


def _compatible(impl: inspect.Signature, proto: inspect.Signature) -> bool:
    """The implementation takes the protocol's parameters first (same names and defaults); whatever it adds has a
    default, so every call the round makes binds the same way."""
    a, b = _params(impl), _params(proto)
    return a[: len(b)] == b and all(d is not inspect.Parameter.empty for _, d in a[len(b):])


@pytest.mark.parametrize("proto, impl", [
    (interfaces.TeacherRunnerLike, "mindspore_eagle.runners.teacher.TeacherRunner"),
    (interfaces.DrafterRunnerLike, "mindspore_eagle.runners.drafter.DrafterRunner"),
])
def test_runner_offers_every_member_with_the_same_parameters(proto, impl):
    import importlib

    mod, name = impl.rsplit(".", 1)
    cls = getattr(importlib.import_module(mod), name)
    init_src = inspect.getsource(cls.__init__)
    members = _members(proto)
    assert len(members) >= 6
    for n, sig in members.items():
        if sig == "attribute":               # a plain attribute set in __init__, or a property
            assert isinstance(getattr(cls, n, None), property) or f"self.{n}" in init_src \
                or f", self.{n}" in init_src, f"{name} has no attribute {n}"
            continue
        got = getattr(cls, n, None)
        assert callable(got), f"{name}.{n} is missing"
        assert _compatible(inspect.signature(got), sig), f"{name}.{n}{inspect.signature(got)} does not take {sig}"


def test_a_changed_signature_is_caught():
    """The check itself: a class whose ``free`` takes another parameter name does not pass."""
    class Wrong:
        def free(self, seq_id: int) -> None:
            pass
    sig = _members(interfaces.TeacherRunnerLike)["free"]
    assert not _compatible(inspect.signature(Wrong.free), sig)

    class Extra:
        def free(self, sid: int, now: bool) -> None:      # an added parameter without a default
            pass
    assert not _compatible(inspect.signature(Extra.free), sig)
