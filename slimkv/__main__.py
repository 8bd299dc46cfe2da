import sys

from slimkv.cli import main

sys.exit(main())
