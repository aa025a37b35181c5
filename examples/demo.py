"""The README's main command as a script: same as `hf-kvtransfer demo` (accepts the same options).

    python examples/demo.py
    python examples/demo.py --source Qwen/Qwen3-0.6B --target Qwen/Qwen3-1.7B --mapper org/mapper --text eval.txt
"""

import sys

from hf_kvtransfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
