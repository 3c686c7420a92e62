import sys

from liger_dispatch.cli import main

sys.exit(main())
