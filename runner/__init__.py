"""runner: config-as-data LLM pretraining experiments with provable token accounting."""

import time as _time

__version__ = "0.1.0"
STARTED = _time.perf_counter()  #: when the package was first imported: a command's whole wall time starts here
