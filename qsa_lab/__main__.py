import sys

from .signals import install

install()  # first: Ctrl-C during the imports below is one line and exit 130 too (qsa_lab.signals)

from .cli import main  # noqa: E402

sys.exit(main())
