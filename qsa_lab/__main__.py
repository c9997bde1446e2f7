import sys

from qsa_lab.support.safepath import drop_current_folder, refuse_shadowed

# first: `python -m` put the current folder first on the import path; from here on nothing lying
# in it (a received folder's shlex.py or torch.py) is imported, as for the `qsa-lab` program, and a
# qsa_lab/ copy lying there, imported in place of the installed one, runs no further (where the
# installed package's .pth was read, support.installed_only, such a copy is never imported at all)
drop_current_folder()
refuse_shadowed("python -m qsa_lab")

from qsa_lab.support.signals import install  # noqa: E402

install()  # first: Ctrl-C during the imports below is one line and exit 130 too (qsa_lab.support.signals)

from qsa_lab.app.cli import main  # noqa: E402

sys.exit(main())
