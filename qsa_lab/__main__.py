import sys

from qsa_lab.support.signals import install

install()  # first: Ctrl-C during the imports below is one line and exit 130 too (qsa_lab.support.signals)

from qsa_lab.app.cli import main  # noqa: E402

sys.exit(main())
