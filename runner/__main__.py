import sys

from runner import bytecode

bytecode.settle()  # before the CLI's own imports: where the runner keeps bytecode, they are cached too

from runner.cli import main  # noqa: E402

sys.exit(main())
