import sys

from liger_dispatch.tools.cli import main

sys.exit(main())
