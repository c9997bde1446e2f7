"""One case through every route: the one vocabulary of routes and fixes (labels), the float64
reference, the tile-by-tile emulation, the compiled kernels (JIT build and bindings) and their
benchmark. Importing this package imports nothing."""
