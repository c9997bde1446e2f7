"""Plain Python beneath everything (no torch): second processes, output files written whole and
never over a user's file unasked, the package's own files, signal handling, machine facts."""
