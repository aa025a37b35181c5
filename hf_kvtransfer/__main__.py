"""`python -m hf_kvtransfer ...` (and `torchrun -m hf_kvtransfer fit ...`): the `hf-kvtransfer` command."""

from .commands.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
