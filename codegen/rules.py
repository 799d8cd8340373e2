"""The lowering-rule registry: which TileLang each tile word becomes on each target.

A rule is registered for a word and a target pattern: a canonical target name
("cuda:sm_90a"), a vendor ("cuda", "ascend", "cpu") or "*" (any target). Lookup takes the most
specific match: exact target, then vendor, then "*". Kernel authors add rules for a new chip or a
new word from their own module, without touching op files:

    from codegen import rules

    @rules.register("row_reduce", "cuda:sm_100a", replace=True)
    def my_reduce(src, dst, op="sum", dim=-1, clear=True): ...

Every change bumps `generation()`. `state()`, the in-memory kernel caches' key, adds the values of the
rule modules' declared switches (`options`), so kernels traced under the old rules, or under a switch
flipped since, are never reused:

    OWN_LAYOUT = True                              # read by the rule while a kernel is traced
    rules.options(__name__, "OWN_LAYOUT")
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass
from typing import Callable

VENDORS = ("cuda", "ascend", "cpu")
ANY = "*"


@dataclass(frozen=True)
class Rule:
    word: str
    pattern: str
    fn: Callable
    origin: str  # module that registered it, for error messages and `python -m codegen.show --rules`


_lock = threading.RLock()
_rules: dict[str, dict[str, Rule]] = {}
_docs: dict[str, str] = {}
_generation = 0
_builtins_loaded = False
# the rule modules' declared switches: module i's name i (two lists: state() maps getattr over them)
_option_modules: list = []
_option_names: list[str] = []


class NoRuleError(LookupError):
    """No lowering rule covers this word on this target."""


def _normalize(pattern: str) -> str:
    if pattern == ANY or pattern in VENDORS:
        return pattern
    from codegen import targets

    return targets.get(pattern).name


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True  # set first: the rule modules call register() while importing
        try:
            import codegen.lowering  # noqa: F401
        except BaseException:
            _builtins_loaded = False
            raise


def declare(word: str, doc: str) -> None:
    """Make `word` part of the vocabulary (a rule for an undeclared word declares it too)."""
    with _lock:
        _docs.setdefault(word, doc)


def register(word: str, target: str, fn: Callable | None = None, *, replace: bool = False, doc: str | None = None):
    """Register `fn` as the rule for `word` on `target` (usable as a decorator).

    Re-registering the same (word, pattern) raises unless `replace=True`, so two modules cannot
    silently fight over one rule.
    """
    if not isinstance(word, str) or not word.isidentifier():
        raise ValueError(f"word must be a Python identifier, got {word!r}")
    pattern = _normalize(target)

    def add(f: Callable) -> Callable:
        global _generation
        if not callable(f):
            raise TypeError(f"rule for {word!r} must be callable, got {type(f).__name__}")
        _load_builtins()  # first, so a user's replace=True is not undone by a later builtin import
        with _lock:
            slot = _rules.setdefault(word, {})
            if pattern in slot and not replace:
                raise ValueError(f"a rule for {word!r} on {pattern} is already registered by {slot[pattern].origin}; "
                                 "pass replace=True to override it")
            slot[pattern] = Rule(word, pattern, f, getattr(f, "__module__", "?"))
            if doc:
                _docs[word] = doc
            else:
                _docs.setdefault(word, (f.__doc__ or "").strip().split("\n")[0])
            _generation += 1
        return f

    return add(fn) if fn is not None else add


def unregister(word: str, target: str) -> None:
    global _generation
    pattern = _normalize(target)
    with _lock:
        if pattern not in _rules.get(word, {}):
            raise KeyError(f"no rule for {word!r} on {pattern}")
        del _rules[word][pattern]
        if not _rules[word]:
            del _rules[word]
        _generation += 1


@contextlib.contextmanager
def override(word: str, target: str, fn: Callable):
    """Use `fn` for `word` on `target` inside the block, then put back what was there."""
    pattern = _normalize(target)
    _load_builtins()
    with _lock:
        previous = _rules.get(word, {}).get(pattern)
    register(word, pattern, fn, replace=True)
    try:
        yield
    finally:
        if previous is None:
            unregister(word, pattern)
        else:
            register(word, pattern, previous.fn, replace=True)


def lookup(word: str, target) -> Rule:
    """The most specific rule for `word` on `target` (a codegen.targets.Target or name)."""
    from codegen import targets

    _load_builtins()
    t = targets.get(target)
    slot = _rules.get(word)
    if not slot:
        raise NoRuleError(f"{word!r} is not a tile word (known: {', '.join(sorted(_rules))})")
    for pattern in (t.name, t.vendor, ANY):
        if pattern in slot:
            return slot[pattern]
    have = ", ".join(sorted(slot))
    raise NoRuleError(f"no lowering rule for tile word {word!r} on {t.name} (rules exist for: {have}); "
                      f"register one with codegen.rules.register({word!r}, {t.name!r})")


def words() -> dict[str, str]:
    """Every word with a rule, and its one-line doc."""
    _load_builtins()
    return {w: _docs.get(w, "") for w in sorted(_rules)}


def table() -> dict[str, dict[str, str]]:
    """word -> {pattern: origin module}: what `python -m codegen.show --rules` prints."""
    _load_builtins()
    return {w: {p: r.origin for p, r in sorted(slot.items())} for w, slot in sorted(_rules.items())}


def generation() -> int:
    """A counter bumped by every registry change (built-in rules are loaded first)."""
    _load_builtins()
    return _generation


def options(module: str, *names: str) -> None:
    """Declare module-level switches of rule module `module` (by its __name__) that its rules read
    while a kernel is traced: their values are part of state(), so setting one at run time (a probe, a
    bench provider, a test's monkeypatch) gives kernels traced under the new value."""
    mod = sys.modules[module]
    for name in names:
        if not hasattr(mod, name):
            raise ValueError(f"{module} has no switch {name!r} to declare")
        with _lock:
            if (mod, name) not in zip(_option_modules, _option_names):
                _option_modules.append(mod)
                _option_names.append(name)


def state() -> tuple:
    """The in-memory kernel caches' key for the rules: generation() and every declared option's value
    (read on every eager op call: well under a microsecond)."""
    if not _builtins_loaded:
        _load_builtins()
    return (_generation, *map(getattr, _option_modules, _option_names))

