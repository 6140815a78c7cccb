#!/usr/bin/env python3
"""Caption many images through vlmserve (or any OpenAI-compatible server). See docs/captioning.md.

python scripts/caption.py photos/ --out captions.jsonl --server http://gpu1:8000 --server http://gpu2:8000
"""

import sys
from pathlib import Path

try:
    from vlmserve.caption import main
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from vlmserve.caption import main

if __name__ == "__main__":
    sys.exit(main(hard_exit=True))
