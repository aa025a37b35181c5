"""The README's main command as a script: same as `hf-kvtransfer demo --family examples/family` (accepts the same
options; the family shipped next to this script is the default).

    python examples/demo.py
    python examples/demo.py --source Qwen/Qwen3-0.6B --target Qwen/Qwen3-1.7B --mapper org/mapper --text eval.txt
"""

import os
import sys
from pathlib import Path

from hf_kvtransfer.commands.cli import main

if __name__ == "__main__":
    family = os.environ.get("HF_KVTRANSFER_FAMILY") or str(Path(__file__).resolve().parent / "family")
    sys.exit(main(["demo", "--family", family, *sys.argv[1:]]))
