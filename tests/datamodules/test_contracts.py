"""The contracts table (datamodules/contracts.py) says what each data module is, without importing it: each
module's ``__init__`` takes exactly the declared options (and shared keys) with the declared defaults, its class
attributes agree with its contract, and every option's check refuses what its type and range exclude."""

from __future__ import annotations

import inspect
import typing

import pytest

from datamodules import DATAMODULES
from datamodules.contracts import CONTRACTS, INT_MAX, Option

SHARED = {"data_dir", "batch_size", "num_workers", "seed"}
LENGTH = {"max_length", "pad_to_multiple"}


@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_each_data_module_takes_exactly_its_declared_options(name):
    contract, cls = CONTRACTS[name], DATAMODULES[name]
    params = {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}
    expected = set(contract.options) | SHARED | (LENGTH if contract.takes_length else set())
    assert set(params) == expected, (name, sorted(set(params) ^ expected))
    for key, option in contract.options.items():
        default = params[key].default
        if option.kind == "path" and isinstance(default, str):
            assert default.endswith(str(option.default).replace("<repository>/", "")), (name, key)
            continue
        want = option.default if not isinstance(option.default, tuple) else tuple(option.default)
        got = tuple(default) if isinstance(default, (list, tuple)) else default
        assert got == want, (name, key, got, want)
        assert option.problem(default) is None, (name, key, default)


@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_class_attributes_agree_with_the_contract(name):
    contract, cls = CONTRACTS[name], DATAMODULES[name]
    assert cls.task == contract.task
    assert getattr(cls, "input_type", "token") == contract.input_type
    assert bool(getattr(cls, "is_retrieval", False)) == contract.dual_input
    fixed = getattr(cls, "num_classes", None)
    assert (fixed if isinstance(fixed, int) else None) == contract.num_classes
    assert getattr(cls, "default_max_length", None) == contract.default_max_length


def test_hints_of_numeric_options_match_their_kind():
    for name, contract in CONTRACTS.items():
        hints = typing.get_type_hints(DATAMODULES[name].__init__)
        for key, option in contract.options.items():
            hint = str(hints[key])
            if option.kind == "int":
                assert "int" in hint, (name, key, hint)
            if option.kind == "float":
                assert "float" in hint, (name, key, hint)


@pytest.mark.parametrize(
    ("option", "value", "ok"),
    [
        (Option("int", 1, low=1), "abc", False),
        (Option("int", 1, low=1), [1, 2], False),
        (Option("int", 1, low=1), -5, False),
        (Option("int", 1, low=1), 2.5, False),
        (Option("int", 1, low=1), True, False),
        (Option("int", 1, low=1), INT_MAX + 1, False),
        (Option("int", 1, low=1), 4096, True),
        (Option("int", None, low=1, none=True), None, True),
        (Option("int", 1, low=1), None, False),
        (Option("float", 0.1, low=0.0, high=1.0, low_open=True), 0.0, False),
        (Option("float", 0.1, low=0.0, high=1.0), float("nan"), False),
        (Option("str", "a", choices=("a", "b")), "c", False),
        (Option("bool", True), "yes", False),
        (Option("strs", ("*",)), ["a", 1], False),
        (Option("strs", ("*",)), "*.jsonl", True),
        (Option("ints", (1, 1, 1), low=1, length=3), [5, 5], False),
        (Option("ints", (1, 1, 1), low=1, length=3), [5, 5, 5], True),
    ],
)
def test_an_option_refuses_what_its_declaration_excludes(option, value, ok):
    problem = option.problem(value)
    assert (problem is None) == ok, (value, problem)
    if not ok:
        assert problem == option.expected()
