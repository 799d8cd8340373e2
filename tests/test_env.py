"""Every env var lives in tilecraft/env.py, and README.md's table is generated from it."""

import re
from pathlib import Path

import pytest

from tilecraft import env

REPO = Path(__file__).resolve().parents[1]


def test_readme_env_table_matches_env_module():
    readme = (REPO / "README.md").read_text()
    assert env.markdown_table() in readme, "README's env-var table is stale: paste tilecraft.env.markdown_table()"


def test_no_tilecraft_env_var_read_outside_env_module():
    offenders = []
    for path in REPO.rglob("*.py"):
        if "tests" in path.parts or path.name == "env.py" or ".venv" in str(path):
            continue
        for m in re.finditer(r"environ(?:\.get)?\(?\[?[\"'](TILECRAFT_\w+)", path.read_text()):
            offenders.append(f"{path.relative_to(REPO)}: {m.group(1)}")
    assert not offenders, offenders


def test_defaults(monkeypatch):
    monkeypatch.delenv("TILECRAFT_CACHE_DIR", raising=False)
    assert str(env.cache_dir()).endswith(".cache/tilecraft")
    monkeypatch.setenv("TILECRAFT_VERBOSE", "yes")
    assert env.flag("TILECRAFT_VERBOSE")


def test_set_takes_only_known_variables(monkeypatch):
    monkeypatch.setenv("TILECRAFT_CHECK_VALUES", "1")
    env.set("TILECRAFT_CHECK_VALUES", "0")
    assert not env.flag("TILECRAFT_CHECK_VALUES")
    with pytest.raises(KeyError):
        env.set("TILECRAFT_NO_SUCH_VARIABLE", "1")


def test_overridden_puts_the_value_back(monkeypatch):
    monkeypatch.setenv("TILECRAFT_VERBOSE", "1")
    with env.overridden("TILECRAFT_VERBOSE", "0"):
        assert not env.flag("TILECRAFT_VERBOSE")
    assert env.flag("TILECRAFT_VERBOSE")
    with pytest.raises(KeyError):
        with env.overridden("TILECRAFT_NO_SUCH_VARIABLE", "1"):
            pass
