"""The scribble's tests run transformers' continuous batching on the CPU with tiny models from a config.
They need a transformers version the adapter supports (`make test` installs one and runs this folder again
under the other: scripts/test_other_transformers.sh); without one they are skipped with the reason."""
import pytest

from qsa_lab.scribble.versions import refusal


def pytest_collection_modifyitems(config, items):
    line = refusal()
    if line is None:
        return
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=line))
