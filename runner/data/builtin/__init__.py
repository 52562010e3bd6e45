"""Built-in data: a small real corpus (CPython 3.11 code, docs, licenses) shipped as a snapshot,
built offline into pinned pools by `build_builtin`."""
