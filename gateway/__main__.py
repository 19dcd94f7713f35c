import sys

from gateway.cli import main

sys.exit(main())
