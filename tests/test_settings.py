"""kvcore.settings: the environment switches, parsed strictly in one place and read where a call begins."""

from __future__ import annotations

import pytest
import torch

from kvcore.plugins.paged_inputs import value_checks
from kvcore.settings import Settings, env_flag, env_names


@pytest.mark.parametrize("raw, parsed", [("1", True), (" TRUE ", True), ("yes", True), ("0", False), ("false", False),
                                         ("off", False), ("", None)])
def test_switches_parse_the_accepted_spellings(raw, parsed):
    assert env_flag("KVCORE_DEBUG_CHECKS", {"KVCORE_DEBUG_CHECKS": raw}) is parsed
    assert Settings.from_env({"KVCORE_DEBUG_CHECKS": raw}).debug_checks is parsed


@pytest.mark.parametrize("raw", ["abc", "2", "enabled", "-1"])
def test_a_bad_switch_names_the_variable_and_the_accepted_values(raw):
    with pytest.raises(ValueError, match=f"KVCORE_DEBUG_CHECKS='{raw}'.*0/1/true/false"):
        Settings.from_env({"KVCORE_DEBUG_CHECKS": raw})


@pytest.mark.parametrize("raw, on", [("1", True), ("true", True), ("0", False), ("", False), ("nonsense", False)])
def test_triton_interpret_is_read_as_triton_reads_it(raw, on):
    assert Settings.from_env({"TRITON_INTERPRET": raw}).triton_interpret is on
    assert Settings.from_env({}) == Settings(debug_checks=None, triton_interpret=False)


def test_names_lists_drop_blanks():
    assert env_names("KVCORE_PLUGINS", {"KVCORE_PLUGINS": " a, ,b ,"}) == {"a", "b"}
    assert env_names("KVCORE_PLUGINS", {"KVCORE_PLUGINS": " "}) is None


def test_value_checks_take_the_callers_settings_and_else_the_environment_now(monkeypatch):
    cpu, meta = torch.device("cpu"), torch.device("meta")
    monkeypatch.setenv("KVCORE_DEBUG_CHECKS", "1")
    assert value_checks(None, meta, Settings(debug_checks=False)) is False  # passed down: the environment is not read
    assert value_checks(None, meta) is True
    monkeypatch.setenv("KVCORE_DEBUG_CHECKS", "0")
    assert value_checks(None, cpu) is False  # a changed environment takes effect at the next call
    monkeypatch.setenv("KVCORE_DEBUG_CHECKS", "abc")
    with pytest.raises(ValueError, match="KVCORE_DEBUG_CHECKS"):
        value_checks(None, cpu)
    assert value_checks(True, cpu) is True  # an explicit argument wins without reading the environment
