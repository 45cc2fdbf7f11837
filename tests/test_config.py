"""The typed settings (state/config.py): one frozen dataclass per section of
DEFAULTS, built once from the checked mapping."""
from __future__ import annotations

import dataclasses
import types
import typing

import pytest

from state import config as config_mod
from state.config import DEFAULTS, SECTIONS, ConfigError, load_config


def test_every_section_has_its_dataclass_with_the_same_settings():
    mappings = {name for name, value in DEFAULTS.items()
                if isinstance(value, dict) and name != "policies"}
    assert set(SECTIONS) == mappings
    for name, cls in SECTIONS.items():
        fields = [f.name for f in dataclasses.fields(cls)]
        assert fields == list(DEFAULTS[name]), name


def test_field_types_match_the_defaults():
    """The annotation of each setting admits its default (a bool is not an
    int here, as _merge has it)."""
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls, vars(config_mod))
        for key, default in DEFAULTS[name].items():
            hint = hints[key]
            union = typing.get_origin(hint) in (typing.Union, types.UnionType)
            allowed = typing.get_args(hint) if union else (hint,)
            origins = {typing.get_origin(a) or a for a in allowed}
            assert type(default) in origins, (name, key, hint, default)


def test_sections_are_read_typed_and_frozen(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("worker:\n  drain_timeout: 7\nserver:\n  allowed_hosts: [a.example]\n"
                    "policies:\n  news: {retrain_after_labels: 5}\n")
    cfg = load_config(str(path))
    assert cfg.worker.drain_timeout == 7.0 and isinstance(cfg.worker.drain_timeout, float)
    assert cfg.server.allowed_hosts == ["a.example"]
    assert cfg.policies == {"news": {"retrain_after_labels": 5}}
    assert cfg.log_format == "text" and cfg.worker.standby is True
    # the mapping a child process is handed says the same
    assert cfg.raw["worker"]["drain_timeout"] == cfg.worker.drain_timeout
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.worker.drain_timeout = 1.0  # type: ignore[misc]


def test_a_wrong_type_is_refused_before_any_section_is_built(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("worker:\n  drain_timeout: soon\n")
    with pytest.raises(ConfigError, match="worker.drain_timeout"):
        load_config(str(path))
