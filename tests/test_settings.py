"""LIGER_* environment variables: every one parsed and validated in one place, with errors naming it."""

import os

import pytest
import torch

import liger_dispatch as ld
from liger_dispatch import dispatch, settings
from liger_dispatch.core import selection
from liger_dispatch.errors import BackendUnavailableError, ConfigError, FallbackWarning


@pytest.mark.parametrize("raw,on", [("0", False), ("false", False), ("No", False), ("OFF", False), ("", False),
                                    ("1", True), ("true", True), ("YES", True), ("on", True)])
def test_strict_accepts_the_usual_spellings(monkeypatch, raw, on):
    monkeypatch.setenv("LIGER_STRICT", raw)
    assert selection.strict() is on


@pytest.mark.parametrize("name,raw,accepts", [
    ("LIGER_STRICT", "maybe", "0/false/no/off or 1/true/yes/on"),
    ("LIGER_HELION_AUTOTUNE", "2", "0/false/no/off or 1/true/yes/on"),
    ("LIGER_CHUNK_ROWS", "abc", "a positive integer"),
    ("LIGER_CHUNK_ROWS", "0", "a positive integer"),
    ("LIGER_CHUNK_BUDGET_MB", "-1", "a positive number of MiB"),
    ("LIGER_CHUNK_BUDGET_MB", "nan", "a positive number of MiB"),
    ("LIGER_TUNED_TABLE", "/", "tuned-table files separated by"),
])
def test_a_bad_value_is_an_error_naming_the_variable_and_what_it_accepts(monkeypatch, name, raw, accepts):
    """Raised by the first call, before any backend runs (the fused-linear composition reads the chunk variables)."""
    monkeypatch.setenv(name, raw)
    x, w, y = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    with pytest.raises(ConfigError, match=f"{name}='{raw}' is not valid: expected .*{accepts}") as info:
        dispatch.op("flce", backend="reference")(x, w, y)
    assert isinstance(info.value, ld.LigerDispatchError) and isinstance(info.value, ValueError)


def test_values_are_parsed_once_per_raw_string_and_follow_changes(monkeypatch):
    monkeypatch.setenv("LIGER_CHUNK_ROWS", "3")
    assert settings.CHUNK_ROWS.get() == 3
    monkeypatch.setenv("LIGER_CHUNK_ROWS", "5")
    assert settings.CHUNK_ROWS.get() == 5
    monkeypatch.setenv("LIGER_CHUNK_BUDGET_MB", "0.5")
    assert settings.CHUNK_BUDGET_MB.get() == 0.5
    monkeypatch.delenv("LIGER_CHUNK_BUDGET_MB")
    assert settings.CHUNK_BUDGET_MB.get() == 512.0


def test_strict_false_is_off(monkeypatch):
    """LIGER_STRICT=false once turned strict mode on (anything but "0" was on)."""
    x, w, y = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    monkeypatch.setenv("LIGER_BACKEND", "cutedsl")
    monkeypatch.setenv("LIGER_STRICT", "false")
    with pytest.warns(FallbackWarning):
        dispatch.op("flce")(x, w, y)
    monkeypatch.setenv("LIGER_STRICT", "True")
    with pytest.raises(BackendUnavailableError, match="LIGER_STRICT is set"):
        dispatch.op("flce")(x, w, y)


def test_liger_checks_takes_device_or_full(monkeypatch):
    for raw, value in (("full", "full"), ("FULL", "full"), ("device", "device")):
        monkeypatch.setenv("LIGER_CHECKS", raw)
        assert settings.CHECKS.get() == value
    monkeypatch.setenv("LIGER_CHECKS", "paranoid")
    with pytest.raises(ConfigError, match="LIGER_CHECKS.*device .default. or full"):
        settings.CHECKS.get()


@pytest.mark.parametrize("before", [None, "245"])
def test_set_to_holds_a_value_for_the_block_then_restores_the_variable(monkeypatch, before):
    if before is None:
        monkeypatch.delenv("LIGER_CHUNK_BUDGET_MB", raising=False)
    else:
        monkeypatch.setenv("LIGER_CHUNK_BUDGET_MB", before)
    with pytest.raises(RuntimeError):
        with settings.CHUNK_BUDGET_MB.set_to("135"):
            assert settings.CHUNK_BUDGET_MB.get() == 135.0
            raise RuntimeError
    assert os.environ.get("LIGER_CHUNK_BUDGET_MB") == before
