"""The command line: argv to calls. `qsa-lab --help` and argument errors answer before torch is
imported: nothing here imports torch at module level."""
