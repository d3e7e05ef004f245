"""tinydiff: a small, tested reference for masked diffusion LMs and fast-inference methods.

The top level is the core, one concept a file in the order the lessons teach; the subpackages are wings
(io, extras, fast, train, tools, bench) that import the core, never the reverse (docs/DESIGN.md)."""
