"""The `hf-kvtransfer` command line and what only it needs: the parser and error handling (`cli`), fit / solve
workflows that write mapper directories (`workflow`), the offline demo (`demo`), reports and plots
(`reporting`), the benchmark (`bench`), cost planning from model configs alone (`plan`, `model_configs` with the
shipped `known_configs/`). The top layer: may import every other subpackage.
"""
