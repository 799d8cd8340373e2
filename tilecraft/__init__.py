"""Tilecraft: DeepSeek-class inference kernels written once in a portable tile vocabulary.

The distribution's real code lives in the top-level packages `ops`, `codegen`, `backends`,
`model`, `runtime` and `bench`; this package holds only the version and the env-var table.
"""

__version__ = "0.1.0"
