"""``python -m scissorhands.tools.cli``: quiet from the first import on; :func:`.app.main` hands Ctrl-C back."""

import signal
import sys

from . import _interrupted_while_importing

signal.signal(signal.SIGINT, _interrupted_while_importing)

from . import main  # noqa: E402  (after the handler: the imports it starts take seconds)

sys.exit(main())
