import sys

from vlmserve.caption import main

sys.exit(main(hard_exit=True))
