import sys

from verl.cli.main import main

sys.exit(main())
