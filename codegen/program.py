"""Tile programs: an op's kernel, written once, traced per target into a TileLang PrimFunc.

    @tile_program("rmsnorm", targets=ALL_TARGETS, examples={"v3": dict(hidden=7168, dtype="bfloat16")})
    def rmsnorm(hidden, dtype, eps, block_rows):
        ...build and return a T.prim_func that uses codegen.tile words...

`program.compile(target, **params)` returns a cached, callable codegen.jit.Kernel.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from codegen import targets, tile

ALL_TARGETS = tuple(targets.TARGETS)

PROGRAMS: dict[str, "TileProgram"] = {}


@dataclass
class TileProgram:
    name: str
    builder: Callable[..., Any]
    targets: tuple[str, ...] = ALL_TARGETS
    examples: dict[str, dict] = field(default_factory=dict)
    pass_configs: Callable[[targets.Target, dict], dict] | None = None
    doc: str = ""

    def check_target(self, target) -> targets.Target:
        t = targets.get(target)
        if t.name not in self.targets:
            raise ValueError(f"tile program {self.name!r} has no lowering for {t.name}; it supports {', '.join(self.targets)}")
        return t

    def bind(self, params: dict) -> dict:
        """Fill defaults and reject unknown or missing parameters, naming them."""
        sig = inspect.signature(self.builder)
        try:
            bound = sig.bind(**params)
        except TypeError as e:
            raise TypeError(f"tile program {self.name!r}: {e}; its parameters are {list(sig.parameters)}") from None
        bound.apply_defaults()
        return dict(bound.arguments)

    def trace(self, target, **params):
        """The PrimFunc for `target`: every tile word resolved by that target's rules."""
        return self.traced(target, params)[0]

    def traced(self, target, params: dict):
        """(PrimFunc, pass configs that the rules used while tracing asked for: tile.require_pass_configs)."""
        t = self.check_target(target)
        params = self.bind(params)
        token = tile.new_state()
        try:
            with targets.using(t), t.tvm():
                prim = self.builder(**params)
            return prim, dict(tile.state().get("pass_configs", {}))
        finally:
            tile.end_state(token)

    def configs(self, target, params: dict, rule_configs: dict | None = None) -> dict:
        """The program's pass configs for `target`, then what its rules asked for (those win: a rule
        that places its own barriers is wrong with the compiler's on)."""
        t = targets.get(target)
        out = dict(self.pass_configs(t, self.bind(params))) if self.pass_configs else {}
        out.update(rule_configs or {})
        return out

    def compile(self, target, **params):
        from codegen import jit

        return jit.compile(self, target, **params)

    def source(self, target, **params) -> str:
        """Generated kernel source (CUDA C++, Ascend C or C), with no compiler run."""
        from codegen import jit

        return jit.lower_source(self, target, **params)

    def example(self, name: str | None = None) -> dict:
        if not self.examples:
            raise ValueError(f"tile program {self.name!r} has no examples")
        if name is None:
            return dict(next(iter(self.examples.values())))
        if name not in self.examples:
            raise ValueError(f"tile program {self.name!r} has no example {name!r}; it has {list(self.examples)}")
        return dict(self.examples[name])


def tile_program(name: str, *, targets=ALL_TARGETS, examples=None, pass_configs=None):
    """Register a builder function as the tile program `name`."""

    def wrap(builder):
        if name in PROGRAMS and PROGRAMS[name].builder.__qualname__ != builder.__qualname__:
            raise ValueError(f"a tile program named {name!r} already exists ({PROGRAMS[name].builder.__module__})")
        prog = TileProgram(name, builder, tuple(targets), dict(examples or {}), pass_configs,
                           (builder.__doc__ or "").strip())
        PROGRAMS[name] = prog
        return prog

    return wrap


def get(name: str) -> TileProgram:
    """A registered program; importing `ops` registers every op's programs."""
    if name not in PROGRAMS:
        import ops  # noqa: F401  (registers its programs)
    if name not in PROGRAMS:
        raise ValueError(f"no tile program {name!r}; known: {', '.join(sorted(PROGRAMS))}")
    return PROGRAMS[name]
