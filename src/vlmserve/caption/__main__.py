import sys

from . import main

sys.exit(main(hard_exit=True))
