"""The report's verification table (`qsa-lab repro`, `make demo`): its cases, the table and the
figures written beside it."""
